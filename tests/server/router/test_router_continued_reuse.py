"""What a turn the decode continued alone reports: what the decode's own cache supplied (its
usage's cached tokens), never what the router's record expected it to hold; and what the
router does with a record that outlived the decode's KV (docs/http-api.md, A "Reuse report")."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx2
import pytest

from kvturn_server.router import _json
from kvturn_server.router._identity import conversation_key
from kvturn_server.router._legs import coverage
from tests.fakes.backends import DEFAULT_SSE, Cluster
from tests.fakes.router_harness import Harness, MakeHarness

KEY = conversation_key("c", None)
U1 = {"role": "user", "content": "list the files in the repository"}
REPLY = {"role": "assistant", "content": "Hello"}
TOOL = {"role": "tool", "tool_call_id": "call-1", "content": "README.md setup.py"}
TURN2 = [U1, REPLY, TOOL]


def metric(h: Harness, name: str, **labels: str) -> float:
    value = h.router.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.kvturn_fields for r in caplog.records if r.getMessage() == "request"]


async def continued(make_harness: MakeHarness, **settings: Any) -> Harness:
    """A conversation whose first turn the fake decode retained: its next turn continues."""
    h = await make_harness(Cluster(), decode_continue_tokens=512, **settings)
    await h.chat("c", messages=[U1])
    return h


def evict(h: Harness) -> None:
    decode = h.cluster.decodes[0]
    decode.retentions.pop(KEY)
    decode.gone[KEY] = "evicted"


def test_coverage_is_hit_when_every_full_block_but_the_last_token_s_was_cached() -> None:
    assert coverage(48, 64, 16) == "hit"  # (64 - 1) // 16 * 16 = 48
    assert coverage(64, 65, 16) == "hit"  # the last token is always computed
    assert coverage(48, 65, 16) == "partial"
    assert coverage(16, 64, 16) == "partial"
    assert coverage(0, 64, 16) == "miss"
    assert coverage(48, 64, 0) == "partial"  # no block size: a hit cannot be told


# Not streamed: the headers are sent after the decode's reply, and are the truth.

@pytest.mark.parametrize(("cached", "reason"), [(48, "hit"), (32, "partial"), (0, "miss")])
async def test_a_continued_reply_reports_what_the_decode_s_cache_supplied(
        make_harness: MakeHarness, cached: int, reason: str) -> None:
    h = await continued(make_harness)
    h.cluster.decodes[0].cached_tokens = cached
    resp = await h.chat("c", messages=TURN2)
    assert resp.headers["X-KVTurn-Route"] == "decode"
    assert (resp.headers["X-KVTurn-Reuse"], resp.headers["X-KVTurn-Reused-Tokens"]) == \
        (reason, str(cached))
    assert "X-KVTurn-Block-Size" not in resp.headers
    assert metric(h, "kvturn_router_reuse_total", outcome=reason) == 1 + (reason == "miss")
    assert metric(h, "kvturn_router_reused_tokens_total") == cached


async def test_a_continued_turn_whose_retention_was_evicted_is_a_miss_and_recorded_anew(
        make_harness: MakeHarness, caplog: pytest.LogCaptureFixture) -> None:
    h = await continued(make_harness)
    evict(h)
    with caplog.at_level(logging.DEBUG, logger="kvturn.router"):
        resp = await h.chat("c", messages=TURN2)
    # The router's record still named the retention, so the decode continued the turn; it
    # found nothing of the conversation and computed the whole prompt.
    assert resp.headers["X-KVTurn-Route"] == "decode"
    assert (resp.headers["X-KVTurn-Reuse"], resp.headers["X-KVTurn-Reused-Tokens"]) == \
        ("miss", "0")
    assert metric(h, "kvturn_router_continued_short_total") == 1
    (line,) = lines(caplog)
    # The fake retention's full blocks: two of 16 tokens.
    assert (line["reuse"], line["reused_tokens"], line["expected_tokens"]) == ("miss", 0, 32)
    assert (line["prompt_tokens"], line["cached_tokens"]) == (64, 0)
    # The decode retained this turn: the record is now that, and the next turn finds it.
    record = await h.router.store.get(KEY)
    assert record is not None and record.num_tokens == h.cluster.decodes[0].retentions[
        KEY].num_tokens
    resp = await h.chat("c", messages=[*TURN2, REPLY, TOOL])
    assert (resp.headers["X-KVTurn-Route"], resp.headers["X-KVTurn-Reuse"]) == ("decode", "hit")
    assert metric(h, "kvturn_router_continued_short_total") == 1


async def test_a_decode_that_reports_no_cached_tokens_leaves_the_reply_pending(
        make_harness: MakeHarness) -> None:
    h = await continued(make_harness)
    h.cluster.decodes[0].prompt_details = False
    resp = await h.chat("c", messages=TURN2)
    assert (resp.headers["X-KVTurn-Reuse"], resp.headers["X-KVTurn-Reused-Tokens"]) == \
        ("pending", "0")
    assert resp.headers["X-KVTurn-Block-Size"] == "16"
    assert metric(h, "kvturn_router_reuse_total", outcome="pending") == 1


async def test_without_cached_tokens_the_connector_s_own_count_is_taken(
        make_harness: MakeHarness) -> None:
    h = await continued(make_harness)
    decode = h.cluster.decodes[0]

    def reply(body: dict[str, Any]) -> httpx2.Response:
        return httpx2.Response(200, json={
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 64, "completion_tokens": 2},
            "kv_transfer_params": {"kvturn": {
                "retained": True, "engine_id": decode.engine_id, "num_tokens": 66,
                "expires_in": 480.0,
                "reuse": {"reason": "partial", "reused_tokens": 16, "local_tokens": 16}}}})

    decode.fail_next(reply)
    resp = await h.chat("c", messages=TURN2)
    assert (resp.headers["X-KVTurn-Reuse"], resp.headers["X-KVTurn-Reused-Tokens"]) == \
        ("partial", "16")


# Streamed: the headers go out before the decode computed anything.

async def test_a_continued_stream_says_pending_and_counts_the_truth_when_it_ends(
        make_harness: MakeHarness, caplog: pytest.LogCaptureFixture) -> None:
    h = await continued(make_harness)
    evict(h)
    with caplog.at_level(logging.DEBUG, logger="kvturn.router"):
        resp = await h.chat("c", messages=TURN2, stream=True)
    assert resp.headers["X-KVTurn-Route"] == "decode"
    assert (resp.headers["X-KVTurn-Reuse"], resp.headers["X-KVTurn-Reused-Tokens"],
            resp.headers["X-KVTurn-Block-Size"]) == ("pending", "0", "16")
    # The client did not ask for usage: its stream is the decode's without the usage event.
    assert resp.content == b"".join(DEFAULT_SSE)
    # Counted and logged once the stream ended, from the decode's usage.
    assert metric(h, "kvturn_router_reuse_total", outcome="pending") == 0
    assert metric(h, "kvturn_router_reuse_total", outcome="miss") == 2
    assert metric(h, "kvturn_router_routes_total", route="decode", choice="") == 1
    assert metric(h, "kvturn_router_continued_short_total") == 1
    (line,) = lines(caplog)
    assert (line["reuse"], line["reused_tokens"], line["cached_tokens"]) == ("miss", 0, 0)


async def test_a_client_that_asked_for_usage_reads_the_cached_tokens_itself(
        make_harness: MakeHarness) -> None:
    h = await continued(make_harness)
    resp = await h.chat("c", messages=TURN2, stream=True,
                        stream_options={"include_usage": True})
    assert resp.headers["X-KVTurn-Reuse"] == "pending"
    events = [_json.loads(e[len(b"data: "):]) for e in resp.content.split(b"\n\n")
              if e.startswith(b"data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert metric(h, "kvturn_router_reuse_total", outcome="hit") == 1
    assert metric(h, "kvturn_router_reused_tokens_total") == 48


async def test_a_continued_stream_broken_off_stays_pending(make_harness: MakeHarness) -> None:
    h = await continued(make_harness)
    h.cluster.decodes[0].fail_next(("break_after", 2))
    resp = await h.chat("c", messages=TURN2, stream=True)
    assert b"backend_stream_error" in resp.content
    assert metric(h, "kvturn_router_reuse_total", outcome="pending") == 1
    assert metric(h, "kvturn_router_requests_total", endpoint="chat",
                  outcome="stream_error") == 1


async def test_the_prefill_path_reports_as_before(make_harness: MakeHarness) -> None:
    """Only a continued turn's report comes from the decode's usage: a prefill leg's read is
    the prefill's own report, known before either answer."""
    h = await make_harness(Cluster())
    await h.chat("c")
    resp = await h.chat("c", stream=True)
    assert (resp.headers["X-KVTurn-Route"], resp.headers["X-KVTurn-Reuse"],
            resp.headers["X-KVTurn-Reused-Tokens"]) == ("prefill", "hit", "48")
    assert "X-KVTurn-Block-Size" not in resp.headers
    assert metric(h, "kvturn_router_reuse_total", outcome="hit") == 1


# Records that outlived the decode's KV.

async def test_a_reply_not_retained_keeps_the_decode_and_the_history_unretained(
        make_harness: MakeHarness) -> None:
    h = await continued(make_harness)
    decode = h.cluster.decodes[0]
    evict(h)
    decode.retain = False  # this turn's retention did not stay either (over the budget)
    resp = await h.chat("c", messages=TURN2)
    assert resp.headers["X-KVTurn-Reuse"] == "miss"
    record = await h.router.store.get(KEY)
    # As a stock router's record: the decode that served it and the turn's messages, no
    # retention (nothing to pin), the tokens the decode's usage counted.
    assert record is not None and not record.retained and record.cached_tokens == 0
    assert record.decode == decode.url and record.num_tokens > 0
    # So the next short turn still goes to that decode alone, whose plain prefix cache may
    # hold the conversation; its usage says what it found.
    resp = await h.chat("c", messages=[*TURN2, REPLY, TOOL])
    assert resp.headers["X-KVTurn-Route"] == "decode"
    assert not h.cluster.calls("decode0.control", "POST")  # no pin, ever


async def test_a_long_turn_over_an_unretained_record_takes_no_pin(
        make_harness: MakeHarness) -> None:
    h = await continued(make_harness)
    h.cluster.decodes[0].retain = False
    await h.chat("c", messages=TURN2)
    long = {"role": "user", "content": "word " * 5000}
    resp = await h.chat("c", messages=[*TURN2, REPLY, long])
    assert (resp.headers["X-KVTurn-Route"], resp.headers["X-KVTurn-Reuse"]) == \
        ("prefill", "miss")
    assert not h.cluster.calls("decode0.control", "POST")


async def test_a_keepalive_the_decode_answers_evicted_marks_the_record_lost(
        make_harness: MakeHarness) -> None:
    h = await continued(make_harness)
    evict(h)
    resp = await h.client.post("/kvturn/v1/conversations/c/keepalive")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "evicted"
    record = await h.router.store.get(KEY)
    assert record is not None and not record.retained and record.lost == "evicted"
    assert metric(h, "kvturn_router_stale_handles_total", reason="evicted") == 1
    # The next keepalive is answered by the router alone, saying why: nothing to renew.
    calls = len(h.cluster.calls("decode0.control"))
    resp = await h.client.post("/kvturn/v1/conversations/c/keepalive")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "evicted"
    assert len(h.cluster.calls("decode0.control")) == calls
    # Its blocks were freed, most likely for other requests: the next turn takes a prefill
    # (which may hold the prompt) rather than have the decode recompute the history; the
    # record kept the affinity. The report says why, as a pin that found it gone would.
    resp = await h.chat("c", messages=TURN2)
    assert (resp.headers["X-KVTurn-Route"], resp.headers["X-KVTurn-Reuse"]) == \
        ("prefill", "stale")
    assert metric(h, "kvturn_router_not_continued_total", why="lost") == 1


# The decodes' lost logs (router/_lost.py): a retention the decode dropped on its own.

async def _following(make_harness: MakeHarness) -> Harness:
    h = await continued(make_harness)
    assert h.router.lost is not None
    h.router.lost.start()
    return h


async def _until(check: Any, what: str) -> None:
    for _ in range(500):
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within 5 s: {what}")


async def test_a_retention_the_decode_evicted_is_marked_lost_and_not_continued(
        make_harness: MakeHarness) -> None:
    h = await _following(make_harness)
    decode = h.cluster.decodes[0]
    await _until(lambda: _polled(decode), "the follower's first poll")
    decode.lose(KEY)

    async def marked() -> bool:
        record = await h.router.store.get(KEY)
        return record is not None and record.lost is not None

    await _until(marked, "the record marked lost")
    assert metric(h, "kvturn_router_lost_entries_total", outcome="evicted") == 1
    # The next turn takes a prefill (no pin: nothing is retained) instead of having the
    # decode recompute the history; the record kept the affinity.
    resp = await h.chat("c", messages=TURN2)
    assert (resp.headers["X-KVTurn-Route"], resp.headers["X-KVTurn-Reuse"]) == \
        ("prefill", "stale")
    assert metric(h, "kvturn_router_not_continued_total", why="lost") == 1
    assert not h.cluster.calls("decode0.control", "POST")
    # Its capture recorded the new retention: the one after continues again.
    resp = await h.chat("c", messages=[*TURN2, REPLY, TOOL])
    assert resp.headers["X-KVTurn-Route"] == "decode"
    await h.router.lost.stop()  # type: ignore[union-attr]


async def _polled(decode: Any) -> bool:
    return bool(decode.lost_polls)


async def test_an_older_retention_under_the_same_key_leaves_the_record_alone(
        make_harness: MakeHarness) -> None:
    h = await _following(make_harness)
    decode = h.cluster.decodes[0]
    await _until(lambda: _polled(decode), "the follower's first poll")
    old = decode.retentions[KEY]
    await h.chat("c", messages=TURN2)  # a newer retention under the same key
    # The decode logs the older one as evicted (it went from the table before the newer
    # one replaced it, say): the record names the newer one, by its read id.
    decode.retentions[KEY], newer = old, decode.retentions[KEY]
    decode.lose(KEY)
    decode.retentions[KEY] = newer
    await _until(lambda: _counted(h, "unmatched"), "the entry read")
    record = await h.router.store.get(KEY)
    assert record is not None and record.retained and not record.lost
    await h.router.lost.stop()  # type: ignore[union-attr]


async def _counted(h: Harness, outcome: str) -> bool:
    return metric(h, "kvturn_router_lost_entries_total", outcome=outcome) >= 1


async def test_a_router_started_after_the_drops_reads_only_what_follows(
        make_harness: MakeHarness) -> None:
    h = await continued(make_harness)
    decode = h.cluster.decodes[0]
    decode.lose(KEY)  # before the follower's first answer: not for this router to mark
    assert h.router.lost is not None
    h.router.lost.start()
    await _until(lambda: _polled_twice(decode), "the follower's long poll")
    record = await h.router.store.get(KEY)
    assert record is not None and not record.lost
    await h.router.lost.stop()


async def _polled_twice(decode: Any) -> bool:
    return decode.lost_polls >= 2


async def test_no_follower_without_reuse_or_when_turned_off(make_harness: MakeHarness) -> None:
    assert (await make_harness(follow_evictions=False)).router.lost is None
    assert (await make_harness(kv_reuse=False)).router.lost is None


async def test_a_lost_reason_the_router_does_not_know_counts_as_evicted(
        make_harness: MakeHarness) -> None:
    # A decode's raw word goes into no record and no metric label (kvturn.wire.GoneReason).
    h = await _following(make_harness)
    decode = h.cluster.decodes[0]
    await _until(lambda: _polled(decode), "the follower's first poll")
    decode.lose(KEY, reason="melted")

    async def marked() -> bool:
        record = await h.router.store.get(KEY)
        return record is not None and record.lost is not None

    await _until(marked, "the record marked lost")
    record = await h.router.store.get(KEY)
    assert record is not None and record.lost == "evicted"
    assert metric(h, "kvturn_router_lost_entries_total", outcome="evicted") == 1
    await h.router.lost.stop()  # type: ignore[union-attr]


@pytest.mark.parametrize(("left", "route", "reuse"), [
    (None, "prefill", "stale"),  # the decode does not say: a prefill, as before
    (0, "prefill", "stale"),  # nothing left: the decode would recompute the history
    (32, "decode", "partial"),  # all of it left: the decode computes only the new part
])
async def test_a_gone_retention_s_turn_continues_when_the_decode_still_holds_its_history(
        make_harness: MakeHarness, left: int | None, route: str, reuse: str) -> None:
    # The record holds 32 tokens in full blocks and the follow-up adds about 72: continued
    # while the decode holds at least 14 of them.
    h = await make_harness(Cluster(), decode_continue_tokens=90)
    decode = h.cluster.decodes[0]
    await h.chat("c", messages=[U1])
    evict(h)
    resp = await h.client.post("/kvturn/v1/conversations/c/keepalive")
    assert resp.json()["error"]["code"] == "evicted"  # the record is marked lost
    if left is not None:
        decode.left_cached[KEY] = left
    describes = len(h.cluster.calls("decode0.control", "GET"))
    resp = await h.chat("c", messages=TURN2)
    # One describe asked what the prefix cache kept; the turn went where that says.
    assert len(h.cluster.calls("decode0.control", "GET")) == describes + 1
    assert (resp.headers["X-KVTurn-Route"], resp.headers["X-KVTurn-Reuse"]) == (route, reuse)
    assert metric(h, "kvturn_router_not_continued_total", why="lost") == (route == "prefill")
    if route == "decode":
        assert resp.headers["X-KVTurn-Reused-Tokens"] == "32"
