"""The agent benchmarks' fake routers (``test_bench_agent.py``, ``test_bench_fleet.py``,
``test_bench_trace.py``): a router's conversation endpoints, a streamed chat completion, a turn
that fails, the client, one router per benchmark, and the fleet's probe over a fake router.

Not ``RouterAPI``: the benchmarks' tests are async and wait on an ``asyncio.Event`` for
keepalives, and their routers renew any conversation (a benchmark measures the client, not
lease expiry), where ``RouterAPI``'s keepalive answers 404 for what it does not retain."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any
from urllib.parse import unquote

import httpx2

import kvturn
from kvturn_server.bench._fleet_agents import Counters

MIB = 1024 * 1024
Handler = Callable[[httpx2.Request], httpx2.Response]
CONVERSATIONS = "/kvturn/v1/conversations/"


def sse(data: dict[str, Any]) -> str:
    return "data: " + json.dumps(data) + "\n\n"


def prompt_size(messages: Sequence[dict[str, Any]]) -> int:
    """The fakes' prompt length: each message's words plus 4 tokens of framing."""
    return sum(len(str(m.get("content") or "").split()) + 4 for m in messages)


def chat_stream(model: str, pieces: Sequence[str], prompt_tokens: int,
                cached_tokens: int | None = None) -> bytes:
    """A streamed chat completion as vLLM sends it: the role, one chunk per piece, the finish
    (``length``), the usage (with ``prompt_tokens_details`` given ``cached_tokens``, as vLLM
    with ``--enable-prompt-tokens-details``), ``[DONE]``."""
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1,
            "model": model}
    events = [sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""},
                                         "finish_reason": None}]})]
    events += [sse({**base, "choices": [{"index": 0, "delta": {"content": piece},
                                         "finish_reason": None}]}) for piece in pieces]
    events.append(sse({**base, "choices": [{"index": 0, "delta": {},
                                            "finish_reason": "length"}]}))
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces),
                             "total_tokens": prompt_tokens + len(pieces)}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    events.append(sse({**base, "choices": [], "usage": usage}))
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


class Routers:
    """``kvturn bench agent``'s ``connect``: every run's router is ``handle``, in process;
    ``started`` lists each run's router name and flags, in order."""

    def __init__(self, handle: Handler) -> None:
        self.handle = handle
        self.started: list[tuple[str, tuple[str, ...]]] = []

    @contextlib.asynccontextmanager
    async def __call__(self, name: str, args: tuple[str, ...]) -> AsyncIterator[
            kvturn.AsyncOpenAI]:
        self.started.append((name, args))
        client = mock_client(self.handle)
        try:
            yield client
        finally:
            await client.close()


class AgentBenchRouter(ConversationEndpoints):
    """Answers streamed chat completions with reuse headers the way the router does (hit
    after a kvturn conversation's first turn, ``disabled`` for an ``X-Conversation-ID``
    header, miss without an id), plus the conversation endpoints. With ``routes`` it also
    reports each turn's route the way the router does: a conversation's later turns continue
    on the decode (which then computes what its cache lacks), every other turn takes a prefill
    leg chosen by round-robin or affinity; such a decode turn's usage says what the decode's
    cache supplied (``cached_tokens``): the conversation's previous prompt, or nothing for a
    conversation in ``forgotten`` (the decode evicted its history). With ``host_tier`` a
    forgotten history comes back from the decode's host tier instead (``host_loaded``), as
    vLLM's CPU offloading loads it. A kvturn conversation's decode turn is ``pending`` in its
    headers (with the block size), as the router answers a stream it continues."""

    BLOCK = 4
    REPLY = ("Sure", ",", " looking", " into", " it", ".")

    def __init__(self, routes: bool = False, host_tier: bool = False) -> None:
        super().__init__()
        self.routes = routes
        self.host_tier = host_tier
        self.host_loaded = 0
        self.decode_computed = 0
        self.last_prompt: dict[str, int] = {}
        self.computed = 0
        self.forgotten: set[str] = set()

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        answer = self.conversation_endpoint(request)
        if answer is not None:
            return answer
        assert request.url.path == "/v1/chat/completions", request.url.path
        body = json.loads(request.content)
        self.requests.append({"body": body, "headers": dict(request.headers)})
        prompt = prompt_size(body["messages"])
        kvturn_id = body.get("conversation_id")
        conversation = kvturn_id or request.headers.get("x-conversation-id")
        previous = None if conversation is None else self.last_prompt.get(conversation)
        if kvturn_id is None:
            reuse, reused = ("miss" if conversation is None else "disabled"), 0
        elif previous is not None:
            reuse, reused = "hit", previous
        else:
            reuse, reused = "miss", 0
        if conversation is not None:
            self.last_prompt[conversation] = prompt
        if kvturn_id is not None:
            self.live.add(kvturn_id)
        route: dict[str, str] = {}
        cached = None
        if self.routes and previous is not None:
            route = {"X-KVTurn-Route": "decode"}
            cached = 0 if conversation in self.forgotten else previous
            if conversation in self.forgotten and self.host_tier:
                cached = previous
                self.host_loaded += previous
            self.decode_computed += prompt - cached
            if kvturn_id is not None:
                route["X-KVTurn-Block-Size"] = str(self.BLOCK)
                reuse, reused = "pending", 0
        else:
            if self.routes:
                route = {"X-KVTurn-Route": "prefill", "X-KVTurn-Prefill-Choice":
                         "round-robin" if conversation is None else "affinity"}
                cached = 0
            self.computed += prompt - reused
        assert body["stream_options"] == {"include_usage": True}
        headers = {"content-type": "text/event-stream", "X-KVTurn-Reuse": reuse,
                   "X-KVTurn-Reused-Tokens": str(reused), "x-request-id": "fake", **route}
        if kvturn_id is not None:
            headers["X-KVTurn-Conversation"] = kvturn_id
        return httpx2.Response(200, headers=headers,
                               content=chat_stream(body["model"], self.REPLY, prompt, cached))


class FleetBenchRouter(ConversationEndpoints):
    """Streams ``max_tokens`` one-token chunks with the headers a router sends: reuse and route
    for conversations (the id from the body or the header), plus the conversation endpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()
        self.computed = 0.0
        self.reused = 0.0

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        answer = self.conversation_endpoint(request)
        if answer is not None:
            return answer
        body = json.loads(request.content)
        self.requests.append({"body": body, "headers": dict(request.headers)})
        prompt = prompt_size(body["messages"])
        kvturn_id = body.get("conversation_id")
        header_id = request.headers.get("x-conversation-id")
        key = kvturn_id or header_id
        reused = 0
        headers = {"content-type": "text/event-stream", "x-request-id": "fake"}
        if kvturn_id is not None:
            reused = prompt // 2 if kvturn_id in self.seen else 0
            headers.update({"X-KVTurn-Reuse": "hit" if reused else "miss",
                            "X-KVTurn-Route": "prefill",
                            "X-KVTurn-Prefill-Choice": "holder" if reused else "load"})
            self.live.add(kvturn_id)
        else:
            headers.update({"X-KVTurn-Reuse": "disabled" if header_id else "miss",
                            "X-KVTurn-Route": "prefill",
                            "X-KVTurn-Prefill-Choice": "affinity" if header_id
                            else "round-robin"})
        if key is not None:
            self.seen.add(key)
        headers["X-KVTurn-Reused-Tokens"] = str(reused)
        self.computed += prompt - reused
        self.reused += reused
        pieces = [f" t{i}" for i in range(body["max_tokens"])]
        return httpx2.Response(200, headers=headers,
                               content=chat_stream(body["model"], pieces, prompt))


class FleetBenchProbe:
    """``bench/_fleet_agents.FleetProbe`` over a ``FleetBenchRouter``: one prefill whose
    counters are what the router computed and read, one decode retaining 1 MiB per live
    conversation."""

    def __init__(self, router: FleetBenchRouter) -> None:
        self.router = router

    def counters(self) -> dict[str, Counters | None]:
        return {"prefill0": Counters(self.router.computed, 0.0, 0.0, self.router.reused),
                "decode0": Counters(0.0, 0.0, 0.0, 0.0)}

    def retained(self) -> dict[str, int | None]:
        return {"decode0": len(self.router.live) * MIB}

    def cache_info(self) -> dict[str, dict[str, Any] | None]:
        return {"prefill0": {"block_size": "128", "num_gpu_blocks": "66"}}
