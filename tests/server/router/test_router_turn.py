"""A turn through the router: legs, pin/unpin ordering, capture, affinity, headers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx2
import openai
import pytest

from kvturn_server.router._legs import NO_RETENTION_PARAMS
from kvturn_server.router._stream import split_done
from tests.fakes.backends import DEFAULT_SSE, AsgiCall, Cluster, sse, wait_for
from tests.fakes.router_harness import MakeHarness

TENANT_NONE = "-"  # the tenant of requests without Authorization


async def test_a_turn_without_conversation_runs_both_legs_without_reuse(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    resp = await h.client.post("/v1/completions", json={
        "model": "m", "prompt": "hi", "max_tokens": 20, "temperature": 0,
        "stream_options": {}, "min_tokens": 5})
    assert resp.status_code == 200
    assert resp.headers["X-KVTurn-Reuse"] == "miss"
    assert resp.headers["X-KVTurn-Reused-Tokens"] == "0"
    assert "X-KVTurn-Conversation" not in resp.headers
    [p_body] = h.cluster.bodies("prefill0")
    [d_body] = h.cluster.bodies("decode0")
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False and p_body["n"] == 1
    assert "stream_options" not in p_body and "min_tokens" not in p_body
    assert p_body["kv_transfer_params"] == NO_RETENTION_PARAMS
    # The decode gets the prefill's P->D params, without the prefill's kvturn report and
    # without a conversation: nothing is retained.
    assert d_body["kv_transfer_params"]["remote_engine_id"] == "prefill0-engine-1"
    assert "kvturn" not in d_body["kv_transfer_params"]
    assert d_body["max_tokens"] == 20 and d_body["min_tokens"] == 5
    # No control calls at all.
    assert h.cluster.calls("decode0.control") == []
    # The client never sees the decode's transfer params.
    assert "kv_transfer_params" not in resp.json()


async def test_every_openai_and_vllm_field_passes_through(make_harness: MakeHarness) -> None:
    h = await make_harness()
    fields: dict[str, Any] = {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {"type": "json_object"}, "temperature": 0.3, "top_p": 0.9,
        "top_k": 5, "seed": 7, "stop": ["\n"], "presence_penalty": 0.1, "logprobs": True,
        "top_logprobs": 2, "max_completion_tokens": 50, "session_id": "sess-1",
        "chat_template_kwargs": {"enable_thinking": False}, "user": "u"}
    resp = await h.chat("c", **fields)
    assert resp.status_code == 200
    [p_body] = h.cluster.bodies("prefill0")
    [d_body] = h.cluster.bodies("decode0")
    for name, value in fields.items():
        assert d_body[name] == value, name
        if name != "max_completion_tokens":
            assert p_body[name] == value, name
    assert p_body["max_completion_tokens"] == 1
    assert h.cluster.legs("prefill0")[0].path == "/v1/chat/completions"


async def test_client_transfer_params_and_kvturn_fields_are_stripped(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    for _ in range(2):
        await h.chat("c", kv_transfer_params={"remote_host": "10.6.6.6",
                                              "remote_block_ids": [[666]]},
                     kvturn={"handle": "forged"}, kvturn_options={"x": 1})
    for entry in h.cluster.log:
        assert "kvturn" not in entry.body and "kvturn_options" not in entry.body
        assert "conversation_id" not in entry.body
        assert "10.6.6.6" not in json.dumps(entry.body)
        assert "666" not in json.dumps(entry.body)


async def test_second_turn_pins_before_prefill_and_unpins_after(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    first = await h.chat("conv-1")
    assert first.headers["X-KVTurn-Reuse"] == "miss"
    decode = h.cluster.decodes[0]
    key = f"{TENANT_NONE}/conv-1"
    retained = decode.retentions[key]
    h.cluster.log.clear()

    second = await h.chat("conv-1")
    assert second.status_code == 200
    assert second.headers["X-KVTurn-Reuse"] == "hit"
    assert second.headers["X-KVTurn-Reused-Tokens"] == "48"
    assert second.headers["X-KVTurn-Conversation"] == "conv-1"
    seq = h.cluster.sequence()
    pin = seq.index("decode0.control POST pin")
    prefill = seq.index("prefill0 POST completions")
    unpin = next(i for i, s in enumerate(seq) if s.startswith("decode0.control DELETE"))
    assert pin < prefill < unpin
    [pin_call] = h.cluster.calls("decode0.control", "POST")
    assert pin_call.path == f"/kvturn/v1/retentions/{key}/pin"
    assert pin_call.body["ttl"] == pytest.approx(0.2 + 10)
    # Exactly the pinned params reach the prefill, turned into a P->D request.
    [p_body] = h.cluster.bodies("prefill0")
    assert p_body["kv_transfer_params"] == {**retained.params, "do_remote_decode": True,
                                            "do_remote_prefill": False}
    assert decode.unpinned == ["decode0-pin-1"] and decode.pins == {}
    # The decode leg carries the conversation so that the decode retains the new turn.
    [d_body] = h.cluster.bodies("decode0")
    assert d_body["kv_transfer_params"]["kvturn"] == {"conversation": key}


async def test_non_streaming_capture_comes_from_the_reply(make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.chat("c")
    placement = await h.router.store.get(f"{TENANT_NONE}/c")
    assert placement is not None
    assert placement.decode == h.cluster.decodes[0].url
    assert placement.engine_id == "decode0-engine-1"
    assert placement.num_tokens == 100
    assert placement.expires_at == h.clock() + 480.0
    # Captured from the reply: no describe call.
    assert h.cluster.calls("decode0.control", "GET") == []


async def test_non_streaming_reply_without_report_is_captured_by_describe(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    h.cluster.decodes[0].report_retained = False
    await h.chat("c")
    assert [c.path for c in h.cluster.calls("decode0.control", "GET")] == [
        "/kvturn/v1/retentions/-/c"]
    placement = await h.router.store.get("-/c")
    assert placement is not None and placement.num_tokens == 100


async def test_streaming_capture_asks_the_decode_after_the_stream(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    resp = await h.chat("c", stream=True)
    assert resp.status_code == 200
    assert resp.content == b"".join(DEFAULT_SSE)
    assert resp.headers["X-KVTurn-Reuse"] == "miss"
    seq = h.cluster.sequence()
    assert seq[-2:] == ["decode0 POST completions", "decode0.control GET c"]
    placement = await h.router.store.get("-/c")
    assert placement is not None and placement.num_tokens == 100

    resp = await h.chat("c", stream=True)
    assert resp.headers["X-KVTurn-Reuse"] == "hit"
    assert resp.headers["X-KVTurn-Reused-Tokens"] == "48"
    placement = await h.router.store.get("-/c")
    assert placement is not None and placement.num_tokens == 200


async def test_stream_capture_waits_for_a_retention_newer_than_the_turn(
        make_harness: MakeHarness) -> None:
    h = await make_harness(capture_attempts=3)
    await h.chat("c", stream=True)
    decode = h.cluster.decodes[0]
    # The decode makes the next retention visible only on the second describe.
    decode.retain_late = 2
    h.clock.advance(1)
    decode.retentions["-/c"].created -= 5.0  # the old one is clearly older than the turn
    await h.chat("c", stream=True)
    describes = h.cluster.calls("decode0.control", "GET")
    assert len(describes) == 1 + 2
    placement = await h.router.store.get("-/c")
    assert placement is not None and placement.num_tokens == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_a_turn_with_stop_strings_waits_for_a_late_retention(
        make_harness: MakeHarness, stream: bool) -> None:
    # vLLM ends a stop-string match with an abort the engine gets after the reply went out:
    # the decode's retention may appear only then, also on a conversation's first turn.
    h = await make_harness(capture_attempts=3)
    decode = h.cluster.decodes[0]
    decode.report_retained = False  # what an aborted request's reply looks like
    decode.retain_late = 2
    await h.chat("c", stream=stream, stop=["\nObservation:"])
    assert len(h.cluster.calls("decode0.control", "GET")) == 2
    placement = await h.router.store.get("-/c")
    assert placement is not None and placement.num_tokens == 100


async def test_without_stop_strings_nothing_retained_is_final(
        make_harness: MakeHarness) -> None:
    h = await make_harness(capture_attempts=3)
    decode = h.cluster.decodes[0]
    decode.retain = False  # a turn too short to fill a block
    await h.chat("c", stream=True)
    assert len(h.cluster.calls("decode0.control", "GET")) == 1  # no waiting on a 404
    record = await h.router.store.get("-/c")
    assert record is not None and not record.retained


async def test_stream_reaches_the_client_before_the_decode_finishes(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    decode = h.cluster.decodes[0]
    decode.gate = gate = asyncio.Event()
    body = json.dumps({"model": "m", "messages": [], "stream": True,
                       "conversation_id": "c"}).encode()
    call = AsgiCall(h.app, "POST", "/v1/chat/completions", body,
                    {"content-type": "application/json"})
    first, more = await call.next_body()
    # The first event is out while the decode is still generating (it waits on the gate).
    assert first == DEFAULT_SSE[0] and more
    assert call.status == 200 and call.headers["x-kvturn-reuse"] == "miss"
    assert not gate.is_set()
    gate.set()
    rest = b""
    while True:
        chunk, more = await call.next_body()
        rest += chunk
        if not more:
            break
    assert first + rest == b"".join(DEFAULT_SSE)
    await call.done()


async def test_done_reaches_the_client_only_after_the_capture(
        make_harness: MakeHarness) -> None:
    # An agent sends its next turn the moment it reads [DONE]: by then this turn's retention
    # must be recorded, or the next turn would find nothing to reuse.
    h = await make_harness()
    gate = asyncio.Event()

    async def slow_describe(body: dict[str, Any]) -> None:
        await gate.wait()

    h.cluster.decodes[0].control_fail_next(slow_describe)
    body = json.dumps({"model": "m", "messages": [], "stream": True,
                       "conversation_id": "c"}).encode()
    call = AsgiCall(h.app, "POST", "/v1/chat/completions", body,
                    {"content-type": "application/json"})
    received = b""
    while not received.endswith(b"".join(DEFAULT_SSE[:-1])):
        chunk, more = await call.next_body()
        received += chunk
        assert more
    await wait_for(lambda: len(h.cluster.calls("decode0.control", "GET")) == 1)
    # The capture is waiting on the decode: every token is out, [DONE] is not.
    assert b"[DONE]" not in received and call.messages.empty()
    assert await h.router.store.get("-/c") is None
    gate.set()
    chunk, more = await call.next_body()
    assert chunk == DEFAULT_SSE[-1]
    placement = await h.router.store.get("-/c")
    assert placement is not None and placement.num_tokens == 100
    assert (await call.next_body()) == (b"", False)
    await call.done()
    assert len(h.cluster.calls("decode0.control", "GET")) == 1  # captured once, not again


async def test_a_break_after_done_is_a_completed_stream(make_harness: MakeHarness) -> None:
    h = await make_harness()
    events = [*sse({"a": 1}), b"data: [DONE]\n\n", b"never read"]
    h.cluster.decodes[0].chunks = events
    h.cluster.decodes[0].fail_next(("break_after", 2))
    resp = await h.chat("c", stream=True)
    assert resp.content == b"".join(events[:2])  # no error event after a finished answer
    assert len(h.cluster.calls("decode0.control", "GET")) == 1  # and it was captured
    assert h.router.decodes.by_url(h.cluster.decode_urls[0]).healthy  # type: ignore[union-attr]


@pytest.mark.parametrize(("data", "expected"), [
    (b"data: 1\n\ndata: [DONE]\n\n", (b"data: 1\n\n", b"data: [DONE]\n\n")),
    (b"data: [DONE]\r\n\r\n", (b"", b"data: [DONE]\r\n\r\n")),
    (b"data: 1\n\n", (b"data: 1\n\n", b"")),
    (b"data: x data: [DONE]\n\n", (b"data: x data: [DONE]\n\n", b"")),
])
def test_split_done(data: bytes, expected: tuple[bytes, bytes]) -> None:
    assert split_done(data) == expected


async def test_events_split_across_chunks_are_passed_on_whole(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    events = [*sse({"a": 1}, {"b": 2}), b"data: [DONE]\n\n"]
    joined = b"".join(events)
    h.cluster.decodes[0].chunks = [joined[:10], joined[10:40], joined[40:]]
    resp = await h.chat(None, stream=True)
    assert resp.content == joined


async def test_affinity_sends_the_next_turn_to_the_holder(make_harness: MakeHarness) -> None:
    cluster = Cluster(prefills=2, decodes=3)
    h = await make_harness(cluster)
    await h.chat("a")
    [holder] = [d for d in cluster.decodes if "-/a" in d.retentions]
    # A loaded holder keeps its conversation while within decode_affinity_slack (4)...
    h.router.decodes.by_url(holder.url).in_flight = 4  # type: ignore[union-attr]
    for _ in range(3):
        await h.chat("a")
    assert all(len(cluster.bodies(d.name)) == (4 if d is holder else 0)
               for d in cluster.decodes)
    # ... and loses it when busier than that: the turn decodes elsewhere, the old retention
    # is released once the new one is recorded.
    h.router.decodes.by_url(holder.url).in_flight = 5  # type: ignore[union-attr]
    await h.chat("a")
    [moved] = [d for d in cluster.decodes if "-/a" in d.retentions]
    assert moved is not holder and len(cluster.bodies(holder.name)) == 4


async def test_prefill_and_conversations_without_history_go_by_load(
        make_harness: MakeHarness) -> None:
    cluster = Cluster(prefills=3, decodes=3)
    h = await make_harness(cluster)
    busy = h.router.prefills.members[0]
    busy.in_flight = 5
    for i in range(6):
        await h.chat(f"new-{i}")
    assert cluster.bodies("prefill0") == []
    assert len(cluster.bodies("prefill1")) == len(cluster.bodies("prefill2")) == 3
    assert sorted(len(cluster.bodies(d.name)) for d in cluster.decodes) == [2, 2, 2]


async def test_an_ejected_holder_loses_affinity(make_harness: MakeHarness) -> None:
    cluster = Cluster(decodes=2)
    h = await make_harness(cluster)
    await h.chat("m")
    [old] = [d for d in cluster.decodes if "-/m" in d.retentions]
    old_backend = h.router.decodes.by_url(old.url)
    assert old_backend is not None
    old_backend.healthy = False
    resp = await h.chat("m")
    # Nothing to read (its holder is out of rotation); the turn goes to the other decode.
    assert resp.headers["X-KVTurn-Reuse"] == "stale"
    assert cluster.calls(f"{old.name}.control") == []
    [new] = [d for d in cluster.decodes if d is not old]
    assert "-/m" in new.retentions
    placement = await h.router.store.get("-/m")
    assert placement is not None and placement.decode == new.url


async def test_moving_to_a_healthy_other_decode_releases_the_old_retention(
        make_harness: MakeHarness) -> None:
    cluster = Cluster(decodes=2)
    h = await make_harness(cluster)
    await h.chat("m")
    [old] = [d for d in cluster.decodes if "-/m" in d.retentions]
    [new] = [d for d in cluster.decodes if d is not old]
    # The holder fails before its first byte: the turn is retried on the other decode.
    old.fail_next("connect")
    resp = await h.chat("m")
    assert resp.status_code == 200
    assert "-/m" in new.retentions
    assert "-/m" not in old.retentions and old.gone["-/m"] == "released"


async def test_no_reuse_header_skips_the_pin_but_still_retains(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.chat("c")
    h.cluster.log.clear()
    resp = await h.chat("c", headers={"X-KVTurn-No-Reuse": "edited"})
    assert resp.headers["X-KVTurn-Reuse"] == "disabled"
    assert resp.headers["X-KVTurn-Reused-Tokens"] == "0"
    assert h.cluster.calls("decode0.control", "POST") == []
    [p_body] = h.cluster.bodies("prefill0")
    assert p_body["kv_transfer_params"] == NO_RETENTION_PARAMS
    [d_body] = h.cluster.bodies("decode0")
    assert d_body["kv_transfer_params"]["kvturn"] == {"conversation": "-/c"}
    placement = await h.router.store.get("-/c")
    assert placement is not None and placement.num_tokens == 200


async def test_request_id_is_echoed_and_forwarded(make_harness: MakeHarness) -> None:
    h = await make_harness()
    resp = await h.chat("c", headers={"x-request-id": "req-42"})
    assert resp.headers["x-request-id"] == "req-42"
    assert all(e.headers.get("x-request-id") == "req-42" for e in h.cluster.legs("prefill0"))
    resp = await h.chat("c")
    assert len(resp.headers["x-request-id"]) == 32


async def test_models_and_health(make_harness: MakeHarness) -> None:
    h = await make_harness(Cluster(prefills=2, decodes=2))
    models = await h.client.get("/v1/models")
    assert models.json() == {"object": "list", "data": [{"id": "m"}]}
    health = await h.client.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "prefill": {"healthy": 2, "total": 2},
                             "decode": {"healthy": 2, "total": 2}, "state": "memory"}


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]"])
async def test_bad_bodies_get_an_openai_shaped_400(make_harness: MakeHarness,
                                                   raw: bytes) -> None:
    h = await make_harness()
    resp = await h.client.post("/v1/chat/completions", content=raw,
                               headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.headers["x-should-retry"] == "false"
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert h.cluster.log == []


async def test_too_large_bodies_are_refused(make_harness: MakeHarness) -> None:
    h = await make_harness(max_body_bytes=100)
    resp = await h.chat("c", prompt="x" * 200)
    assert resp.status_code == 413
    assert h.cluster.log == []


async def test_stock_openai_client_works_unchanged(make_harness: MakeHarness) -> None:
    h = await make_harness()
    client = openai.AsyncOpenAI(
        base_url="http://router/v1", api_key="sk-test", max_retries=0,
        http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=h.app)))
    completion = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-Conversation-ID": "oa"})
    assert completion.choices[0].message.content == "Hello"
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_headers={"X-Conversation-ID": "oa"})
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "Hello"
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-Conversation-ID": "oa"})
    assert raw.headers["X-KVTurn-Reuse"] == "hit"
    await client.close()


async def test_vllm_multi_turn_benchmark_style_requests(make_harness: MakeHarness) -> None:
    """vLLM's benchmarks/multi_turn client sends ``conversation_id`` in the body and
    streams with usage."""
    h = await make_harness()
    messages: list[dict[str, str]] = []
    reuse = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"question {turn}"})
        resp = await h.client.post("/v1/chat/completions", json={
            "model": "m", "messages": messages, "stream": True, "max_tokens": 16,
            "stream_options": {"include_usage": True}, "conversation_id": "CONV_ID_7",
            "min_tokens": 16, "seed": 0, "temperature": 0.0})
        await h.router.wait_idle()
        assert resp.status_code == 200
        reuse.append(resp.headers["X-KVTurn-Reuse"])
        messages.append({"role": "assistant", "content": "Hello"})
    assert reuse == ["miss", "hit", "hit"]
    assert all("conversation_id" not in b for b in h.cluster.bodies("decode0"))


async def test_unknown_routes_and_methods_get_openai_shaped_errors(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    for method, path, status in (("GET", "/v1/chat/completions", 405),
                                 ("POST", "/v1/embeddings", 404)):
        resp = await h.client.request(method, path)
        assert resp.status_code == status
        assert resp.json()["error"]["code"] == "no_route"


async def test_a_router_bug_is_an_openai_shaped_500(make_harness: MakeHarness,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    h = await make_harness()

    async def broken(self: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr("kvturn_server.router._turn.Turn.run", broken)
    resp = await h.chat("c")
    assert resp.status_code == 500
    assert resp.json()["error"]["code"] == "router_error"
    assert resp.headers["x-should-retry"] == "true"


@pytest.mark.parametrize(("data", "cut"), [
    (b"data: a\n\n", 9), (b"data: a\n\ndata: b", 9), (b"data: a\r\n\r\ndata: b", 11),
    (b"data: a", 0), (b"", 0), (b"data: a\n\ndata: b\r\n\r\n", 20)])
def test_complete_events(data: bytes, cut: int) -> None:
    from kvturn_server.router._stream import complete_events

    assert complete_events(data) == cut


async def test_no_reuse_without_a_conversation_is_disabled(make_harness: MakeHarness) -> None:
    h = await make_harness()
    resp = await h.chat(None, headers={"X-KVTurn-No-Reuse": "truncated"})
    assert resp.headers["X-KVTurn-Reuse"] == "disabled"
    assert "kvturn" not in h.cluster.bodies("decode0")[0]["kv_transfer_params"]


async def test_odd_request_ids_are_replaced(make_harness: MakeHarness) -> None:
    h = await make_harness()
    resp = await h.chat("c", headers={"x-request-id": "x" * 500})
    assert len(resp.headers["x-request-id"]) == 32
