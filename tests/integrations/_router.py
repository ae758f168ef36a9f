"""A fake kvturn router for the LangGraph integration's tests: an ``httpx2.MockTransport``
handler that plays a tool-calling model (tool calls for a few rounds, then a final answer; SSE
when ``stream`` is set), answers with the router's reuse headers, serves the keepalive and
release endpoints, and records every request."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httpx2

CONVERSATIONS = "/kvturn/v1/conversations/"
CHAT = "/v1/chat/completions"


@dataclass
class Recorded:
    method: str
    path: str
    headers: httpx2.Headers
    body: Any

    @property
    def conversation(self) -> str | None:
        """The id the router would use: body ``conversation_id``, else the header."""
        if isinstance(self.body, dict) and self.body.get("conversation_id") is not None:
            return str(self.body["conversation_id"])
        return self.headers.get("x-conversation-id")

    @property
    def no_reuse(self) -> str | None:
        return self.headers.get("x-kvturn-no-reuse")


def _rounds_since_user(messages: list[dict[str, Any]]) -> int:
    rounds = 0
    for message in reversed(messages):
        if message.get("role") == "user":
            break
        if message.get("role") == "assistant" and message.get("tool_calls"):
            rounds += 1
    return rounds


@dataclass
class FakeRouter:
    """``tool_rounds``: replies with tool calls before the final answer (per user message);
    ``parallel``: tool calls per reply. Arguments are compact JSON, as servers write them."""

    tool_rounds: int = 2
    parallel: int = 1
    requests: list[Recorded] = field(default_factory=list)
    retained: dict[str, int] = field(default_factory=dict)
    keepalive_status: int = 200
    # Called with each chat request before it is answered (e.g. to block a branch).
    on_turn: Callable[[Recorded], None] | None = None
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _calls: int = 0

    # --- inspection -------------------------------------------------------------------------

    def turns(self) -> list[Recorded]:
        return [r for r in self.requests if r.path == CHAT]

    def turn_ids(self) -> list[str | None]:
        return [r.conversation for r in self.turns()]

    def keepalives(self, conversation: str | None = None) -> list[str]:
        return [unquote(r.path[len(CONVERSATIONS):-len("/keepalive")]) for r in self.requests
                if r.method == "POST" and r.path.endswith("/keepalive")
                and (conversation is None or r.path == _path(conversation, "/keepalive"))]

    def releases(self) -> list[str]:
        return [unquote(r.path[len(CONVERSATIONS):]) for r in self.requests
                if r.method == "DELETE" and r.path.startswith(CONVERSATIONS)]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    # --- the handler ------------------------------------------------------------------------

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        content = request.content
        body = json.loads(content) if content else None
        # raw_path keeps the percent-encoding of ids that contain "/"
        recorded = Recorded(request.method, request.url.raw_path.decode(), request.headers,
                            body)
        with self._changed:
            self.requests.append(recorded)
            self._changed.notify_all()
        if recorded.path.startswith(CONVERSATIONS):
            return self._conversation_endpoint(recorded)
        if recorded.path == CHAT:
            if self.on_turn is not None:
                self.on_turn(recorded)
            return self._chat(recorded)
        return httpx2.Response(404, json={"error": {"message": "unknown route"}})

    def _chat(self, recorded: Recorded) -> httpx2.Response:
        body = recorded.body
        conversation = recorded.conversation
        headers = {"x-request-id": f"req-{len(self.requests)}"}
        if conversation is None:
            headers.update({"X-KVTurn-Reuse": "miss", "X-KVTurn-Reused-Tokens": "0"})
        else:
            headers["X-KVTurn-Conversation"] = conversation
            if recorded.no_reuse:
                outcome, tokens = "disabled", 0
            elif conversation in self.retained:
                outcome, tokens = "hit", self.retained[conversation]
            else:
                outcome, tokens = "miss", 0
            headers.update({"X-KVTurn-Reuse": outcome, "X-KVTurn-Reused-Tokens": str(tokens)})
            with self._changed:
                self.retained[conversation] = len(json.dumps(body["messages"]))
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

    def _reply(self, body: dict[str, Any]) -> dict[str, Any]:
        schemas = {tool["function"]["name"]: tool["function"].get("parameters") or {}
                   for tool in body.get("tools") or ()}
        tools = list(schemas)
        forced = body.get("tool_choice")
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

    def _conversation_endpoint(self, recorded: Recorded) -> httpx2.Response:
        rest = recorded.path[len(CONVERSATIONS):]
        if recorded.method == "POST" and rest.endswith("/keepalive"):
            conversation = unquote(rest[: -len("/keepalive")])
            if self.keepalive_status != 200 or conversation not in self.retained:
                return httpx2.Response(404, json={"error": {
                    "message": "no retention", "type": "not_found", "param": None,
                    "code": "no_retention"}})
            return httpx2.Response(200, json={
                "conversation_id": conversation, "retained": True, "expires_in": 480.0,
                "hold_remaining": 3000.0, "num_tokens": self.retained[conversation]})
        if recorded.method == "DELETE":
            conversation = unquote(rest)
            with self._changed:
                released = self.retained.pop(conversation, None) is not None
            return httpx2.Response(200, json={"conversation_id": conversation,
                                              "released": released})
        return httpx2.Response(404, json={"error": {"message": "unknown endpoint"}})


def _arguments(schema: dict[str, Any], value: str) -> str:
    """Compact JSON (as structured output writes it) with ``value`` in every property."""
    properties = schema.get("properties") or {}
    return json.dumps({name: value for name in properties}, separators=(",", ":"))


def _path(conversation: str, action: str = "") -> str:
    from urllib.parse import quote

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
    for index, call in enumerate(message["tool_calls"]):
        arguments = call["function"]["arguments"]
        half = len(arguments) // 2
        out.append(chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                          "function": {"name": call["function"]["name"],
                                                       "arguments": arguments[:half]}}]}))
        out.append(chunk({"tool_calls": [{"index": index,
                                          "function": {"arguments": arguments[half:]}}]}))
    out.append(chunk({}, "tool_calls" if message["tool_calls"] else "stop"))
    if (body.get("stream_options") or {}).get("include_usage"):
        out.append({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                    "model": body.get("model"), "choices": [],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}})
    return out
