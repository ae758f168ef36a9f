"""The turn planner (``router/_plan.py``): each decision from typed facts, with no I/O and no
change to the backends it reads. The router executing the decisions is tested over fake
backends (``test_router_turn.py``, ``test_router_placement.py``), and the simulator deciding
alike in ``tests/server/sim/test_sim_same_turns.py``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvturn.wire import GoneReason, gone_reason
from kvturn_server.router import (
    NO_PIN,
    Backend,
    DecodeUsage,
    Placement,
    ReuseReport,
    RoutePlan,
    RouterConfig,
    Transcript,
    TurnPath,
    TurnPolicy,
    lost_record,
    marked_lost,
    moved_from,
    pin_gone,
    plan_host_route,
    plan_pin,
    plan_probe,
    plan_route,
    recorded_prefill,
    refuse_pin,
    settle_continued,
    settle_prefill,
)
from kvturn_server.router._plan import gave_up_reason, plan_retry

KVTURN = TurnPolicy(reuse=True, retain=True, decode_continue_tokens=512,
                    decode_continue_budget=1024, decode_continue_host_tokens=4096,
                    min_read_tokens=1)
STOCK_COND = TurnPolicy(reuse=False, retain=False, conditional_disagg=512)
STOCK_PD = TurnPolicy(reuse=False, retain=False)
NOW = 1000.0

HISTORY = [{"role": "user", "content": "a" * 400}]
SHORT = [*HISTORY, {"role": "assistant", "content": "b" * 100},
         {"role": "user", "content": "c" * 50}]
LONG = [*HISTORY, {"role": "assistant", "content": "b" * 100},
        {"role": "user", "content": "c" * 4000}]


def _record(**kw: Any) -> Placement:
    fields: dict[str, Any] = {
        "decode": "http://d0", "engine_id": None, "num_tokens": 512,
        "expires_at": NOW + 100, "turn": "r1", "readable_tokens": 512, "block_size": 64,
        "prefill": "http://p0", "prefill_tokens": 384,
        "history": Transcript(HISTORY).history()}
    return Placement(**{**fields, **kw})


def _decode() -> Backend:
    return Backend("decode", "http://d0", control_url="http://d0c")


def _state(backend: Backend) -> tuple[Any, ...]:
    return tuple(getattr(backend, name) for name in Backend.__slots__)


def test_the_policy_is_the_routers_settings() -> None:
    config = RouterConfig(prefill=("http://p0",), decode=("http://d0",))
    policy = TurnPolicy.of(config)
    assert policy == TurnPolicy(reuse=True, retain=True, conditional_disagg=0,
                                decode_continue_tokens=config.decode_continue_tokens,
                                decode_continue_budget=config.decode_continue_budget,
                                decode_continue_host_tokens=config.decode_continue_host_tokens,
                                min_read_tokens=config.min_read_tokens)
    # A client's opt-out stops reuse, not the retention its turn leaves.
    opted_out = TurnPolicy.of(config, no_reuse=True)
    assert not opted_out.reuse and opted_out.retain and opted_out.reads_transcript
    assert STOCK_COND.reads_transcript and not STOCK_PD.reads_transcript


def test_a_turn_without_a_record_takes_the_prefill_path() -> None:
    assert plan_route(KVTURN, placement=None, holder=None, transcript=None,
                      now=NOW).where is TurnPath.PREFILL
    stock = plan_route(STOCK_PD, placement=_record(), holder=_decode(),
                       transcript=Transcript(SHORT), now=NOW)
    assert (stock.where, stock.reason, stock.not_continued) == (TurnPath.PREFILL, "disabled", None)


def test_a_short_follow_up_is_continued_by_the_holder() -> None:
    holder = _decode()
    before = _state(holder)
    plan = plan_route(KVTURN, placement=_record(), holder=holder,
                      transcript=Transcript(SHORT), now=NOW)
    assert plan.where is TurnPath.CONTINUE and plan.where.route == "decode"
    assert 0 < plan.estimate <= 512 and plan.reason is None
    assert plan.fallback_reason == "miss"
    assert _state(holder) == before  # the executor holds the budget, not the planner


@pytest.mark.parametrize(("placement", "transcript", "busy", "why"), [
    (_record(), LONG, 0, "too_long"),
    (_record(lost="evicted", retained=False), SHORT, 0, "lost"),
    (_record(expires_at=NOW), SHORT, 0, "expired"),
    (_record(), SHORT, 1024, "busy"),
    (_record(history=None), SHORT, 0, "no_history"),
])
def test_why_the_holder_does_not_continue(placement: Placement, transcript: list[Any],
                                          busy: int, why: str) -> None:
    holder = _decode()
    holder.continuing = busy
    plan = plan_route(KVTURN, placement=placement, holder=holder,
                      transcript=Transcript(transcript), now=NOW)
    assert (plan.where, plan.not_continued, plan.reason) == (TurnPath.PREFILL, why, None)


def test_a_long_turn_continues_where_the_host_tier_alone_holds_the_history() -> None:
    def route(policy: TurnPolicy = KVTURN, *, host: int = 512, busy: int = 0,
              transcript: list[Any] = LONG, **record: Any) -> RoutePlan | None:
        holder = _decode()
        holder.continuing = busy
        return plan_host_route(policy, placement=_record(**record), holder=holder,
                               transcript=Transcript(transcript), host_tokens=host)

    # Too long to continue from the device's threshold, a prefill would recompute it all.
    assert plan_route(KVTURN, placement=_record(), holder=_decode(),
                      transcript=Transcript(LONG), now=NOW).not_continued == "too_long"
    whole = route()
    assert whole is not None and whole.where is TurnPath.CONTINUE
    assert 512 < whole.estimate <= 4096
    # Failing before its first byte, it reports what the prefill path would: nothing readable.
    assert whole.fallback_reason == "stale"
    # History the host tier no longer holds is computed on the decode too.
    partial = route(host=256)
    assert partial is not None and partial.estimate == whole.estimate + 256
    assert route(busy=4096 - whole.estimate) == whole
    assert route(busy=4096 - whole.estimate + 1) is None  # past the cap with the others
    assert route(host=0) is None  # nothing left there: a prefill recomputes
    assert route(replace(KVTURN, decode_continue_host_tokens=0)) is None  # off
    assert route(replace(KVTURN, decode_continue_host_tokens=whole.estimate - 1)) is None
    assert route(replace(KVTURN, reuse=False)) is None  # the client opted out
    assert route(replace(KVTURN, decode_continue_tokens=0)) is None  # no continuation at all
    assert route(history=None) is None


GONE = [_record(lost="evicted", retained=False), _record(lost="expired", retained=False),
        _record(expires_at=NOW)]


@pytest.mark.parametrize("placement", GONE)
def test_a_retention_known_gone_is_probed_only_for_a_turn_that_would_continue(
        placement: Placement) -> None:
    def probe(policy: TurnPolicy, record: Placement, transcript: list[Any]) -> bool:
        return plan_probe(policy, placement=record, holder=_decode(),
                          transcript=Transcript(transcript), now=NOW)

    assert probe(KVTURN, placement, SHORT)
    assert not probe(KVTURN, placement, LONG)  # a prefill anyway
    assert not probe(STOCK_COND, placement, SHORT)  # stock asks nothing
    assert not probe(KVTURN, _record(), SHORT)  # held under its lease
    assert not probe(KVTURN, _record(retained=False), SHORT)  # never retained: continued


@pytest.mark.parametrize("placement", GONE)
def test_a_retention_known_gone_continues_when_the_decode_holds_enough_of_it(
        placement: Placement) -> None:
    def route(held: int | None) -> tuple[TurnPath, str | None, int]:
        plan = plan_route(KVTURN, placement=placement, holder=_decode(),
                          transcript=Transcript(SHORT), now=NOW, held=held)
        return plan.where, plan.not_continued, plan.estimate

    why = "lost" if placement.lost else "expired"
    where, _, whole = route(512)  # all of it: only the new tokens to compute
    assert where is TurnPath.CONTINUE and 0 < whole <= 512
    # What it lost is computed too, up to the threshold.
    assert route(whole) == (TurnPath.CONTINUE, None, 512)
    assert route(whole - 1) == (TurnPath.PREFILL, why, 0)
    assert route(0) == (TurnPath.PREFILL, why, 0)
    assert route(None) == (TurnPath.PREFILL, why, 0)  # the decode could not say


def test_the_history_s_partial_last_block_is_not_counted_as_lost() -> None:
    # It is computed on every continued turn: what the decode kept is measured against the
    # full blocks a live retention would have supplied.
    for record in (_record(lost="evicted", num_tokens=540, readable_tokens=None),
                   _record(lost="evicted", num_tokens=540, readable_tokens=512)):
        kept = plan_route(KVTURN, placement=record, holder=_decode(),
                          transcript=Transcript(SHORT), now=NOW, held=512)
        live = plan_route(KVTURN, placement=replace(record, lost=None), holder=_decode(),
                          transcript=Transcript(SHORT), now=NOW)
        assert kept.where is TurnPath.CONTINUE and kept.estimate == live.estimate


def test_stock_conditional_disaggregation_runs_short_follow_ups_decode_only() -> None:
    record = _record(retained=False, readable_tokens=None, block_size=0)
    short = plan_route(STOCK_COND, placement=record, holder=_decode(),
                       transcript=Transcript(SHORT), now=NOW)
    assert (short.where, short.reason, short.estimate) == (TurnPath.DECODE_ONLY, "disabled", 0)
    assert short.where.route == "decode" and short.fallback_reason is None
    long = plan_route(STOCK_COND, placement=record, holder=_decode(),
                      transcript=Transcript(LONG), now=NOW)
    assert (long.where, long.not_continued) == (TurnPath.PREFILL, "too_long")


def test_a_pin_is_taken_for_what_the_prefill_lacks() -> None:
    prefill = Backend("prefill", "http://p0")
    before = _state(prefill)
    # The retention holds 512 tokens, the prefill its last prompt's 384: 128 to read.
    assert plan_pin(KVTURN, placement=_record(), holder=_decode(), prefill=prefill,
                    now=NOW).pin
    other = Backend("prefill", "http://p1")
    assert plan_pin(KVTURN, placement=_record(), holder=_decode(), prefill=other, now=NOW).pin
    assert _state(prefill) == before


@pytest.mark.parametrize(("policy", "placement", "expected"), [
    (STOCK_PD, _record(), NO_PIN),
    (KVTURN, _record(retained=False), NO_PIN),
    (KVTURN, _record(retained=False, lost="expired"), (False, False, "expired")),
    (KVTURN, _record(retained=False, lost="evicted"), (False, False, "stale")),
    (replace(KVTURN, min_read_tokens=200), _record(), (False, False, "below-threshold")),
    # The prefill holds every full block the retention has: its own cache's coverage.
    (KVTURN, _record(prefill_tokens=540), (False, True, "below-threshold")),
])
def test_no_pin_and_what_the_turn_reports(policy: TurnPolicy, placement: Placement,
                                          expected: Any) -> None:
    plan = plan_pin(policy, placement=placement, holder=_decode(),
                    prefill=Backend("prefill", "http://p0"), now=NOW)
    assert plan == expected if expected is NO_PIN \
        else (plan.pin, plan.skipped, plan.reason) == expected


def test_a_pin_for_no_more_than_the_prefill_declined_is_not_taken() -> None:
    prefill = Backend("prefill", "http://p1")
    prefill.read_floor, prefill.read_floor_at = 512, NOW - 1
    plan = plan_pin(KVTURN, placement=_record(), holder=_decode(), prefill=prefill, now=NOW)
    assert (plan.pin, plan.reason) == (False, "below-threshold")
    # The floor is forgotten after a minute: the prefill's cost model may have changed.
    assert plan_pin(KVTURN, placement=_record(), holder=_decode(), prefill=prefill,
                    now=NOW + 61).pin


def test_a_pin_refused_before_or_by_the_decode() -> None:
    holder = _decode()
    assert refuse_pin(_record(), holder) is None
    holder.control_ok = False
    refused = refuse_pin(_record(), holder)
    assert refused is not None and (refused.reason, refused.drop) == ("stale", None)
    restarted = _decode()
    restarted.engine_id = "e2"
    refused = refuse_pin(_record(engine_id="e1"), restarted)
    assert refused is not None and (refused.reason, refused.drop) == ("stale", "engine_changed")
    assert [(g.reason, g.drop) for g in map(pin_gone, (
        GoneReason.EXPIRED, GoneReason.RELEASED, GoneReason.REPLACED, GoneReason.EVICTED,
        GoneReason.NO_RETENTION, gone_reason("odd")))] == [
        ("expired", "expired"), ("miss", "released"), ("miss", "replaced"),
        ("stale", "evicted"), ("stale", "no_retention"), ("stale", "no_retention")]


def test_a_failed_prefill_leg_is_retried_once() -> None:
    first, other = Backend("prefill", "http://p0"), Backend("prefill", "http://p1")
    retry = plan_retry("status", first, other, pinned=True)
    assert (retry.on, retry.keep_pin, retry.repin) == (other, False, False)
    # A timed-out prefill may still be reading under its pin: a new pin for the next one.
    retry = plan_retry("timeout", first, other, pinned=True)
    assert (retry.on, retry.keep_pin, retry.repin) == (other, True, True)
    # The only prefill, never reached, may take it again; one that answered badly not.
    assert plan_retry("connect", first, None, pinned=False).on is first
    assert plan_retry("status", first, None, pinned=False).on is None
    assert (gave_up_reason(True), gave_up_reason(False)) == ("stale", None)


def test_the_reuse_value_after_the_prefill_leg() -> None:
    read = ReuseReport("partial", 256, 128)
    settled = settle_prefill(read, read_offered=True, pin_skipped=False, prompt_tokens=600,
                             block_size=64)
    assert settled is not None and (settled.reason, settled.reused_tokens) == ("partial", 256)
    assert settled.learn is read
    missing = settle_prefill(None, read_offered=True, pin_skipped=False, prompt_tokens=600,
                             block_size=64)
    assert missing is not None and (missing.reason, missing.learn) == ("miss", None)
    own = ReuseReport("miss", 0, 576)
    skipped = settle_prefill(own, read_offered=False, pin_skipped=True, prompt_tokens=600,
                             block_size=64)
    assert skipped is not None and (skipped.reason, skipped.reused_tokens) == ("hit", 0)
    assert settle_prefill(own, read_offered=False, pin_skipped=False, prompt_tokens=600,
                          block_size=64) is None


def test_the_reuse_value_of_a_continued_turn_is_its_caches_coverage() -> None:
    def value(cached: int | None, block_size: int = 64) -> str | None:
        found = settle_continued(DecodeUsage(600, 10, cached), None, block_size)
        return None if found is None else found.reason
    assert [value(576), value(300), value(0), value(576, 0), value(None)] == [
        "hit", "partial", "miss", "partial", None]


def test_what_the_record_says_and_what_is_released() -> None:
    old = _record()
    assert recorded_prefill(old, "http://p1", 900) == ("http://p1", 900)
    assert recorded_prefill(old, None, 0) == ("http://p0", 384)  # the decode ran it alone
    assert recorded_prefill(None, None, 0) == (None, 0)
    assert moved_from(old, "http://d1") == "http://d0"
    assert moved_from(old, "http://d0") is None and moved_from(None, "http://d0") is None


def test_a_keepalive_that_finds_the_retention_gone() -> None:
    for code in ("expired", "evicted", "no_retention"):
        kept = lost_record(_record(), code)
        assert kept is not None and (kept.retained, kept.lost) == (False, code)
    assert lost_record(_record(), "released") is None
    assert lost_record(_record(), "replaced") is None


def test_a_lost_log_entry_marks_only_the_retention_the_record_names() -> None:
    record = _record(read_id="kvturn-read/r1")
    marked = marked_lost(record, decode="http://d0", read_id="kvturn-read/r1",
                         reason=GoneReason.EVICTED)
    assert marked == replace(record, retained=False, lost="evicted")
    for other in ({"decode": "http://d1"}, {"read_id": "kvturn-read/r2"}):
        entry: dict[str, Any] = {"decode": "http://d0", "read_id": "kvturn-read/r1", **other}
        assert marked_lost(record, reason=GoneReason.EXPIRED, **entry) is None
    assert marked_lost(marked, decode="http://d0", read_id="kvturn-read/r1",
                       reason=GoneReason.EXPIRED) is None  # known not to be retained
    assert marked_lost(None, decode="http://d0", read_id="kvturn-read/r1",
                       reason=GoneReason.EXPIRED) is None
