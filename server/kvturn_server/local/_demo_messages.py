"""The demo's agent on Anthropic's Messages API (``kvturn demo --api messages``).

The same agent as ``examples/langgraph_agent.py`` (its tools, system prompt, question and
forced-tool schedule), written as a plain loop over ``POST /v1/messages`` because no
Anthropic client is a dependency: streamed turns, tool results sent back as ``tool_result``
blocks. With a conversation, every turn carries it in ``X-Conversation-ID``; kvturn's client
also releases it at the end (a stock client, for a stock router's conditional disaggregation,
sends the header and nothing else). The tools (shorter than any lease) need no keepalive.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

import httpx2

from kvturn.wire import HEADER_CONVERSATION_ID, HEADER_REUSE, conversation_path

Start = Callable[[], None]
End = Callable[[str | None, str | None], None]


def read_stream(lines: Iterable[str], first_token: Callable[[], None]) -> list[dict[str, Any]]:
    """A Messages SSE stream's content blocks (text, tool_use with its input parsed); calls
    ``first_token`` at the first content delta."""
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, str] = {}
    seen = False
    for event in _events(lines):
        kind = event.get("type")
        if kind == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
        elif kind == "content_block_delta":
            if not seen:
                seen = True
                first_token()
            delta, index = event["delta"], event["index"]
            if delta.get("type") == "text_delta":
                blocks[index]["text"] = blocks[index].get("text", "") + delta["text"]
            elif delta.get("type") == "input_json_delta":
                partial[index] = partial.get(index, "") + delta["partial_json"]
        elif kind == "error":
            raise RuntimeError(f"the Messages stream failed: {event.get('error')}")
    for index, text in partial.items():
        blocks[index]["input"] = json.loads(text) if text else {}
    return [blocks[i] for i in sorted(blocks)]


def _events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            if data:
                yield json.loads(data)


def run_messages_agent(agent: ModuleType, root_url: str, model: str, turns: int, *,
                       conversation: str | None, release: bool = True,
                       tool_latency: float, tag: str,
                       manual: int, start: Start, first_token: Callable[[], None], end: End,
                       max_tokens: int = 140, timeout: float = 120.0,
                       transport: httpx2.BaseTransport | None = None) -> None:
    """Run ``turns`` model turns of ``agent`` (the example module) against ``root_url``'s
    ``/v1/messages``; ``start``, ``first_token`` and ``end(tool, reuse)`` frame each turn.
    ``conversation``: sent as ``X-Conversation-ID`` on every turn (None: no id);
    ``release``: end it with ``DELETE /kvturn/v1/conversations/{id}`` (kvturn's client; a
    stock client does not). ``transport``: for tests."""
    system = f"[{tag}] {agent.SYSTEM}" if tag else agent.SYSTEM
    if manual:
        system = f"{system} {agent.tool_manual(manual)}"
    tools = [{"name": name, "description": description,
              "input_schema": {"type": "object", "properties": {},
                               "additionalProperties": False}}
             for name, description, _ in agent.TOOLS]
    results = {name: result for name, _, result in agent.TOOLS}
    messages: list[dict[str, Any]] = [{"role": "user", "content": agent.QUESTION}]
    headers = {HEADER_CONVERSATION_ID: conversation} if conversation else {}
    with httpx2.Client(timeout=timeout, transport=transport) as http:
        try:
            for turn in range(turns):
                forced = agent.TOOLS[turn % len(agent.TOOLS)][0]
                body = {"model": model, "system": system, "tools": tools,
                        "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                        "stream": True, "tool_choice": {"type": "tool", "name": forced}
                        if turn < turns - 1 else {"type": "auto"}}
                start()
                with http.stream("POST", f"{root_url}/v1/messages", json=body,
                                 headers=headers) as response:
                    if response.status_code != 200:
                        response.read()
                        raise RuntimeError(f"/v1/messages answered {response.status_code}: "
                                           f"{response.text}")
                    content = read_stream(response.iter_lines(), first_token)
                uses = [block for block in content if block["type"] == "tool_use"]
                end(uses[0]["name"] if uses else None, response.headers.get(HEADER_REUSE))
                messages.append({"role": "assistant", "content": content})
                if not uses:
                    return
                time.sleep(tool_latency)
                messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": use["id"],
                     "content": results.get(use["name"], "unknown tool")} for use in uses]})
        finally:
            if conversation and release:
                http.delete(root_url + conversation_path(conversation), headers=headers)
