"""A fuzz run of hostile and malformed requests against the router over fake backends.

Hypothesis generates at least ``EXAMPLES`` requests: bytes that are not JSON, JSON that is not
an object, bodies nested past what the router can forward, bodies over the size cap sent in
chunks, bodies that never complete, wrong content types, bad UTF-8, hostile conversation ids,
and well-formed requests whose router-read fields (``stream``, ``n``, ``max_tokens``, ...) take
arbitrary JSON values, some with forged transfer params in every spelling. For each:

- no 5xx, and every refusal is an OpenAI-shaped error;
- a refused request changes nothing: no backend call (pin, leg, control), no store write;
- an accepted one sends no forged transfer params to any backend;
- each answers within ``PER_REQUEST_S`` (bodies that stall hit the router's body timeout).

Memory: the process's peak RSS (``VmHWM``, reset before the run) may grow by at most
``RSS_BOUND_MIB`` during it, with the body cap at ``CAP`` bytes (docs/http-api.md, section A).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvturn_server.router import RouterConfig, create_app
from tests.fakes.backends import Cluster, ManualClock
from tests.fakes.router_harness import TEST_SETTINGS

EXAMPLES = 600
PER_REQUEST_S = 2.0
CAP = 64 * 1024
BODY_TIMEOUT = 0.05
RSS_BOUND_MIB = 64
MARK = "10.6.6.6"  # in every forged transfer param: must never reach a backend

# Requests.

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                       st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
_json_any = st.recursive(_json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)

_ROUTER_READ = ["stream", "n", "max_tokens", "max_completion_tokens", "min_tokens",
                "stream_options", "prompt_logprobs", "echo", "logprob_token_ids",
                "conversation_id", "session_id"]
_lax = st.sampled_from(["true", "yes", "1", "on", "false", 1, 0, 1.0, -1, 2, 10**20, [], {},
                        {"include_usage": "yes"}, {"include_usage": True}, " x", "a" * 300,
                        "\x00", "é"])

_forgeries = st.sampled_from([
    {"kv_transfer_params": {"remote_host": MARK, "remote_block_ids": [[1]]}},
    {"vllm_xargs": {"kv_transfer_params": MARK}},
    {"vllm_xargs": {"kv_transfer_params": [MARK, 1], "ec_transfer_params": MARK}},
    {"ec_transfer_params": {"host": MARK}},
    {"kvturn": {"conversation": MARK}},
])


@st.composite
def _fields_request(draw: st.DrawFn) -> dict[str, Any]:
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": "m"}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(max_size=20))}]
    else:
        body["prompt"] = draw(st.text(min_size=1, max_size=20))
    for name in draw(st.lists(st.sampled_from(_ROUTER_READ), max_size=4, unique=True)):
        body[name] = draw(st.one_of(_lax, _json_any))
    if draw(st.booleans()):
        body.update(draw(_forgeries))
    headers = []
    if draw(st.integers(0, 4)) == 0:
        headers.append((b"x-conversation-id", draw(st.binary(max_size=300))))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return {"path": path, "chunks": [json.dumps(body).encode()], "headers": headers}


def _raw(chunks: list[bytes], ctype: bytes | None = b"application/json", *,
         stall: bool = False) -> dict[str, Any]:
    headers = [] if ctype is None else [(b"content-type", ctype)]
    return {"path": "/v1/chat/completions", "chunks": chunks, "headers": headers,
            "stall": stall}


_oversize = st.builds(
    lambda size, chunk: _raw([b"x" * chunk] * (size // chunk + 1)),
    st.integers(CAP + 1, 4 * CAP), st.integers(1024, 32 * 1024))
_deep = st.integers(255, 1000).map(
    lambda d: _raw([b'{"messages": ' + b"[" * d + b"]" * d + b"}"]))
_not_object = _json_any.filter(lambda v: not isinstance(v, dict)).map(
    lambda v: _raw([json.dumps(v).encode()]))
_garbage = st.binary(max_size=200).map(lambda b: _raw([b]))
_bad_utf8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88"]).map(
    lambda b: _raw([b'{"model": "' + b + b'", "messages": []}']))
_bad_ctype = st.sampled_from([b"text/plain", b"application/x-www-form-urlencoded",
                              b"multipart/form-data; boundary=x", b"application/xml",
                              b"\xff\xfe"]).map(lambda c: _raw([b'{"model": "m"}'], c))
_stalled = st.binary(max_size=50).map(lambda b: _raw([b'{"model": "m", ' + b], stall=True))
_empty = st.just(_raw([]))

REQUESTS = st.one_of(_fields_request(), _fields_request(), _fields_request(), _oversize,
                     _deep, _not_object, _garbage, _bad_utf8, _bad_ctype, _stalled, _empty)


# The router.

def _hwm_kib() -> int:
    match = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert match is not None
    return int(match.group(1))


class _Target:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.cluster = Cluster()
        config = RouterConfig(**{"prefill": self.cluster.prefill_urls,
                                 "decode": self.cluster.decode_urls, **TEST_SETTINGS,
                                 "max_body_bytes": CAP, "body_timeout": BODY_TIMEOUT})
        self.app = create_app(config, self.cluster.transport(), clock=ManualClock())
        self.router = self.app.state.router
        self.loop.run_until_complete(self.router.start(health_checks=False))
        self.count = 0
        self.statuses: dict[int, int] = {}
        # A retention a careless refusal could pin.
        status, _ = self.run(_raw([json.dumps({"model": "m", "conversation_id": "seed",
                                               "messages": [{"role": "user",
                                                             "content": "hi"}]}).encode()]))
        assert status == 200

    def close(self) -> None:
        self.loop.run_until_complete(self.router.aclose())
        self.loop.close()

    def run(self, request: dict[str, Any]) -> tuple[int, bytes]:
        return self.loop.run_until_complete(asyncio.wait_for(self._call(request),
                                                             PER_REQUEST_S))

    async def _call(self, request: dict[str, Any]) -> tuple[int, bytes]:
        chunks: list[bytes] = list(request["chunks"])
        stall = request.get("stall", False)

        async def receive() -> dict[str, Any]:
            if chunks:
                chunk = chunks.pop(0)
                return {"type": "http.request", "body": chunk,
                        "more_body": bool(chunks) or stall}
            if stall:
                await asyncio.Event().wait()  # a client that never finishes
            return {"type": "http.disconnect"}

        path = request["path"]
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "headers": request["headers"], "scheme": "http",
                 "server": ("router", 80), "client": ("127.0.0.1", 1), "root_path": ""}
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await self.app(scope, receive, send)
        await self.router.wait_idle()
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    def snapshot(self) -> tuple[int, int, Any, int]:
        seed = self.loop.run_until_complete(self.router.store.get("-/seed"))
        size = self.loop.run_until_complete(self.router.store.size())
        return len(self.cluster.log), size, seed, len(self.cluster.decodes[0].pins)


@pytest.fixture(scope="module")
def target() -> Iterator[_Target]:
    t = _Target()
    yield t
    t.close()


@pytest.mark.timeout(120)
def test_fuzzed_requests_get_no_5xx_change_nothing_and_stay_in_memory(
        target: _Target) -> None:
    def check(request: dict[str, Any]) -> None:
        before = target.snapshot()
        seen = len(target.cluster.log)
        status, content = target.run(request)
        target.count += 1
        target.statuses[status] = target.statuses.get(status, 0) + 1
        assert status < 500, (status, content[:300], request)
        if status != 200:
            error = json.loads(content)["error"]
            assert isinstance(error["message"], str) and error["type"]
            assert target.snapshot() == before, request  # nothing changed
        for entry in target.cluster.log[seen:]:
            assert MARK not in json.dumps(entry.body), (entry.backend, entry.body)

    def fuzz(examples: int) -> None:
        given(REQUESTS)(settings(
            max_examples=examples, deadline=None, database=None, derandomize=True,
            suppress_health_check=list(HealthCheck))(lambda r: check(r)))()

    # Warm-up: hypothesis builds its Unicode tables on first use (~200 MB, once per
    # process); that is the test's memory, not the router's.
    fuzz(5)
    target.count = 0
    target.statuses.clear()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    start_kib = _hwm_kib()
    fuzz(EXAMPLES)
    grown_mib = (_hwm_kib() - start_kib) / 1024
    print(f"fuzz: {target.count} requests, "  # noqa: T201
          f"statuses {sorted(target.statuses.items())}, "
          f"peak RSS grew {grown_mib:.1f} MiB (bound {RSS_BOUND_MIB})")
    assert target.count >= 500
    assert sum(n for s, n in target.statuses.items() if s >= 400) >= 250  # mostly hostile
    assert grown_mib < RSS_BOUND_MIB
