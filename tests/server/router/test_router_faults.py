"""Every fault path of a turn: prefill and decode failures, broken streams, stale handles."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx2
import pytest

from kvturn_server.router import MemoryStore
from tests.fakes.backends import DEFAULT_SSE, AsgiCall, Cluster, ManualClock, sse
from tests.fakes.router_harness import MakeHarness

PREFILL_FAILURES: list[Any] = [
    "connect", "broken", "hang", ("status", 500), ("status", 503), ("status", 429),
    lambda body: httpx2.Response(200, text="not json"),
    lambda body: httpx2.Response(200, json={"choices": []}),
]
FAILURE_IDS = ["connect", "broken", "timeout", "500", "503", "429", "not-json", "no-params"]


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and
                                                     line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _metrics(h: Any) -> str:
    return str((await h.client.get("/metrics")).text)


# Prefill leg.

@pytest.mark.parametrize("failure", PREFILL_FAILURES, ids=FAILURE_IDS)
async def test_a_prefill_failure_is_retried_once_on_another_prefill(
        make_harness: MakeHarness, failure: Any) -> None:
    cluster = Cluster(prefills=2)
    h = await make_harness(cluster)
    h.router.prefills.members[1].in_flight = 1  # so that prefill0 goes first
    cluster.prefills[0].fail_next(failure)
    resp = await h.chat("c")
    assert resp.status_code == 200
    assert len(cluster.legs("prefill0")) == len(cluster.legs("prefill1")) == 1
    [d_body] = cluster.bodies("decode0")
    assert d_body["kv_transfer_params"]["remote_engine_id"] == "prefill1-engine-1"
    assert _metric(await _metrics(h), "kvturn_router_retries_total", leg="prefill") == 1


async def test_when_both_prefill_attempts_fail_the_decode_computes_the_prompt(
        make_harness: MakeHarness) -> None:
    cluster = Cluster(prefills=2)
    h = await make_harness(cluster)
    await h.chat("c")
    for p in cluster.prefills:
        p.fail_next(("status", 503))
    resp = await h.chat("c")
    assert resp.status_code == 200
    # A retention was pinned but never read: reported as stale, nothing reused.
    assert resp.headers["X-KVTurn-Reuse"] == "stale"
    assert resp.headers["X-KVTurn-Reused-Tokens"] == "0"
    d_body = cluster.bodies("decode0")[-1]
    assert d_body["kv_transfer_params"] == {"do_remote_prefill": False,
                                            "kvturn": {"conversation": "-/c"}}
    # The decode still retains the turn; the pin was released.
    assert (await h.router.store.get("-/c")).num_tokens == 200  # type: ignore[union-attr]
    assert cluster.decodes[0].pins == {}


async def test_without_conversation_a_failed_prefill_sends_no_transfer_params(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    h.cluster.prefills[0].fail_next("broken", "broken")
    resp = await h.client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert resp.status_code == 200
    assert "kv_transfer_params" not in h.cluster.bodies("decode0")[0]


async def test_a_lone_prefill_is_retried_after_a_refused_connection_only(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    prefill = h.cluster.prefills[0]
    prefill.fail_next("connect")
    await h.chat(None)
    assert len(h.cluster.legs("prefill0")) == 2  # it never got the first one
    h.cluster.log.clear()
    prefill.fail_next("hang")
    await h.chat(None)
    assert len(h.cluster.legs("prefill0")) == 1  # it may still be working on it


async def test_client_errors_from_the_prefill_are_returned_without_a_decode_leg(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.chat("c")
    error = {"error": {"message": "model 'x' does not exist", "type": "NotFoundError"}}
    h.cluster.prefills[0].fail_next(("status", 404, error))
    h.cluster.log.clear()
    resp = await h.chat("c", model="x")
    assert resp.status_code == 404
    assert resp.json() == error
    assert resp.headers["x-should-retry"] == "false"
    assert h.cluster.bodies("decode0") == []
    assert h.cluster.decodes[0].pins == {}  # unpinned


async def test_a_prefill_timeout_leaves_its_pin_and_the_retry_pins_again(
        make_harness: MakeHarness) -> None:
    cluster = Cluster(prefills=2)
    h = await make_harness(cluster)
    await h.chat("c")
    decode = cluster.decodes[0]
    attempts: list[dict[str, Any]] = []

    async def first_attempt_hangs(body: dict[str, Any]) -> None:
        attempts.append(body)
        if len(attempts) == 1:
            await asyncio.Event().wait()

    for p in cluster.prefills:
        p.fail_next(first_attempt_hangs)
    resp = await h.chat("c")
    assert resp.status_code == 200
    assert resp.headers["X-KVTurn-Reuse"] == "hit"
    assert len(attempts) == 2 and len(cluster.calls("decode0.control", "POST")) == 2
    # The timed-out attempt's pin is left to expire (that prefill may still be reading);
    # the retry read under a pin of its own, released once it answered.
    assert set(decode.pins) == {"decode0-pin-1"}
    assert decode.unpinned == ["decode0-pin-2"]
    retained = decode.retentions["-/c"]
    for body in attempts:
        assert body["kv_transfer_params"]["remote_block_ids"] == [[10, 11]]
    assert retained.params["remote_block_ids"] == [[20, 21]]  # turn 2's, retained after


# Decode leg.

DECODE_FAILURES: list[Any] = [
    pytest.param(failure, stream, id=f"{name}-{'stream' if stream else 'sync'}")
    for name, failure in (("connect", "connect"), ("broken", "broken"), ("timeout", "hang"),
                          ("503", ("status", 503)), ("500", ("status", 500)))
    for stream in (False, True)] + [
    pytest.param(("break_after", 0), True, id="empty-stream")]


@pytest.mark.parametrize(("failure", "stream"), DECODE_FAILURES)
async def test_a_decode_failing_before_its_first_byte_is_retried_on_another(
        make_harness: MakeHarness, failure: Any, stream: bool) -> None:
    cluster = Cluster(decodes=2)
    h = await make_harness(cluster)
    h.router.decodes.members[1].in_flight = 1  # so that decode0 goes first
    cluster.decodes[0].fail_next(failure)
    resp = await h.chat("c", stream=stream)
    assert resp.status_code == 200
    if stream:
        assert resp.content == b"".join(DEFAULT_SSE)
    else:
        assert resp.json()["choices"][0]["message"]["content"] == "Hello"
    assert len(cluster.legs("decode0")) == len(cluster.legs("decode1")) == 1
    # Both decode attempts carried the same prefill params.
    bodies = cluster.bodies("decode0") + cluster.bodies("decode1")
    assert bodies[0]["kv_transfer_params"] == bodies[1]["kv_transfer_params"]
    assert _metric(await _metrics(h), "kvturn_router_retries_total", leg="decode") == 1
    placement = await h.router.store.get("-/c")
    assert placement is not None and placement.decode == cluster.decodes[1].url


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize(("failure", "status", "code"), [
    ("connect", 502, "backend_unavailable"), ("broken", 502, "backend_unavailable"),
    ("hang", 504, "backend_timeout"), (("status", 503), 503, None)])
async def test_when_every_decode_attempt_fails_the_client_may_retry(
        make_harness: MakeHarness, failure: Any, status: int, code: str | None,
        stream: bool) -> None:
    cluster = Cluster(decodes=2)
    h = await make_harness(cluster, retry_after=3)
    for d in cluster.decodes:
        d.fail_next(failure, failure)
    resp = await h.chat("c", stream=stream)
    assert resp.status_code == status
    assert resp.headers["x-should-retry"] == "true"
    assert resp.headers["Retry-After"] == "3"
    assert resp.headers["x-request-id"]
    if code:
        assert resp.json()["error"]["code"] == code
        assert resp.json()["error"]["type"] == "server_error"
    assert _metric(await _metrics(h), "kvturn_router_requests_total", endpoint="chat",
                   outcome="backend_error") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
async def test_decode_client_errors_pass_through_without_retry(
        make_harness: MakeHarness, stream: bool) -> None:
    cluster = Cluster(decodes=2)
    h = await make_harness(cluster)
    for d in cluster.decodes:
        d.fail_next(("status", 400, {"error": {"message": "bad"}}))
    resp = await h.chat("c", stream=stream)
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": "bad"}}
    assert resp.headers["x-should-retry"] == "false"
    assert len(cluster.legs("decode0")) + len(cluster.legs("decode1")) == 1


async def test_no_reachable_decode_is_a_retryable_error(make_harness: MakeHarness) -> None:
    h = await make_harness()
    h.router.decodes.members[0].healthy = False
    h.cluster.decodes[0].fail_next("connect", "connect")
    resp = await h.chat("c")
    assert resp.status_code in (502, 503) and resp.headers["x-should-retry"] == "true"
    assert "retry-after" in resp.headers


async def test_a_stream_broken_mid_way_ends_with_an_error_event_and_state_stays_true(
        make_harness: MakeHarness) -> None:
    h = await make_harness(capture_attempts=2)
    await h.chat("c", stream=True)  # turn 1 retained
    decode = h.cluster.decodes[0]
    decode.retentions["-/c"].created -= 5.0
    decode.fail_next(("break_after", 2))
    resp = await h.chat("c", stream=True)
    assert resp.status_code == 200
    body = resp.content
    assert body.startswith(DEFAULT_SSE[0] + DEFAULT_SSE[1])
    events = [e for e in body.split(b"\n\n") if e]
    error = json.loads(events[2].removeprefix(b"data: "))
    assert error["error"]["code"] == "backend_stream_error"
    assert events[3] == b"data: [DONE]"
    # The decode kept turn 1 (turn 2 never finished): the router's record says exactly that.
    placement = await h.router.store.get("-/c")
    assert placement is not None and placement.num_tokens == 100
    assert h.router.decodes.members[0].in_flight == 0
    text = await _metrics(h)
    assert _metric(text, "kvturn_router_requests_total", endpoint="chat",
                   outcome="stream_error") == 1
    # And the next turn reuses what is really there.
    resp = await h.chat("c", stream=True)
    assert resp.headers["X-KVTurn-Reuse"] == "hit"


async def test_a_broken_stream_whose_decode_holds_nothing_leaves_no_retention(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.chat("c", stream=True)
    decode = h.cluster.decodes[0]

    def break_and_lose(body: dict[str, Any]) -> httpx2.Response:
        decode.retentions.clear()  # e.g. evicted while this turn ran
        return decode.stream_response(body, break_after=1)

    decode.fail_next(break_and_lose)
    await h.chat("c", stream=True)
    record = await h.router.store.get("-/c")
    assert record is not None and not record.retained and record.cached_tokens == 0


async def test_an_event_cut_by_a_broken_stream_is_not_glued_to_the_error(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    decode = h.cluster.decodes[0]
    whole = sse({"n": 1})[0]
    decode.chunks = [whole, b'data: {"n": 2', b"}\n\n"]
    decode.fail_next(("break_after", 2))
    resp = await h.chat(None, stream=True)
    assert resp.content.startswith(whole + b'data: {"error"')


async def test_a_client_leaving_mid_stream_closes_the_decode_stream(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    decode = h.cluster.decodes[0]
    decode.gate = asyncio.Event()
    body = json.dumps({"model": "m", "messages": [], "stream": True,
                       "conversation_id": "c"}).encode()
    call = AsgiCall(h.app, "POST", "/v1/chat/completions", body,
                    {"content-type": "application/json"})
    await call.next_body()
    assert h.router.decodes.members[0].in_flight == 1
    assert decode.streams_closed == 0
    call.disconnect()
    await call.done()
    assert decode.streams_closed == 1  # closing it is what makes vLLM abort the request
    assert h.router.decodes.members[0].in_flight == 0
    assert _metric(await _metrics(h), "kvturn_router_requests_total", endpoint="chat",
                   outcome="client_gone") == 1


# Stale handles.

@pytest.mark.parametrize(("code", "reason"), [
    ("expired", "expired"), ("evicted", "stale"), ("no_retention", "stale"),
    ("released", "miss"), ("replaced", "miss")])
async def test_a_gone_retention_is_reported_dropped_and_counted(
        make_harness: MakeHarness, code: str, reason: str) -> None:
    h = await make_harness()
    await h.chat("c")
    decode = h.cluster.decodes[0]
    first = await h.router.store.get("-/c")
    decode.retentions.clear()
    decode.gone["-/c"] = code
    resp = await h.chat("c")
    assert resp.status_code == 200
    assert resp.headers["X-KVTurn-Reuse"] == reason
    [p_body] = h.cluster.bodies("prefill0")[-1:]
    assert p_body["kv_transfer_params"]["remote_engine_id"] is None
    assert _metric(await _metrics(h), "kvturn_router_stale_handles_total", reason=code) == 1
    # The stale record went; this turn's retention replaced it.
    placement = await h.router.store.get("-/c")
    assert placement is not None and first is not None and placement.turn != first.turn


async def test_an_engine_id_change_seen_by_the_pin_is_stale(make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.chat("c")
    decode = h.cluster.decodes[0]
    retention = decode.retentions["-/c"]
    decode.restart()
    decode.retentions["-/c"] = retention  # same key, different engine behind it
    retention.engine_id = decode.engine_id
    resp = await h.chat("c")
    assert resp.headers["X-KVTurn-Reuse"] == "stale"
    assert h.cluster.bodies("prefill0")[-1]["kv_transfer_params"]["remote_engine_id"] is None
    assert decode.pins == {}  # the pin it got was released
    assert _metric(await _metrics(h), "kvturn_router_stale_handles_total",
                   reason="engine_changed") == 1


async def test_a_restart_seen_by_health_checks_skips_the_pin(make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.router.health.check_all()
    await h.chat("c")
    h.cluster.decodes[0].restart()
    await h.router.health.check_all()
    assert h.router.decodes.members[0].engine_id == "decode0-engine-2"
    h.cluster.log.clear()
    resp = await h.chat("c")
    assert resp.headers["X-KVTurn-Reuse"] == "stale"
    assert h.cluster.calls("decode0.control", "POST") == []
    resp = await h.chat("c")
    assert resp.headers["X-KVTurn-Reuse"] == "hit"


async def test_a_restart_not_yet_seen_by_health_checks_is_stale_once(
        make_harness: MakeHarness) -> None:
    """The decode restarts between two health checks: the turn after the restart recomputes,
    and the turn after that reuses again (the new engine named itself in its reply)."""
    h = await make_harness()
    await h.router.health.check_all()
    await h.chat("c")
    h.cluster.decodes[0].restart()
    backend = h.router.decodes.members[0]
    assert backend.engine_id == "decode0-engine-1"  # not checked since
    # While it was down the checks ejected it and found its control endpoint unreachable.
    backend.healthy = backend.control_ok = False
    resp = await h.chat("c")
    assert resp.headers["X-KVTurn-Reuse"] == "stale"
    assert h.router.decodes.members[0].engine_id == "decode0-engine-2"
    resp = await h.chat("c")
    assert resp.headers["X-KVTurn-Reuse"] == "hit"


async def test_a_record_of_an_unknown_decode_is_stale(make_harness: MakeHarness) -> None:
    clock = ManualClock()
    store = MemoryStore(clock=clock)
    cluster = Cluster(decodes=2)
    before = await make_harness(cluster, store=store, clock=clock)
    await before.chat("c")
    placement = await store.get("-/c")
    assert placement is not None
    # Another router on the same store, configured without the decode that holds "c".
    others = tuple(u for u in cluster.decode_urls if u != placement.decode)
    after = await make_harness(cluster, store=store, clock=clock, decode=others)
    resp = await after.chat("c")
    assert resp.headers["X-KVTurn-Reuse"] == "stale"
    assert _metric(await _metrics(after), "kvturn_router_stale_handles_total",
                   reason="unknown_decode") == 1
    placement = await store.get("-/c")
    assert placement is not None and placement.decode == others[0]


@pytest.mark.parametrize("failure", ["connect", "hang", ("status", 500)],
                         ids=["unreachable", "timeout", "500"])
async def test_a_failing_control_endpoint_costs_reuse_not_the_turn(
        make_harness: MakeHarness, failure: Any) -> None:
    h = await make_harness()
    await h.chat("c")
    decode = h.cluster.decodes[0]
    decode.control_fail_next(failure)
    resp = await h.chat("c")
    assert resp.status_code == 200
    assert resp.headers["X-KVTurn-Reuse"] == "stale"
    assert h.cluster.bodies("prefill0")[-1]["kv_transfer_params"]["remote_engine_id"] is None
    backend = h.router.decodes.members[0]
    if failure in ("connect", "hang"):
        # Until a health check finds the control endpoint again, no pins are tried.
        assert not backend.control_ok
        h.cluster.log.clear()
        resp = await h.chat("c")
        assert resp.headers["X-KVTurn-Reuse"] == "stale"
        assert h.cluster.calls("decode0.control") == []
        await h.router.health.check_all()
        assert backend.control_ok
    resp = await h.chat("c")
    assert resp.headers["X-KVTurn-Reuse"] == "hit"


async def test_a_failed_unpin_does_not_touch_the_turn(make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.chat("c")
    decode = h.cluster.decodes[0]
    decode.control_fail_next("ok", "connect")  # pin answers, unpin is refused
    resp = await h.chat("c")
    assert resp.status_code == 200 and resp.headers["X-KVTurn-Reuse"] == "hit"


async def test_a_decode_silent_mid_stream_times_out_into_an_error_event(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    h.cluster.decodes[0].gate = asyncio.Event()  # never set: silent after the first chunk
    resp = await h.chat("c", stream=True)
    assert resp.status_code == 200
    events = [e for e in resp.content.split(b"\n\n") if e]
    assert events[0] == DEFAULT_SSE[0].rstrip(b"\n")
    error = json.loads(events[1].removeprefix(b"data: "))
    assert "timeout" in error["error"]["message"]
    assert h.router.decodes.members[0].in_flight == 0
