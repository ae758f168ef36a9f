"""The integration tests' fake kvturn router: plays a tool-calling model (tool calls for a few
rounds, then a final answer; SSE when ``stream`` is set) on Chat Completions and on Responses;
the router API around it (reuse headers, keepalive, release, recording) is ``RouterAPI``'s."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, unquote

import httpx2

from tests.fakes.router import tool_call_deltas
from tests.fakes.router_api import CONVERSATIONS, Recorded, RouterAPI, api_error

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"


def _response_rounds_since_user(items: list[dict[str, Any]] | str) -> int:
    """Tool rounds in a Responses input since its last user message: runs of function calls."""
    rounds = 0
    following_call = False
    for item in reversed(items if isinstance(items, list) else []):
        if item.get("role") == "user":
            break
        is_call = item.get("type") == "function_call"
        if following_call and not is_call:
            rounds += 1
        following_call = is_call
    return rounds + int(following_call)


def _rounds_since_user(messages: list[dict[str, Any]]) -> int:
    rounds = 0
    for message in reversed(messages):
        if message.get("role") == "user":
            break
        if message.get("role") == "assistant" and message.get("tool_calls"):
            rounds += 1
    return rounds


class ToolCallingRouter(RouterAPI):
    """``tool_rounds``: replies with tool calls before the final answer (per user message);
    ``parallel``: tool calls per reply. Arguments are compact JSON, as servers write them."""

    def __init__(self, tool_rounds: int = 2, parallel: int = 1,
                 on_turn: Callable[[Recorded], None] | None = None) -> None:
        super().__init__()
        self.tool_rounds = tool_rounds
        self.parallel = parallel
        # Called with each chat request before it is answered (e.g. to block a branch).
        self.on_turn = on_turn
        self._calls = 0

    # --- inspection -------------------------------------------------------------------------

    def turn_ids(self) -> list[str | None]:
        return [r.conversation for r in self.turns()]

    def keepalives(self, conversation: str | None = None) -> list[str]:
        return [unquote(r.raw_path[len(CONVERSATIONS):-len("/keepalive")])
                for r in self.requests
                if r.method == "POST" and r.raw_path.endswith("/keepalive")
                and (conversation is None or r.raw_path == _path(conversation, "/keepalive"))]

    def releases(self) -> list[str]:
        return [unquote(r.raw_path[len(CONVERSATIONS):]) for r in self.requests
                if r.method == "DELETE" and r.raw_path.startswith(CONVERSATIONS)]

    # --- the turns --------------------------------------------------------------------------

    def handle_turn(self, recorded: Recorded) -> httpx2.Response:
        if recorded.path not in (CHAT, RESPONSES):
            return api_error(404, "unknown route", type_="not_found")
        if self.on_turn is not None:
            self.on_turn(recorded)
        body = recorded.body
        headers = self.reuse_headers(recorded)
        if recorded.path == RESPONSES:
            return self._response(recorded, headers)
        self.retain(recorded, len(json.dumps(body["messages"])))
        message = self._reply(body)
        if not body.get("stream"):
            return httpx2.Response(200, headers=headers, json={
                "id": "chatcmpl-1", "object": "chat.completion", "created": 1,
                "model": body.get("model"),
                "choices": [{"index": 0, "message": message,
                             "finish_reason": "tool_calls" if message["tool_calls"] else "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}})
        events = [f"data: {json.dumps(chunk)}\n\n" for chunk in _chunks(message, body)]
        events.append("data: [DONE]\n\n")
        return httpx2.Response(200, headers={**headers, "content-type": "text/event-stream"},
                               content="".join(events).encode())

    def _response(self, recorded: Recorded, headers: dict[str, str]) -> httpx2.Response:
        """A Responses turn: the same model, its reply as output items."""
        body = recorded.body
        self.retain(recorded, len(json.dumps(body["input"])))
        tools = [{"type": "function", "function": {"name": t["name"],
                                                    "parameters": t.get("parameters")}}
                 for t in body.get("tools") or () if t.get("type") == "function"]
        forced = body.get("tool_choice")
        if isinstance(forced, dict):
            forced = {"type": "function", "function": {"name": forced["name"]}}
        message = self._reply({"tools": tools, "tool_choice": forced},
                              _response_rounds_since_user(body["input"]))
        number = self._calls
        output: list[dict[str, Any]] = [
            {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
             "name": call["function"]["name"], "arguments": call["function"]["arguments"],
             "status": "completed"} for call in message["tool_calls"]]
        if message["content"]:
            output.append({"type": "message", "id": f"msg_{number}", "role": "assistant",
                           "status": "completed", "content": [
                               {"type": "output_text", "text": message["content"],
                                "annotations": []}]})
        response = {"id": f"resp_{number}", "object": "response", "created_at": 0,
                    "model": body.get("model"), "status": "completed",
                    "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                    "output": output, "usage": {
                        "input_tokens": 10, "output_tokens": 2, "total_tokens": 12,
                        "input_tokens_details": {"cached_tokens": 0},
                        "output_tokens_details": {"reasoning_tokens": 0}}}
        if not body.get("stream"):
            return httpx2.Response(200, headers=headers, json=response)
        events = [{"type": "response.created",
                   "response": {**response, "status": "in_progress", "output": []}}]
        for index, item in enumerate(output):
            at = {"output_index": index, "item_id": item["id"]}
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": {**item, "status": "in_progress"}})
            if item["type"] == "function_call":
                events.append({"type": "response.function_call_arguments.delta", **at,
                               "delta": item["arguments"]})
            else:
                events += [{"type": "response.output_text.delta", **at, "content_index": 0,
                            "delta": word if i == 0 else f" {word}", "logprobs": []}
                           for i, word in enumerate(item["content"][0]["text"].split(" "))]
            events.append({"type": "response.output_item.done", "output_index": index,
                           "item": item})
        events.append({"type": "response.completed", "response": response})
        sse = "".join(f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': n})}\n\n"
                      for n, e in enumerate(events))
        return httpx2.Response(200, headers={**headers, "content-type": "text/event-stream"},
                               content=sse.encode())

    def _reply(self, body: dict[str, Any], rounds: int | None = None) -> dict[str, Any]:
        schemas = {tool["function"]["name"]: tool["function"].get("parameters") or {}
                   for tool in body.get("tools") or ()}
        tools = list(schemas)
        forced = body.get("tool_choice")
        if rounds is None:
            rounds = _rounds_since_user(body["messages"])
        with self._changed:
            self._calls += 1
            number = self._calls
        if isinstance(forced, dict) or (tools and forced != "none"
                                        and rounds < self.tool_rounds):
            if isinstance(forced, dict):
                names = [forced["function"]["name"]]
            else:
                names = [tools[(rounds + i) % len(tools)] for i in range(self.parallel)]
            calls = [{"id": f"call_{number}_{i}", "type": "function",
                      "function": {"name": name, "arguments": _arguments(
                          schemas.get(name, {}), f"{name}-{number}")}}
                     for i, name in enumerate(names)]
            return {"role": "assistant", "content": None, "tool_calls": calls}
        return {"role": "assistant", "content": f"final answer {number}", "tool_calls": []}


def _arguments(schema: dict[str, Any], value: str) -> str:
    """Compact JSON (as structured output writes it) with ``value`` in every property."""
    properties = schema.get("properties") or {}
    return json.dumps({name: value for name in properties}, separators=(",", ":"))


def _path(conversation: str, action: str = "") -> str:
    return f"{CONVERSATIONS}{quote(conversation, safe='')}{action}"


def _chunks(message: dict[str, Any], body: dict[str, Any]) -> list[dict[str, Any]]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                "model": body.get("model"),
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""})]
    if message["content"]:
        words = message["content"].split(" ")
        for i, word in enumerate(words):
            out.append(chunk({"content": word if i == 0 else " " + word}))
    out += [chunk(delta) for delta in tool_call_deltas(message["tool_calls"])]
    out.append(chunk({}, "tool_calls" if message["tool_calls"] else "stop"))
    if (body.get("stream_options") or {}).get("include_usage"):
        out.append({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                    "model": body.get("model"), "choices": [],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}})
    return out
