"""A fake kvturn router for the SDK's tests: an ``httpx2.MockTransport`` handler that records
every request and answers like docs/http-api.md section A, or with scripted responses."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import httpx2

CONVERSATIONS = "/kvturn/v1/conversations/"


@dataclass
class Recorded:
    method: str
    path: str
    raw_path: str
    headers: httpx2.Headers
    body: Any

    @property
    def conversation_header(self) -> str | None:
        return self.headers.get("x-conversation-id")

    @property
    def no_reuse(self) -> str | None:
        return self.headers.get("x-kvturn-no-reuse")


def chat_completion(text: str | None = "Hello", *, reasoning: str | None = None,
                    tool_calls: list[dict[str, Any]] | None = None, n: int = 1,
                    model: str = "kvturn-tiny") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None,
                               "tool_calls": tool_calls or [], "annotations": None}
    if reasoning is not None:
        message["reasoning"] = reasoning
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": i, "finish_reason": "stop", "message": message}
                        for i in range(n)],
            "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}}


def completion(text: str = " world", *, token_ids: list[int] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "stop",
                              "logprobs": None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "kvturn-tiny",
            "choices": [choice]}


def chat_chunks(text: str = "Hello", *, reasoning: str | None = None,
                tool_calls: list[dict[str, Any]] | None = None,
                finish: bool = True) -> list[dict[str, Any]]:
    """Deltas the way vLLM streams them: role first, then content pieces, then finish."""
    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                "model": "kvturn-tiny",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    for piece in (reasoning or "").split(" ") if reasoning else ():
        chunks.append(chunk({"reasoning": piece + " "}))
    for piece in _pieces(text):
        chunks.append(chunk({"content": piece}))
    for index, call in enumerate(tool_calls or ()):
        arguments = call["function"]["arguments"]
        half = len(arguments) // 2
        chunks.append(chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                             "function": {"name": call["function"]["name"],
                                                          "arguments": arguments[:half]}}]}))
        chunks.append(chunk({"tool_calls": [{"index": index,
                                             "function": {"arguments": arguments[half:]}}]}))
    if finish:
        chunks.append(chunk({}, "tool_calls" if tool_calls else "stop"))
    return chunks


def completion_chunks(text: str = " world") -> list[dict[str, Any]]:
    pieces = _pieces(text)
    return [{"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "kvturn-tiny",
             "choices": [{"index": 0, "text": piece, "logprobs": None,
                          "finish_reason": "stop" if i == len(pieces) - 1 else None}]}
            for i, piece in enumerate(pieces)]


def _pieces(text: str) -> list[str]:
    # Split after each space, keeping the spaces: "a b" -> ["a ", "b"].
    out, current = [], ""
    for ch in text:
        current += ch
        if ch == " ":
            out.append(current)
            current = ""
    if current:
        out.append(current)
    return out or [""]


def sse_bytes(chunks: list[dict[str, Any]], *, done: bool = True) -> list[bytes]:
    events = [f"data: {json.dumps(c)}\n\n".encode() for c in chunks]
    if done:
        events.append(b"data: [DONE]\n\n")
    return events


class SyncBody:
    """A streamed response body that counts how many events the client has pulled."""

    def __init__(self, events: list[bytes]) -> None:
        self.events = events
        self.produced = 0

    def __iter__(self) -> Iterator[bytes]:
        for event in self.events:
            self.produced += 1
            yield event


class AsyncBody:
    """The async twin of SyncBody (httpx2 needs an async iterable for an AsyncClient)."""

    def __init__(self, events: list[bytes]) -> None:
        self.events = events
        self.produced = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            self.produced += 1
            await asyncio.sleep(0)
            yield event


Responder = Callable[[Recorded], httpx2.Response]


class FakeRouter:
    """Answers chat/completions like the router: reuse is ``hit`` when the conversation's last
    turn was retained and the request did not say ``X-KVTurn-No-Reuse``; keepalive and release
    follow the conversation endpoints' contract. ``script`` queues one-off responses."""

    def __init__(self, *, async_bodies: bool = False) -> None:
        self.async_bodies = async_bodies
        self.requests: list[Recorded] = []
        self.script: deque[httpx2.Response | Responder] = deque()
        self.reply: Callable[[Recorded], dict[str, Any]] = lambda _: chat_completion()
        self.stream_reply: Callable[[Recorded], list[dict[str, Any]]] = lambda _: chat_chunks()
        self.retained: dict[str, int] = {}
        self.keepalive_status = 200
        self.bodies: list[SyncBody | AsyncBody] = []
        self._changed = threading.Condition()

    # --- inspection -------------------------------------------------------------------------

    def turns(self) -> list[Recorded]:
        return [r for r in self.requests if r.path in ("/v1/chat/completions", "/v1/completions")]

    def to(self, suffix: str, method: str | None = None) -> list[Recorded]:
        return [r for r in self.requests if r.path.endswith(suffix)
                and (method is None or r.method == method)]

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
        try:
            body = json.loads(content) if content else None
        except ValueError:
            body = content  # e.g. a multipart upload
        recorded = Recorded(request.method, request.url.path,
                            request.url.raw_path.decode(), request.headers, body)
        with self._changed:
            self.requests.append(recorded)
            self._changed.notify_all()
        if recorded.raw_path.startswith(CONVERSATIONS):
            return self._conversation_endpoint(recorded)
        if self.script:
            item = self.script.popleft()
            return item if isinstance(item, httpx2.Response) else item(recorded)
        if recorded.path == "/v1/models":
            return httpx2.Response(200, json={"object": "list", "data": [
                {"id": "kvturn-tiny", "object": "model", "created": 1, "owned_by": "kvturn"}]})
        return self.answer(recorded)

    def answer(self, recorded: Recorded, status: int = 200) -> httpx2.Response:
        body = recorded.body or {}
        conversation = body.get("conversation_id") or recorded.conversation_header
        headers = self.reuse_headers(recorded)
        if conversation is not None:
            self.retained[conversation] = len(json.dumps(body))
        if body.get("stream"):
            chunks = (self.stream_reply(recorded) if recorded.path.endswith("chat/completions")
                      else completion_chunks())
            events = sse_bytes(chunks)
            stream_body = AsyncBody(events) if self.async_bodies else SyncBody(events)
            self.bodies.append(stream_body)
            return httpx2.Response(status, headers={**headers,
                                                    "content-type": "text/event-stream"},
                                   content=stream_body)
        reply = (self.reply(recorded) if recorded.path.endswith("chat/completions")
                 else completion())
        return httpx2.Response(status, headers=headers, json=reply)

    def reuse_headers(self, recorded: Recorded) -> dict[str, str]:
        body = recorded.body or {}
        conversation = body.get("conversation_id") or recorded.conversation_header
        headers = {"x-request-id": f"req-{len(self.requests)}"}
        if conversation is None:
            return {**headers, "X-KVTurn-Reuse": "miss", "X-KVTurn-Reused-Tokens": "0"}
        headers["X-KVTurn-Conversation"] = conversation
        if recorded.no_reuse:
            outcome, tokens = "disabled", 0
        elif conversation in self.retained:
            outcome, tokens = "hit", self.retained[conversation]
        else:
            outcome, tokens = "miss", 0
        return {**headers, "X-KVTurn-Reuse": outcome, "X-KVTurn-Reused-Tokens": str(tokens)}

    def _conversation_endpoint(self, recorded: Recorded) -> httpx2.Response:
        rest = recorded.raw_path[len(CONVERSATIONS):]
        if recorded.method == "POST" and rest.endswith("/keepalive"):
            conversation = unquote(rest[: -len("/keepalive")])
            if self.keepalive_status == 404 or conversation not in self.retained:
                return httpx2.Response(404, json={"error": {
                    "message": "no retention", "type": "not_found", "param": None,
                    "code": "no_retention"}})
            if self.keepalive_status != 200:
                return httpx2.Response(self.keepalive_status, json={"error": {
                    "message": "backend trouble", "type": "server_error", "param": None,
                    "code": None}})
            return httpx2.Response(200, json={
                "conversation_id": conversation, "retained": True, "expires_in": 480.0,
                "hold_remaining": 3000.0, "num_tokens": self.retained[conversation]})
        if recorded.method == "DELETE":
            conversation = unquote(rest)
            released = self.retained.pop(conversation, None) is not None
            return httpx2.Response(200, json={"conversation_id": conversation,
                                              "released": released})
        return httpx2.Response(404, json={"error": {"message": "unknown endpoint",
                                                    "type": "not_found", "param": None,
                                                    "code": None}})


def error(status: int, *, headers: dict[str, str] | None = None,
          message: str = "backend trouble") -> httpx2.Response:
    return httpx2.Response(status, headers=headers or {}, json={"error": {
        "message": message, "type": "server_error", "param": None, "code": None}})


class FakeClock:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)
        await asyncio.sleep(0)
