"""What the agent benchmarks' tests (``test_bench_agent.py``, ``test_bench_fleet.py``) fake: a
router's conversation endpoints, a streamed chat completion, a turn that fails, the client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote

import httpx2

import kvturn

Handler = Callable[[httpx2.Request], httpx2.Response]
CONVERSATIONS = "/kvturn/v1/conversations/"


def sse(data: dict[str, Any]) -> str:
    return "data: " + json.dumps(data) + "\n\n"


def prompt_size(messages: Sequence[dict[str, Any]]) -> int:
    """The fakes' prompt length: each message's words plus 4 tokens of framing."""
    return sum(len(str(m.get("content") or "").split()) + 4 for m in messages)


def chat_stream(model: str, pieces: Sequence[str], prompt_tokens: int) -> bytes:
    """A streamed chat completion as vLLM sends it: the role, one chunk per piece, the finish
    (``length``), the usage, ``[DONE]``."""
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1,
            "model": model}
    events = [sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""},
                                         "finish_reason": None}]})]
    events += [sse({**base, "choices": [{"index": 0, "delta": {"content": piece},
                                         "finish_reason": None}]}) for piece in pieces]
    events.append(sse({**base, "choices": [{"index": 0, "delta": {},
                                            "finish_reason": "length"}]}))
    events.append(sse({**base, "choices": [], "usage": {
        "prompt_tokens": prompt_tokens, "completion_tokens": len(pieces),
        "total_tokens": prompt_tokens + len(pieces)}}))
    events.append("data: [DONE]\n\n")
    return "".join(events).encode()


class ConversationEndpoints:
    """A router's keepalive and release endpoints, and what they were asked: the conversations
    renewed (``keepalive_seen`` is set at each), released, and still live."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.keepalives: list[str] = []
        self.released: list[str] = []
        self.live: set[str] = set()
        self.keepalive_seen = asyncio.Event()

    def conversation_endpoint(self, request: httpx2.Request) -> httpx2.Response | None:
        """The answer to a conversation endpoint's request; None for any other path."""
        path = request.url.path
        if not path.startswith(CONVERSATIONS):
            return None
        rest = path.removeprefix(CONVERSATIONS)
        if request.method == "POST" and rest.endswith("/keepalive"):
            conversation = unquote(rest.removesuffix("/keepalive"))
            self.keepalives.append(conversation)
            self.keepalive_seen.set()
            return httpx2.Response(200, json={
                "conversation_id": conversation, "retained": True, "expires_in": 48.0,
                "hold_remaining": 3000.0, "num_tokens": 100})
        conversation = unquote(rest)
        self.released.append(conversation)
        self.live.discard(conversation)
        return httpx2.Response(200, json={"conversation_id": conversation, "released": True})


def failing_turn(handle: Handler, n: int) -> Handler:
    """``handle``, but the ``n``-th chat completion is refused (400, as vLLM refuses a bad
    request)."""
    calls = 0

    def flaky(request: httpx2.Request) -> httpx2.Response:
        nonlocal calls
        if request.url.path == "/v1/chat/completions":
            calls += 1
            if calls == n:
                return httpx2.Response(400, json={"error": {
                    "message": "bad", "type": "invalid_request_error", "param": None,
                    "code": None}})
        return handle(request)
    return flaky


def mock_client(handle: Handler) -> kvturn.AsyncOpenAI:
    """A kvturn client whose requests ``handle`` answers in process (no retries)."""
    http = httpx2.AsyncClient(transport=httpx2.MockTransport(handle))
    return kvturn.AsyncOpenAI(base_url="http://router.test/v1", api_key="bench", max_retries=0,
                              http_client=http)
