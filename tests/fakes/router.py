"""The SDK tests' fake kvturn router: answers like docs/http-api.md section A with canned
replies, or with scripted responses; plus the replies, chunks and clock the tests build."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx2

from tests.fakes.router_api import Recorded, RouterAPI

__all__ = ["AsyncBody", "FakeClock", "FakeRouter", "Recorded", "SyncBody", "chat_chunks",
           "chat_completion", "completion", "completion_chunks", "error", "sse_bytes",
           "tool_call_deltas"]


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
    chunks += [chunk(delta) for delta in tool_call_deltas(tool_calls or ())]
    if finish:
        chunks.append(chunk({}, "tool_calls" if tool_calls else "stop"))
    return chunks


def tool_call_deltas(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each tool call as vLLM streams it: id, name and the first half of the arguments, then
    the rest of the arguments."""
    deltas = []
    for index, call in enumerate(tool_calls):
        arguments = call["function"]["arguments"]
        half = len(arguments) // 2
        deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"],
                                                    "arguments": arguments[:half]}}]})
        deltas.append({"tool_calls": [{"index": index,
                                       "function": {"arguments": arguments[half:]}}]})
    return deltas


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


class FakeRouter(RouterAPI):
    """Answers chat/completions like the router (reuse report from ``RouterAPI``) with canned
    replies; ``script`` queues one-off responses."""

    def __init__(self, *, async_bodies: bool = False) -> None:
        super().__init__()
        self.async_bodies = async_bodies
        self.script: deque[httpx2.Response | Responder] = deque()
        self.reply: Callable[[Recorded], dict[str, Any]] = lambda _: chat_completion()
        self.stream_reply: Callable[[Recorded], list[dict[str, Any]]] = lambda _: chat_chunks()
        self.bodies: list[SyncBody | AsyncBody] = []

    def to(self, suffix: str, method: str | None = None) -> list[Recorded]:
        return [r for r in self.requests if r.path.endswith(suffix)
                and (method is None or r.method == method)]

    def handle_turn(self, recorded: Recorded) -> httpx2.Response:
        if self.script:
            item = self.script.popleft()
            return item if isinstance(item, httpx2.Response) else item(recorded)
        if recorded.path == "/v1/models":
            return httpx2.Response(200, json={"object": "list", "data": [
                {"id": "kvturn-tiny", "object": "model", "created": 1, "owned_by": "kvturn"}]})
        return self.answer(recorded)

    def answer(self, recorded: Recorded, status: int = 200) -> httpx2.Response:
        body = recorded.body or {}
        headers = self.reuse_headers(recorded)
        self.retain(recorded, len(json.dumps(body)))
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
