"""Scripted fakes of prefill, decode and control endpoints behind one httpx2.MockTransport.

``Cluster(prefills=2, decodes=2)`` serves:

- ``http://prefill{i}:8100``: vLLM prefills. A prefill leg answers with P->D transfer params
  and a ``kvturn.reuse`` report (``hit`` with ``reused_tokens`` when it was given retention
  params, ``miss`` otherwise).
- ``http://decode{i}:8200``: vLLM decodes. A decode leg with ``kvturn.conversation`` retains
  the sequence under that key when it finishes (non-streaming replies say so in
  ``kv_transfer_params.kvturn``; streams retain after their last chunk). Replies carry
  ``usage`` as vLLM with ``--enable-prompt-tokens-details`` does (streams: a usage event before
  ``[DONE]`` when ``stream_options.include_usage`` asks): ``usage_prompt_tokens`` prompt
  tokens, of which ``cached_tokens`` came from the decode's own cache on a turn it continues
  while it holds the conversation's retention (none when it does not; all on a P/D leg).
- ``http://decode{i}:8201``: the decodes' control endpoints (docs/http-api.md, section C).

Faults are scripted per backend with ``fail_next(...)`` (consumed one per leg request) and
``control_fail_next(...)``; every request is recorded in ``Cluster.log`` in arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httpx2

from kvturn_server.router import _json

Behavior = Any  # "connect" | "hang" | "broken" | ("status", code, body) | ("break_after", n)
                # | callable(body) -> Response


def sse(*events: Any) -> list[bytes]:
    return [b"data: " + (e if isinstance(e, bytes) else _json.dumps(e)) + b"\n\n"
            for e in events]


DEFAULT_SSE = [*sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                   {"choices": [{"delta": {"content": "Hel"}}]},
                   {"choices": [{"delta": {"content": "lo"}}]}), b"data: [DONE]\n\n"]


@dataclass
class Entry:
    backend: str
    method: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class FakeRetention:
    key: str
    engine_id: str
    params: dict[str, Any]
    num_tokens: int
    expires_in: float = 480.0
    created: float = field(default_factory=time.perf_counter)

    def view(self) -> dict[str, Any]:
        return {"key": self.key, "engine_id": self.engine_id, "params": self.params,
                "num_tokens": self.num_tokens, "num_blocks": 3, "expires_in": self.expires_in,
                "hold_remaining": 3000.0,
                "created_ago": round(time.perf_counter() - self.created, 6)}


class FakeBackend:
    def __init__(self, cluster: Cluster, role: str, index: int) -> None:
        self.cluster = cluster
        self.role = role
        self.name = f"{role}{index}"
        port = 8100 if role == "prefill" else 8200
        self.url = f"http://{self.name}:{port}"
        self.control_url = f"http://{self.name}:{port + 1}"
        self.engine_id = f"{self.name}-engine-1"
        self.script: deque[Behavior] = deque()
        self.control_script: deque[Behavior] = deque()
        self.health: str = "ok"  # ok | down (connection refused) | 503
        self.control_health: str = "ok"
        self.control_secret: str | None = None  # required in X-KVTurn-Control-Secret if set
        self.reply_engine_id: str | None = None  # decodes: the engine their replies name
        self.reused_tokens = 48
        self.prompt_tokens = 0  # prefills: usage.prompt_tokens of a leg's reply (0: none)
        self.report: dict[str, Any] | None = None  # overrides the prefill's reuse report
        self.chunks: list[bytes] = list(DEFAULT_SSE)
        self.gate: asyncio.Event | None = None  # streams pause after their first chunk
        self.usage_prompt_tokens = 64  # decodes: usage.prompt_tokens of a leg's reply
        self.completion_tokens = 2  # decodes: usage.completion_tokens of a leg's reply
        # Decodes: the tokens a retention holds (None: 100 per turn retained) and its block
        # size; its readable block ids are its full blocks (two when the tokens are not set).
        self.retention_tokens: int | None = None
        self.block_size = 16
        self.cached_tokens = 48  # decodes: cached tokens of a continued turn it holds
        self.prompt_details = True  # decodes: usage says its cached tokens
        self.retain = True  # decodes: retain finished conversation turns
        self.report_retained = True  # non-streaming replies carry kvturn.retained
        self.retain_late = 0  # describe calls that still see the old retention
        self.retentions: dict[str, FakeRetention] = {}
        self.gone: dict[str, str] = {}
        # What a gone retention left in the prefix cache: a describe says it, a continued
        # turn finds it (unset: the decode does not say, and its turn finds nothing).
        self.left_cached: dict[str, int] = {}
        self.pins: dict[str, str] = {}
        # Retentions held in the host tier alone: a pin answers 404 evicted with these tokens.
        self.host_only: dict[str, int] = {}
        # Decodes: a pin asking host_reads pins a host-only retention, read from the host tier.
        self.host_reads = False
        self.unpinned: list[str] = []
        self._pin_ids = itertools.count(1)
        self._turns = itertools.count(1)
        self._late: dict[str, FakeRetention] = {}
        self.streams_closed = 0  # streams whose reader closed them (before or at their end)
        # The connector's lost log (GET /kvturn/v1/lost): (key, reason, read id), numbered 1..
        self.lost_log: list[tuple[str, str, str]] = []
        self.lost_polls = 0
        self._lost_added = asyncio.Event()

    def fail_next(self, *behaviors: Behavior) -> None:
        self.script.extend(behaviors)

    def control_fail_next(self, *behaviors: Behavior) -> None:
        self.control_script.extend(behaviors)

    def restart(self) -> None:
        """A new engine: every retention (and the memory of them) is gone."""
        number = int(self.engine_id.rsplit("-", 1)[1]) + 1
        self.engine_id = f"{self.name}-engine-{number}"
        self.retentions.clear()
        self.gone.clear()
        self.left_cached.clear()
        self.pins.clear()
        self.lost_log.clear()

    def expire(self, key: str) -> None:
        self.retentions.pop(key, None)
        self.gone[key] = "expired"

    def lose(self, key: str, reason: str = "evicted") -> None:
        """Drop a retention on the decode's own account, as the connector logs it."""
        retention = self.retentions.pop(key)
        self.gone[key] = reason
        self.lost_log.append((key, reason, retention.params["remote_request_id"]))
        self._lost_added.set()

    # Completion legs.

    async def leg(self, request: httpx2.Request, body: dict[str, Any]) -> httpx2.Response:
        if self.script:
            behavior = self.script.popleft()
            response = await _misbehave(behavior, request, body, self)
            if response is not None:
                return response
        if self.role == "prefill":
            return self._prefill(body)
        return self._decode(body)

    def _prefill(self, body: dict[str, Any]) -> httpx2.Response:
        params = body.get("kv_transfer_params") or {}
        given = params.get("remote_engine_id") is not None
        report = self.report or ({"reason": "hit", "reused_tokens": self.reused_tokens,
                                  "local_tokens": 0} if given else
                                 {"reason": "miss", "reused_tokens": 0, "local_tokens": 0})
        usage = {"usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": 1}} \
            if self.prompt_tokens else {}
        return httpx2.Response(200, json={
            "id": f"cmpl-{self.name}", "choices": [{"index": 0, "text": "x"}], **usage,
            "kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_block_ids": [[1, 2, 3]],
                "remote_host": "10.0.0.1", "remote_port": 5600, "remote_request_id": "p-1",
                "kvturn": {"reuse": report}}})

    def _retention_for(self, key: str) -> FakeRetention:
        n = next(self._turns)
        blocks = 2 if self.retention_tokens is None else self.retention_tokens // self.block_size
        return FakeRetention(key, self.engine_id, {
            "remote_engine_id": self.engine_id,
            "remote_block_ids": [[10 * n + i for i in range(blocks)]],
            "remote_host": "10.0.0.2", "remote_port": 5700, "remote_request_id": f"d-{n}",
            "kvturn": {"format": 1, "block_size": self.block_size,
                       "block_hashes": ["aa", "bb"]}},
            num_tokens=100 * n if self.retention_tokens is None else self.retention_tokens)

    def _finish(self, body: dict[str, Any]) -> FakeRetention | None:
        params = body.get("kv_transfer_params") or {}
        key = (params.get("kvturn") or {}).get("conversation")
        if key is None or not self.retain:
            return None
        retention = self._retention_for(key)
        if self.retain_late:
            self._late[key] = retention
        else:
            self.retentions[key] = retention
        self.gone.pop(key, None)
        return retention

    def stream_response(self, body: dict[str, Any],
                        break_after: int | None = None) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                               stream=_Stream(self, self._stream(body, break_after)))

    def usage(self, body: dict[str, Any]) -> dict[str, Any]:
        """A decode leg's usage, as its request starts (before it retains anything)."""
        params = body.get("kv_transfer_params") or {}
        key = (params.get("kvturn") or {}).get("conversation")
        prompt = self.usage_prompt_tokens
        if params.get("do_remote_prefill"):
            cached = prompt  # loaded from the prefill
        else:
            cached = self.cached_tokens if key in self.retentions \
                else self.left_cached.get(key, 0)
        usage: dict[str, Any] = {"prompt_tokens": prompt,
                                 "completion_tokens": self.completion_tokens,
                                 "total_tokens": prompt + self.completion_tokens}
        if self.prompt_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def _decode(self, body: dict[str, Any]) -> httpx2.Response:
        if body.get("stream"):
            return self.stream_response(body)
        usage = self.usage(body)
        retention = self._finish(body)
        params: dict[str, Any] = {"do_remote_decode": True}
        if self.report_retained and retention is not None:
            # As the connector answers: the retention's published params, and the report.
            params = {**retention.params, "kvturn": {
                **retention.params["kvturn"], "retained": True,
                "engine_id": self.reply_engine_id or self.engine_id,
                "num_tokens": retention.num_tokens, "expires_in": 480.0}}
        elif self.report_retained:
            params["kvturn"] = {"retained": False,
                                "engine_id": self.reply_engine_id or self.engine_id}
        return httpx2.Response(200, json={
            "id": f"cmpl-{self.name}", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                         "finish_reason": "stop"}],
            "usage": usage, "kv_transfer_params": params})

    async def _stream(self, body: dict[str, Any], break_after: int | None = None
                      ) -> AsyncIterator[bytes]:
        chunks = list(self.chunks)
        options = body.get("stream_options") or {}
        if options.get("include_usage"):
            at = len(chunks) - 1 if chunks and chunks[-1].startswith(b"data: [DONE]") \
                else len(chunks)
            chunks[at:at] = sse({"choices": [], "usage": self.usage(body)})
        for i, chunk in enumerate(chunks):
            if break_after is not None and i == break_after:
                raise httpx2.ReadError("connection reset by peer")
            yield chunk
            if i == 0 and self.gate is not None:
                await self.gate.wait()
        self._finish(body)

    # Control endpoint.

    async def control(self, request: httpx2.Request, body: dict[str, Any]) -> httpx2.Response:
        if self.control_script:
            response = await _misbehave(self.control_script.popleft(), request, body, self)
            if response is not None:
                return response
        parts = [unquote(p) for p in request.url.raw_path.decode().split("?")[0]
                 .strip("/").split("/")]
        method = request.method
        if parts == ["health"]:
            if self.control_health == "down":
                raise httpx2.ConnectError("connection refused")
            return httpx2.Response(200, json={"engine_id": self.engine_id, "role": self.role})
        route = parts[2:]
        if route == ["lost"] and method == "GET":
            self.lost_polls += 1
            after = int(request.url.params.get("after", "0"))
            wait = float(request.url.params.get("wait", "0"))
            if wait > 0 and after >= len(self.lost_log):  # a long poll, as the connector's
                self._lost_added.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._lost_added.wait(), wait)
            entries = [{"key": k, "reason": r, "read_id": i}
                       for k, r, i in self.lost_log[after:]]
            return httpx2.Response(200, json={"engine_id": self.engine_id,
                                              "seq": len(self.lost_log), "truncated": False,
                                              "lost": entries})
        if route[0] == "retentions":
            key = route[1]
            if method == "GET":
                if key in self._late:
                    self.retain_late -= 1
                    if self.retain_late <= 0:
                        self.retentions[key] = self._late.pop(key)
                return self._describe(key)
            if method == "DELETE":
                if key not in self.retentions:
                    return self._gone(key)
                del self.retentions[key]
                self.gone[key] = "released"
                return httpx2.Response(200, json={"key": key, "released": True})
            if route[2] == "pin":
                if key in self.host_only and body.get("host_reads") and self.host_reads \
                        and key in self.retentions:
                    pin_id = f"{self.name}-pin-{next(self._pin_ids)}"
                    self.pins[pin_id] = key
                    view = self.retentions[key].view()
                    params = {**view["params"], "remote_engine_id": f"{self.engine_id}-host",
                              "remote_port": 41000}
                    return httpx2.Response(200, json={**view, "params": params,
                                                      "pin_id": pin_id, "where": "host",
                                                      "pin_expires_in": body.get("ttl")})
                if key in self.host_only:
                    return httpx2.Response(404, json={
                        "error": {"message": f"{key}: evicted", "type": "not_found",
                                  "code": "evicted"},
                        "host_tokens": self.host_only[key]})
                if key not in self.retentions:
                    return self._gone(key)
                pin_id = f"{self.name}-pin-{next(self._pin_ids)}"
                self.pins[pin_id] = key
                view = self.retentions[key].view()
                return httpx2.Response(200, json={**view, "pin_id": pin_id,
                                                  "pin_expires_in": body.get("ttl")})
            if route[2] == "keepalive":
                if key not in self.retentions:
                    return self._gone(key)
                self.retentions[key].expires_in = 480.0
                return httpx2.Response(200, json=self.retentions[key].view())
        if route[0] == "pins" and method == "DELETE":
            unpinned = self.pins.pop(route[1], None) is not None
            self.unpinned.append(route[1])
            return httpx2.Response(200, json={"pin_id": route[1], "unpinned": unpinned})
        return httpx2.Response(404, json={"error": {"message": "no route", "type": "not_found",
                                                    "code": "no_route"}})

    def _describe(self, key: str) -> httpx2.Response:
        if key in self.retentions:
            return httpx2.Response(200, json=self.retentions[key].view())
        gone = self._gone(key)
        if key in self.left_cached:
            gone = httpx2.Response(404, json={**gone.json(),
                                              "cached_tokens": self.left_cached[key]})
        return gone

    def _gone(self, key: str) -> httpx2.Response:
        code = self.gone.get(key, "no_retention")
        return httpx2.Response(404, json={"error": {"message": f"{key}: {code}",
                                                    "type": "not_found", "code": code}})


async def _misbehave(behavior: Behavior, request: httpx2.Request, body: dict[str, Any],
                     backend: FakeBackend) -> httpx2.Response | None:
    if behavior == "connect":
        raise httpx2.ConnectError("connection refused", request=request)
    if behavior == "broken":
        raise httpx2.RemoteProtocolError("server disconnected", request=request)
    if behavior == "hang":
        await asyncio.Event().wait()  # the router's timeout ends this
    if behavior == "ok":
        return None
    if isinstance(behavior, tuple) and behavior[0] == "status":
        return httpx2.Response(behavior[1], json=behavior[2] if len(behavior) > 2 else
                               {"error": {"message": f"status {behavior[1]}"}})
    if isinstance(behavior, tuple) and behavior[0] == "break_after":
        return backend.stream_response(body, break_after=behavior[1])
    if callable(behavior):  # a Response, or None to answer as usual
        result = behavior(body)
        if isinstance(result, Awaitable):
            result = await result
        assert result is None or isinstance(result, httpx2.Response)
        return result
    raise AssertionError(f"unknown behavior {behavior!r}")


class _Stream(httpx2.AsyncByteStream):
    """A streamed body that notes when its reader closes it."""

    def __init__(self, backend: FakeBackend, chunks: AsyncIterator[bytes]) -> None:
        self.backend = backend
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.chunks:
            yield chunk

    async def aclose(self) -> None:
        self.backend.streams_closed += 1
        await self.chunks.aclose()  # type: ignore[attr-defined]


class Cluster:
    """Prefills, decodes and control endpoints behind one mock transport."""

    def __init__(self, prefills: int = 1, decodes: int = 1) -> None:
        self.prefills = [FakeBackend(self, "prefill", i) for i in range(prefills)]
        self.decodes = [FakeBackend(self, "decode", i) for i in range(decodes)]
        self.log: list[Entry] = []
        self._by_host: dict[str, tuple[FakeBackend, bool]] = {}
        for b in (*self.prefills, *self.decodes):
            self._by_host[b.url.split("//")[1]] = (b, False)
            if b.role == "decode":
                self._by_host[b.control_url.split("//")[1]] = (b, True)

    @property
    def prefill_urls(self) -> tuple[str, ...]:
        return tuple(b.url for b in self.prefills)

    @property
    def decode_urls(self) -> tuple[str, ...]:
        return tuple(b.url for b in self.decodes)

    def transport(self) -> httpx2.MockTransport:
        return httpx2.MockTransport(self.handle)

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        backend, is_control = self._by_host[f"{request.url.host}:{request.url.port}"]
        body = _json.loads(request.content) if request.content else {}
        name = f"{backend.name}.control" if is_control else backend.name
        self.log.append(Entry(name, request.method, request.url.path, body,
                              dict(request.headers)))
        if is_control:
            if request.url.path == "/health" and backend.control_health == "down":
                raise httpx2.ConnectError("connection refused", request=request)
            if backend.control_secret is not None and \
                    request.headers.get("x-kvturn-control-secret") != backend.control_secret:
                return httpx2.Response(401, json={"error": {
                    "message": "secret required", "type": "authentication_error",
                    "code": "unauthorized"}})
            return await backend.control(request, body)
        if request.url.path == "/health":
            if backend.health == "down":
                raise httpx2.ConnectError("connection refused", request=request)
            return httpx2.Response(200 if backend.health == "ok" else 503)
        if request.url.path == "/v1/models":
            return httpx2.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        return await backend.leg(request, body)

    # Views of the log.

    def legs(self, name: str) -> list[Entry]:
        return [e for e in self.log if e.backend == name and e.path.startswith("/v1/")
                and e.method == "POST"]

    def bodies(self, name: str) -> list[dict[str, Any]]:
        return [e.body for e in self.legs(name)]

    def calls(self, name: str, method: str | None = None) -> list[Entry]:
        return [e for e in self.log if e.backend == name and e.path != "/health"
                and (method is None or e.method == method)]

    def sequence(self) -> list[str]:
        """Non-health calls as ``backend METHOD last-path-part``, in order."""
        return [f"{e.backend} {e.method} {e.path.rstrip('/').rsplit('/', 1)[-1]}"
                for e in self.log if e.path != "/health"]


async def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``condition()`` holds (checked on every loop turn), or fail."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0)


class ManualClock:
    """Wall-clock seconds that move only when a test says so."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class AsgiCall:
    """Drive an ASGI app directly: see each body message as it is sent, disconnect at will."""

    def __init__(self, app: Any, method: str, path: str, body: bytes = b"",
                 headers: dict[str, str] | None = None) -> None:
        raw_headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        raw_headers.append((b"content-length", str(len(body)).encode()))
        self.scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                      "http_version": "1.1", "method": method, "path": path,
                      "raw_path": path.encode(), "query_string": b"", "headers": raw_headers,
                      "scheme": "http", "server": ("router", 80), "client": ("127.0.0.1", 1),
                      "root_path": ""}
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self._body = body
        self._body_sent = False
        self._disconnected = asyncio.Event()
        self.task = asyncio.ensure_future(app(self.scope, self._receive, self._send))

    async def _receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._disconnected.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        await self.messages.put(message)

    async def next_body(self, timeout: float = 5.0) -> tuple[bytes, bool]:
        """The next body message: (bytes, more_body)."""
        async with asyncio.timeout(timeout):
            while True:
                message = await self.messages.get()
                if message["type"] == "http.response.body":
                    return message.get("body", b""), message.get("more_body", False)

    def disconnect(self) -> None:
        self._disconnected.set()

    async def done(self, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            await self.task
        self._disconnected.set()
