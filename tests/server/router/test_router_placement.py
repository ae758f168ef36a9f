"""Where a turn runs: the decode alone, or which prefill, and whether a pin is worth it.

docs/http-api.md (B, "Placement"); router/_placement.py, router/_history.py.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvturn_server.router._config import RouterConfig, RouterConfigError
from kvturn_server.router._history import History, Transcript, new_tokens
from kvturn_server.router._identity import conversation_key
from kvturn_server.router._legs import DecodeUsage
from kvturn_server.router._placement import (
    choose_decode,
    choose_prefill,
    conditional_decode,
    read_gain,
    served_tokens,
)
from kvturn_server.router._pool import Backend, Pool
from kvturn_server.router._state import Placement
from tests.fakes.backends import Cluster, wait_for
from tests.fakes.router_harness import MakeHarness

KEY = conversation_key("c", None)
U1 = {"role": "user", "content": "list the files in the repository"}
REPLY = {"role": "assistant", "content": "Hello"}
TOOL = {"role": "tool", "tool_call_id": "call-1", "content": "README.md setup.py"}


def turn2(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    return [U1, REPLY, TOOL, *extra]


def metric(h: Any, name: str, **labels: str) -> float:
    value = h.router.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# The history the router remembers, and its estimate.

def test_a_transcript_extends_exactly_the_history_it_started_with() -> None:
    first = Transcript([U1]).history()
    assert Transcript([U1, REPLY, TOOL]).extends(first)
    assert Transcript([U1]).extends(first)
    assert not Transcript([{**U1, "content": "list the files"}, REPLY]).extends(first)
    assert not Transcript([REPLY, U1]).extends(first)
    # Message boundaries count: the same characters split differently are another history.
    a = Transcript([{"c": "ab"}, {"c": "c"}]).history()
    assert not Transcript([{"c": "a"}, {"c": "bc"}]).extends(a)
    assert not Transcript([U1]).extends(History(2, 10, first.digest))


def test_the_estimate_converts_new_characters_at_the_conversation_s_own_rate() -> None:
    history = Transcript([U1]).history()
    t = Transcript([U1, REPLY, TOOL])
    reply_chars, tool_chars = t.sizes[1], t.sizes[2]
    known = 300  # the last prompt and its reply, as the decode's usage counted them
    per_char = known / (history.chars + reply_chars)
    # The reply coming back is known; the tool message is new.
    assert new_tokens(history, t, known_tokens=known) == pytest.approx(per_char * tool_chars,
                                                                       abs=1)
    assert new_tokens(history, Transcript([{**U1, "content": "x"}]), known_tokens=known) is None
    assert new_tokens(history, t, known_tokens=0) is None


def test_placements_round_trip_and_old_records_still_read() -> None:
    history = Transcript([U1]).history()
    p = Placement(decode="http://d", engine_id="e", num_tokens=300, expires_at=5.0, turn="t",
                  readable_tokens=256, block_size=128, prefill="http://p", prefill_tokens=200,
                  history=history)
    assert Placement.from_json(p.to_json()) == p
    old = Placement.from_json(b'{"decode": "http://d", "engine_id": null, "num_tokens": 7, '
                              b'"expires_at": 1.0, "turn": "t"}')
    assert old.history is None and old.prefill is None and old.cached_tokens == 7
    assert old.retained
    unretained = Placement(decode="http://d", engine_id=None, num_tokens=300, expires_at=5.0,
                           turn="t", history=history, retained=False)
    assert Placement.from_json(unretained.to_json()) == unretained
    assert unretained.cached_tokens == 0  # nothing to pin or read


# Choosing a prefill.

def _pool(n: int = 2) -> Pool:
    return Pool("prefill", [Backend("prefill", f"http://p{i}") for i in range(n)],
                eject_after=1, readmit_after=1)


def _held_by(url: str | None) -> Placement:
    return Placement(decode="http://d", engine_id=None, num_tokens=512, expires_at=1e12,
                     turn="t", readable_tokens=512, block_size=128, prefill=url,
                     prefill_tokens=300)


def test_kv_aware_prefers_the_holder_until_it_is_busier_than_the_slack() -> None:
    pool = _pool()
    p0, p1 = pool.members
    placement = _held_by(p1.url)
    assert choose_prefill(pool, "kv-aware", placement, slack=1) == (p1, "holder")
    p1.in_flight = 1
    assert choose_prefill(pool, "kv-aware", placement, slack=1) == (p1, "holder")
    p1.in_flight = 2
    assert choose_prefill(pool, "kv-aware", placement, slack=1) == (p0, "load")
    # Session affinity stays whatever the load.
    assert choose_prefill(pool, "affinity", placement, slack=1) == (p1, "affinity")
    p1.healthy = False
    assert choose_prefill(pool, "affinity", placement, slack=1) == (p0, "load")


def test_round_robin_and_least_loaded_ignore_the_holder() -> None:
    pool = _pool()
    placement = _held_by(pool.members[0].url)
    picks = [choose_prefill(pool, "round-robin", placement, slack=1)[0] for _ in range(4)]
    assert picks[0] is not picks[1] and picks[0] is picks[2] and picks[1] is picks[3]
    pool.members[0].in_flight = 3
    assert choose_prefill(pool, "least-loaded", placement, slack=1) == (pool.members[1], "load")


def test_a_decode_keeps_its_conversations_until_it_is_overloaded() -> None:
    pool = Pool("decode", [Backend("decode", f"http://d{i}") for i in range(2)],
                eject_after=1, readmit_after=1)
    d0, d1 = pool.members
    assert choose_decode(pool, d1, slack=4) is d1
    d1.in_flight = 4
    assert choose_decode(pool, d1, slack=4) is d1
    d1.in_flight = 5
    assert choose_decode(pool, d1, slack=4) is d0
    d1.healthy = False
    assert choose_decode(pool, d1, slack=4) is d0
    assert choose_decode(pool, None, slack=4) in (d0, d1)
    # A holder that discovery removed while the turn's prefill ran, with no healthy decode
    # left in the pool: its own leg is tried (and falls back if it fails), not a 500.
    d0.healthy = False
    gone = Backend("decode", "http://d9")
    assert choose_decode(pool, gone, slack=4) is gone


def test_the_gain_of_a_read_is_what_the_retention_holds_beyond_the_prefill() -> None:
    pool = _pool()
    placement = _held_by(pool.members[0].url)
    # 300 prompt tokens in the holder's cache are 2 full blocks of 128.
    assert read_gain(placement, pool.members[0]) == 512 - 256
    assert read_gain(placement, pool.members[1]) == 512


# Through the router.

@pytest.mark.parametrize("stream", [False, True])
async def test_a_short_next_turn_runs_on_the_holding_decode_alone(
        make_harness: MakeHarness, stream: bool) -> None:
    cluster = Cluster()
    h = await make_harness(cluster, decode_continue_tokens=512)
    first = await h.chat("c", messages=[U1], stream=stream)
    assert first.headers["X-KVTurn-Route"] == "prefill"
    assert first.headers["X-KVTurn-Prefill-Choice"] == "load"
    resp = await h.chat("c", messages=turn2(), stream=stream)
    assert resp.status_code == 200
    assert resp.headers["X-KVTurn-Route"] == "decode"
    assert "X-KVTurn-Prefill-Choice" not in resp.headers
    # A stream's headers precede the decode's work: its reuse is known from its usage, after.
    assert resp.headers["X-KVTurn-Reuse"] == ("pending" if stream else "hit")
    assert metric(h, "kvturn_router_reuse_total", outcome="hit") == 1
    assert len(cluster.legs("prefill0")) == 1  # only the first turn had a prefill leg
    assert not cluster.calls("decode0.control", "POST")  # no pin
    body = cluster.bodies("decode0")[-1]
    assert body["kv_transfer_params"] == {"do_remote_prefill": False,
                                          "kvturn": {"conversation": KEY}}
    assert body["messages"] == turn2()
    assert h.router.decodes.members[0].continuing == 0
    assert metric(h, "kvturn_router_routes_total", route="decode", choice="") == 1
    # The continued turn is recorded too: the next one continues again.
    third = await h.chat("c", messages=turn2(REPLY, TOOL), stream=stream)
    assert third.headers["X-KVTurn-Route"] == "decode"


async def test_the_decode_s_own_report_is_the_reuse_value_of_a_continued_turn(
        make_harness: MakeHarness) -> None:
    cluster = Cluster()
    h = await make_harness(cluster, decode_continue_tokens=512)
    await h.chat("c", messages=[U1])

    def reply(body: dict[str, Any]) -> Any:
        import httpx2
        return httpx2.Response(200, json={
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "kv_transfer_params": {"kvturn": {
                "retained": True, "engine_id": cluster.decodes[0].engine_id,
                "num_tokens": 400, "expires_in": 480.0,
                "reuse": {"reason": "partial", "reused_tokens": 128, "local_tokens": 128}}}})

    cluster.decodes[0].fail_next(reply)
    resp = await h.chat("c", messages=turn2())
    assert resp.headers["X-KVTurn-Route"] == "decode"
    assert (resp.headers["X-KVTurn-Reuse"], resp.headers["X-KVTurn-Reused-Tokens"]) == \
        ("partial", "128")
    assert "kv_transfer_params" not in resp.json()


@pytest.mark.parametrize(("messages", "why"), [
    ([{**U1, "content": "edited"}, REPLY, TOOL], "edited"),
    (turn2({"role": "user", "content": "word " * 5000}), "too_long"),
])
async def test_edited_or_long_turns_take_the_prefill_path(
        make_harness: MakeHarness, messages: list[dict[str, Any]], why: str) -> None:
    cluster = Cluster()
    h = await make_harness(cluster, decode_continue_tokens=512)
    await h.chat("c", messages=[U1])
    resp = await h.chat("c", messages=messages)
    assert resp.headers["X-KVTurn-Route"] == "prefill"
    assert len(cluster.legs("prefill0")) == 2
    assert [e.path.rsplit("/", 1)[-1] for e in cluster.calls("decode0.control", "POST")] == \
        ["pin"]
    assert metric(h, "kvturn_router_not_continued_total", why=why) == 1


LONG_TOOL = {"role": "tool", "tool_call_id": "call-2", "content": "x" * 600}  # ~1,000 tokens


async def test_a_long_turn_continues_where_the_host_tier_alone_holds_the_history(
        make_harness: MakeHarness) -> None:
    cluster = Cluster()
    h = await make_harness(cluster, decode_continue_tokens=512)  # host: the default 4,096
    await h.chat("c", messages=[U1])
    cluster.decodes[0].host_only[KEY] = 64
    resp = await h.chat("c", messages=turn2(LONG_TOOL))
    assert resp.status_code == 200
    # Too long for the device's threshold; the pin says the decode can load the history, so
    # it continued after all: not counted among the turns the decode did not continue.
    assert metric(h, "kvturn_router_not_continued_total", why="too_long") == 0
    assert [e.path.rsplit("/", 1)[-1] for e in cluster.calls("decode0.control", "POST")] == \
        ["pin"]
    assert resp.headers["X-KVTurn-Route"] == "decode"
    assert len(cluster.legs("prefill0")) == 1  # the first turn's only
    assert resp.headers["X-KVTurn-Reuse"] == "hit"  # what the decode's usage reported
    assert h.router.decodes.members[0].continuing == 0


@pytest.mark.parametrize(("continue_tokens", "host_tokens", "busy"),
                         [(512, 0, 0), (512, 4096, 3500), (0, 4096, 0)])
async def test_a_host_only_history_not_continued_is_recomputed_and_kept(
        make_harness: MakeHarness, continue_tokens: int, host_tokens: int, busy: int) -> None:
    cluster = Cluster()
    h = await make_harness(cluster, decode_continue_tokens=continue_tokens,
                           decode_continue_host_tokens=host_tokens)
    await h.chat("c", messages=[U1])
    cluster.decodes[0].host_only[KEY] = 64
    h.router.decodes.members[0].continuing = busy  # other continued turns are computing
    resp = await h.chat("c", messages=turn2(LONG_TOOL))
    assert resp.headers["X-KVTurn-Route"] == "prefill"
    assert resp.headers["X-KVTurn-Reuse"] == "stale"  # nothing on the device to read
    assert len(cluster.legs("prefill0")) == 2
    # The lease goes on in the host tier: the record is not dropped as a stale handle.
    assert metric(h, "kvturn_router_stale_handles_total", reason="evicted") == 0
    assert metric(h, "kvturn_router_not_continued_total",
                  why="too_long" if continue_tokens else "off") == 1


async def test_a_host_only_history_not_continued_is_read_from_the_host_tier_when_served(
        make_harness: MakeHarness) -> None:
    cluster = Cluster()
    h = await make_harness(cluster, decode_continue_tokens=512, decode_continue_host_tokens=0)
    await h.chat("c", messages=[U1])
    decode = cluster.decodes[0]
    decode.host_only[KEY] = 64
    decode.host_reads = True
    resp = await h.chat("c", messages=turn2(LONG_TOOL))
    assert resp.headers["X-KVTurn-Route"] == "prefill"
    pins = [e.body for e in cluster.calls("decode0.control", "POST")
            if e.path.endswith("/pin")]
    # The first pin answers host_tokens; not continued there, the second asks a host read.
    assert [p.get("host_reads") for p in pins] == [None, True]
    params = cluster.bodies("prefill0")[-1]["kv_transfer_params"]
    assert (params["remote_engine_id"], params["remote_port"]) == \
        (f"{decode.engine_id}-host", 41000)
    assert resp.headers["X-KVTurn-Reuse"] != "stale"  # what the prefill's report says
    await wait_for(lambda: bool(decode.unpinned))  # the host pin goes with the leg
    assert not decode.pins


async def test_a_host_continuation_whose_decode_fails_first_takes_the_prefill_path(
        make_harness: MakeHarness) -> None:
    cluster = Cluster()
    h = await make_harness(cluster, decode_continue_tokens=512)
    await h.chat("c", messages=[U1])
    cluster.decodes[0].host_only[KEY] = 64
    cluster.decodes[0].fail_next(("status", 503))
    resp = await h.chat("c", messages=turn2(LONG_TOOL))
    assert resp.status_code == 200
    assert resp.headers["X-KVTurn-Route"] == "prefill"
    # What the prefill path reports for a retention it could not read, counted once.
    assert resp.headers["X-KVTurn-Reuse"] == "stale"
    assert len(cluster.legs("prefill0")) == 2
    assert h.router.decodes.members[0].continuing == 0
    assert metric(h, "kvturn_router_not_continued_total", why="decode_failed") == 1
    assert metric(h, "kvturn_router_not_continued_total", why="too_long") == 0


async def test_a_busy_decode_sends_the_turn_to_the_prefill(make_harness: MakeHarness) -> None:
    cluster = Cluster()
    h = await make_harness(cluster, decode_continue_tokens=512, decode_continue_budget=600)
    await h.chat("c", messages=[U1])
    h.router.decodes.members[0].continuing = 590  # another continued turn is computing
    resp = await h.chat("c", messages=turn2())
    assert resp.headers["X-KVTurn-Route"] == "prefill"
    assert metric(h, "kvturn_router_not_continued_total", why="busy") == 1
    assert h.router.decodes.members[0].continuing == 590


async def test_a_restarted_decode_is_not_asked_to_continue(make_harness: MakeHarness) -> None:
    cluster = Cluster()
    h = await make_harness(cluster, decode_continue_tokens=512)
    await h.chat("c", messages=[U1])
    cluster.decodes[0].restart()
    h.router.decodes.members[0].engine_id = cluster.decodes[0].engine_id
    resp = await h.chat("c", messages=turn2())
    assert resp.headers["X-KVTurn-Route"] == "prefill"
    assert resp.headers["X-KVTurn-Reuse"] == "stale"
    assert metric(h, "kvturn_router_not_continued_total", why="stale") == 1


async def test_a_continued_turn_whose_decode_fails_first_takes_the_prefill_path(
        make_harness: MakeHarness) -> None:
    cluster = Cluster()
    h = await make_harness(cluster, decode_continue_tokens=512)
    await h.chat("c", messages=[U1])
    cluster.decodes[0].fail_next(("status", 503))
    resp = await h.chat("c", messages=turn2())
    assert resp.status_code == 200
    assert resp.headers["X-KVTurn-Route"] == "prefill"
    assert len(cluster.legs("prefill0")) == 2
    assert h.router.decodes.members[0].continuing == 0
    assert metric(h, "kvturn_router_not_continued_total", why="decode_failed") == 1


async def test_kv_aware_placement_returns_to_the_prefill_that_holds_the_conversation(
        make_harness: MakeHarness) -> None:
    cluster = Cluster(prefills=2)
    h = await make_harness(cluster)
    await h.chat("c", messages=[U1])
    (holder,) = [p for p in cluster.prefills if cluster.legs(p.name)]
    for _ in range(3):
        await h.chat("other")  # round the least-loaded ties
        resp = await h.chat("c", messages=turn2())
        assert resp.headers["X-KVTurn-Prefill-Choice"] == "holder"
    assert len(cluster.legs(holder.name)) >= 4


async def test_no_pin_when_the_prefill_already_holds_what_the_decode_would_give(
        make_harness: MakeHarness) -> None:
    cluster = Cluster()
    cluster.prefills[0].prompt_tokens = 100  # the fake decode retains 100 tokens
    h = await make_harness(cluster)
    await h.chat("c", messages=[U1])
    # The prefill's own cache covered the prompt's full blocks (block size 16, 100 tokens).
    cluster.prefills[0].report = {"reason": "miss", "reused_tokens": 0, "local_tokens": 96}
    resp = await h.chat("c", messages=turn2())
    assert resp.headers["X-KVTurn-Route"] == "prefill"
    assert (resp.headers["X-KVTurn-Reuse"], resp.headers["X-KVTurn-Reused-Tokens"]) == \
        ("hit", "0")
    assert not cluster.calls("decode0.control", "POST")
    # The leg carried no retention; the decode still retains the turn.
    assert cluster.bodies("prefill0")[-1]["kv_transfer_params"]["remote_block_ids"] is None
    assert cluster.bodies("decode0")[-1]["kv_transfer_params"]["kvturn"] == \
        {"conversation": KEY}


async def test_a_retry_on_a_prefill_that_lacks_the_conversation_pins_for_it(
        make_harness: MakeHarness) -> None:
    cluster = Cluster(prefills=2)
    for p in cluster.prefills:
        p.prompt_tokens = 100
    h = await make_harness(cluster)
    await h.chat("c", messages=[U1])
    (holder,) = [p for p in cluster.prefills if cluster.legs(p.name)]
    holder.fail_next(("status", 503))
    resp = await h.chat("c", messages=turn2())
    assert resp.status_code == 200
    assert resp.headers["X-KVTurn-Reuse"] == "hit"
    assert [e.path.rsplit("/", 1)[-1] for e in cluster.calls("decode0.control", "POST")] == \
        ["pin"]


async def test_stock_mode_keeps_affinity_but_neither_pins_nor_retains(
        make_harness: MakeHarness) -> None:
    cluster = Cluster(prefills=2)
    h = await make_harness(cluster, kv_reuse=False, prefill_policy="affinity",
                           decode_continue_tokens=512)
    await h.chat("c", messages=[U1])
    (holder,) = [p for p in cluster.prefills if cluster.legs(p.name)]
    for _ in range(3):
        await h.chat("other")
        resp = await h.chat("c", messages=turn2())
        assert resp.headers["X-KVTurn-Route"] == "prefill"
        assert resp.headers["X-KVTurn-Prefill-Choice"] == "affinity"
        assert resp.headers["X-KVTurn-Reuse"] == "disabled"
    assert len(cluster.legs(holder.name)) == 4
    assert not cluster.calls("decode0.control")
    assert all("kvturn" not in (b.get("kv_transfer_params") or {})
               for b in cluster.bodies("decode0"))
    assert not cluster.decodes[0].retentions


# Stock conditional disaggregation (the baseline): kv_reuse off, conditional_disagg set.

def _sent(tokens: int, messages: list[dict[str, Any]], engine_id: str | None = None) -> Placement:
    return Placement(decode="http://d0", engine_id=engine_id, num_tokens=tokens,
                     expires_at=0.0, turn="t", history=Transcript(messages).history())


def test_conditional_decode_counts_the_new_messages_at_the_prompt_s_own_rate() -> None:
    holder = Backend("decode", "http://d0")
    t = Transcript(turn2())
    sent = Transcript([U1]).history()
    # Three tokens a character of what the decode processed (the prompt and the reply, which
    # comes back as the first new message and counts as cached).
    tokens = 3 * (sent.chars + t.sizes[1])
    estimate, why = conditional_decode(placement=_sent(tokens, [U1]), holder=holder,
                                       transcript=t, max_tokens=10_000)
    assert (estimate, why) == (3 * t.sizes[2], "")
    assert conditional_decode(placement=_sent(tokens, [U1]), holder=holder, transcript=t,
                              max_tokens=3 * t.sizes[2] - 1) == (0, "too_long")
    assert conditional_decode(placement=_sent(tokens, [U1]), holder=holder,
                              transcript=Transcript([{**U1, "content": "x"}, REPLY]),
                              max_tokens=512) == (0, "edited")
    assert conditional_decode(placement=_sent(0, [U1]), holder=holder, transcript=t,
                              max_tokens=512) == (0, "no_history")
    assert conditional_decode(placement=_sent(tokens, [U1]), holder=holder, transcript=t,
                              max_tokens=0) == (0, "off")
    holder.engine_id = "new"
    assert conditional_decode(placement=_sent(tokens, [U1], engine_id="old"), holder=holder,
                              transcript=t, max_tokens=512) == (0, "stale")
    holder.healthy = False
    assert conditional_decode(placement=_sent(tokens, [U1]), holder=holder, transcript=t,
                              max_tokens=512) == (0, "unhealthy")


def test_a_record_counts_what_the_decode_s_usage_said_else_the_prefill_s_count() -> None:
    assert served_tokens(DecodeUsage(100, 20, 64), 90) == 120
    assert served_tokens(None, 90) == 90
    assert served_tokens(None, 0) == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_stock_conditional_disaggregation_runs_short_turns_on_the_decode_alone(
        make_harness: MakeHarness, stream: bool) -> None:
    cluster = Cluster()
    cluster.prefills[0].prompt_tokens = 40
    h = await make_harness(cluster, kv_reuse=False, conditional_disagg=512)
    first = await h.chat("c", messages=[U1], stream=stream)
    assert first.headers["X-KVTurn-Route"] == "prefill"
    resp = await h.chat("c", messages=turn2(), stream=stream)
    assert resp.status_code == 200
    assert resp.headers["X-KVTurn-Route"] == "decode"
    assert resp.headers["X-KVTurn-Reuse"] == "disabled"
    assert len(cluster.legs("prefill0")) == 1
    # Nothing of kvturn's: no control call, no retention, no transfer params.
    assert not cluster.calls("decode0.control")
    assert "kv_transfer_params" not in cluster.bodies("decode0")[-1]
    assert not cluster.decodes[0].retentions
    assert metric(h, "kvturn_router_routes_total", route="decode", choice="") == 1
    # The continued turn is recorded as sent: the next short one continues too, a long one
    # and an edited one take the prefill path.
    third = await h.chat("c", messages=turn2(REPLY, TOOL), stream=stream)
    assert third.headers["X-KVTurn-Route"] == "decode"
    long = await h.chat("c", messages=turn2(REPLY, TOOL, REPLY,
                                            {"role": "user", "content": "word " * 5000}))
    assert long.headers["X-KVTurn-Route"] == "prefill"
    edited = await h.chat("c", messages=[{**U1, "content": "edited"}, REPLY, TOOL])
    assert edited.headers["X-KVTurn-Route"] == "prefill"
    assert metric(h, "kvturn_router_not_continued_total", why="too_long") == 1
    assert metric(h, "kvturn_router_not_continued_total", why="edited") == 1


async def test_stock_conditional_disaggregation_falls_back_to_p_d_when_the_decode_fails(
        make_harness: MakeHarness) -> None:
    cluster = Cluster()
    cluster.prefills[0].prompt_tokens = 40
    h = await make_harness(cluster, kv_reuse=False, conditional_disagg=512)
    await h.chat("c", messages=[U1])
    cluster.decodes[0].fail_next(("status", 503))
    resp = await h.chat("c", messages=turn2())
    assert resp.status_code == 200
    assert resp.headers["X-KVTurn-Route"] == "prefill"
    assert len(cluster.legs("prefill0")) == 2
    assert metric(h, "kvturn_router_not_continued_total", why="decode_failed") == 1


def test_conditional_disaggregation_is_the_stock_baseline_only() -> None:
    with pytest.raises(RouterConfigError, match="kv_reuse off"):
        RouterConfig(prefill=("http://p",), decode=("http://d",), conditional_disagg=512)
    assert RouterConfig(prefill=("http://p",), decode=("http://d",), kv_reuse=False,
                        conditional_disagg=512).conditional_disagg == 512


async def test_a_range_the_prefill_declined_to_read_is_not_pinned_for_again(
        make_harness: MakeHarness) -> None:
    cluster = Cluster()
    h = await make_harness(cluster)
    await h.chat("c", messages=[U1])
    # The fake decode's retention has 32 readable tokens; the prefill's cost model finds
    # computing them cheaper.
    cluster.prefills[0].report = {
        "reason": "below-threshold", "reused_tokens": 0, "local_tokens": 0,
        "cost": {"tokens": 32, "read_ms": 4.0, "compute_ms": 1.5, "source": "calibrated"}}
    second = await h.chat("c", messages=turn2())
    assert second.headers["X-KVTurn-Reuse"] == "below-threshold"
    pins = len(cluster.calls("decode0.control", "POST"))
    third = await h.chat("c", messages=turn2(REPLY, TOOL))
    assert third.headers["X-KVTurn-Reuse"] == "below-threshold"
    assert len(cluster.calls("decode0.control", "POST")) == pins  # no second pin
    # Metric label values are snake_case (kvturn.wire.metric_label).
    assert metric(h, "kvturn_router_reuse_total", outcome="below_threshold") == 2
    assert h.router.metrics.registry.get_sample_value(
        "kvturn_router_reuse_total", {"outcome": "below-threshold"}) is None
    # A read the prefill took lowers the floor again.
    prefill = h.router.prefills.members[0]
    h.router.prefills.read_reported(prefill, declined=0, reused=16, now=prefill.read_floor_at)
    assert prefill.read_floor == 15


async def test_the_debug_line_of_a_turn_names_its_route_and_each_leg_s_time(
        make_harness: MakeHarness, caplog: pytest.LogCaptureFixture) -> None:
    cluster = Cluster()
    h = await make_harness(cluster, decode_continue_tokens=512)
    with caplog.at_level(logging.DEBUG, logger="kvturn.router"):
        await h.chat("c", messages=[U1])
        await h.chat("c", messages=turn2())
    lines = [r for r in caplog.records if r.getMessage() == "request"]
    assert len(lines) == 2
    first, second = (r.kvturn_fields for r in lines)
    assert first["route"] == "prefill" and second["route"] == "decode"
    assert first["prefill_ms"] >= 0 and first["decode_ms"] >= 0
    assert "prefill_ms" not in second and second["decode_ms"] >= 0


async def test_a_round_robin_choice_is_counted_in_snake_case(make_harness: MakeHarness) -> None:
    h = await make_harness(Cluster(), prefill_policy="round-robin")
    resp = await h.chat("c", messages=[U1])
    assert resp.headers["X-KVTurn-Prefill-Choice"] == "round-robin"
    assert metric(h, "kvturn_router_routes_total", route="prefill", choice="round_robin") == 1
