"""RetentionKeeper: the retention table carried out on vLLM's block pool, across threads.

The pool is :class:`~tests.fakes.keeper.FakeBlockPool`, which keeps vLLM's reference
counts and raises on a double free; requests go through it the way they do on a decode (the
request holds its blocks, the connector retains them at finish, vLLM then frees the request's
own references), so a retention's blocks end at reference count 1 while held and 0 once freed.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvturn.wire import GoneReason
from kvturn_server.connector._hashing import block_hashes
from kvturn_server.connector._keeper import RetentionKeeper
from kvturn_server.connector._lease import Gone
from kvturn_server.connector._params import read_params
from kvturn_server.connector._tiers import Standing
from tests.fakes.keeper import (
    BS,
    FakeBlockPool,
    FakeClock,
    FakeHostTier,
    coordinates,
    finish,
    make_keeper,
    tokens,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pool() -> FakeBlockPool:
    pool = FakeBlockPool(33)  # 32 usable blocks (block 0 is the null block)
    pool.owner = threading.get_ident()  # this test's thread plays the engine thread
    return pool


@pytest.fixture
def keeper(pool: FakeBlockPool, clock: FakeClock) -> RetentionKeeper:
    return make_keeper(pool, clock, ttl=60.0, max_hold=600.0, max_pin=30.0)


def in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on another thread (a control request) and return its result."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "control call did not return"
    if errors:
        raise errors[0]
    return out[0]


def why(answer: object) -> tuple[str, GoneReason] | None:
    """A describe's Gone as (key, reason), whatever it says is still cached; None: live."""
    return (answer.key, answer.reason) if isinstance(answer, Gone) else None


def all_free(pool: FakeBlockPool) -> bool:
    return pool.refs() == [0] * pool.usable and pool.get_num_free_blocks() == pool.usable


# Holding: what a retention keeps.


@pytest.mark.parametrize(("num_computed", "num_blocks", "kept_blocks"), [
    (14, 4, 3),  # 3 full blocks and a partial one
    (12, 4, 3),  # exactly 3 blocks computed; the 4th holds only the final sampled token
    (16, 4, 4),
    (40, 4, 4),  # never more blocks than the request had
])
def test_retain_holds_exactly_the_full_blocks_of_the_computed_tokens(
        pool: FakeBlockPool, keeper: RetentionKeeper, num_computed: int, num_blocks: int,
        kept_blocks: int) -> None:
    token_ids = tokens(num_computed + 1)
    ids, kept = finish(pool, keeper, "k", "r1", num_blocks, num_tokens=num_computed,
                       token_ids=token_ids)
    assert kept is not None
    assert kept.block_ids == tuple(ids[:kept_blocks])
    assert pool.refs(ids) == [1] * kept_blocks + [0] * (num_blocks - kept_blocks)
    assert kept.num_tokens == kept_blocks * BS
    assert kept.block_hashes == tuple(block_hashes(token_ids[:kept_blocks * BS], BS))


def test_retain_without_a_full_block_keeps_nothing_and_takes_no_reference(
        pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    ids, kept = finish(pool, keeper, "k", "r1", 1, num_tokens=BS - 1)
    assert kept is None
    assert pool.refs(ids) == [0]
    assert keeper.take_events() == []
    assert why(keeper.describe("k")) == ("k", GoneReason.NO_RETENTION)


def test_a_keys_next_turn_replaces_the_previous_retention_and_balances_shared_blocks(
        pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    first, _ = finish(pool, keeper, "k", "r1", 3)
    # The next turn hits the previous turn's blocks in the prefix cache and adds two.
    second, kept = finish(pool, keeper, "k", "r2", 2, shared=first)
    assert kept is not None and kept.request_id == "r2"
    assert kept.block_ids == tuple(second)
    assert pool.refs(second) == [1] * 5  # held once, by the new retention only
    assert pool.get_num_free_blocks() == pool.usable - 5
    assert keeper.take_events() == ["created", "created", "replaced"]

    assert keeper.release("k") is True
    keeper.service()
    assert all_free(pool)


def test_a_keys_next_turn_in_other_blocks_frees_the_previous_retentions_blocks(
        pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    first, _ = finish(pool, keeper, "k", "r1", 3)
    second, _ = finish(pool, keeper, "k", "r2", 2)
    assert pool.refs(first) == [0, 0, 0]
    assert pool.refs(second) == [1, 1]
    view = keeper.describe("k")
    assert isinstance(view, dict)
    assert view["params"]["remote_request_id"] == "kvturn-read/r2"


def test_a_retention_larger_than_the_budget_is_refused_and_its_blocks_freed_at_once(
        clock: FakeClock) -> None:
    pool = FakeBlockPool(9)  # 8 usable, half of them for retention
    keeper = make_keeper(pool, clock, budget=0.5)
    finish(pool, keeper, "k", "r1", 2)
    _, kept = finish(pool, keeper, "k", "r2", 5)
    assert kept is None
    assert all_free(pool)  # the refused turn and the turn it replaced are both freed
    assert keeper.take_events() == ["created", "replaced", "refused"]
    assert why(keeper.describe("k")) == ("k", GoneReason.EVICTED)


def test_frees_a_retentions_tail_blocks_first(pool: FakeBlockPool,
                                              keeper: RetentionKeeper) -> None:
    ids, _ = finish(pool, keeper, "k", "r1", 3)
    keeper.release("k")
    keeper.service()
    assert pool.freed[-1] == ids[::-1]


def test_block_ids_outside_the_pool_raise_and_leave_reference_counts_untouched(
        pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    for bad in ([0, 1, 2], [1, 2, pool.num_gpu_blocks], [-1, 1, 2]):
        with pytest.raises(ValueError, match="outside the pool"):
            keeper.retain("k", "r1", bad, tokens(13), 12)
    assert all_free(pool)
    assert keeper.take_events() == []
    assert why(keeper.describe("k")) == ("k", GoneReason.NO_RETENTION)


def test_a_failure_inside_the_table_undoes_the_hold(
        pool: FakeBlockPool, keeper: RetentionKeeper, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="more than once"):
        keeper.retain("k", "r1", [1, 1, 2], tokens(13), 12)  # the table refuses repeats
    assert all_free(pool)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("table bug")

    assert keeper._table is not None
    monkeypatch.setattr(keeper._table, "retain", broken)
    with pytest.raises(RuntimeError, match="table bug"):
        keeper.retain("k", "r2", [1, 2, 3], tokens(13), 12)
    assert all_free(pool)
    assert keeper.take_events() == []


def test_an_unbound_or_zero_budget_keeper_retains_nothing(pool: FakeBlockPool,
                                                          clock: FakeClock) -> None:
    unbound = make_keeper(None, clock)
    assert not unbound.bound
    assert unbound.retain("k", "r1", [1, 2], tokens(9), 8) is None
    unbound.service()
    assert (unbound.due(), unbound.has_pins(), unbound.relieve()) == (False, False, False)
    assert unbound.make_room(10) == 0
    assert unbound.gauges() == (0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="not bound"):
        unbound.describe("k")

    zero = make_keeper(pool, clock, budget=0.0)
    _, kept = finish(pool, zero, "k", "r1", 2)
    assert kept is None
    assert all_free(pool)


# Control answers: views and Gone reasons.


def test_describe_gives_the_retentions_view(clock: FakeClock, pool: FakeBlockPool,
                                            keeper: RetentionKeeper) -> None:
    _, kept = finish(pool, keeper, "tenant/conv:1", "r1", 3)
    assert kept is not None
    clock.advance(10)
    view = keeper.describe("tenant/conv:1")
    assert view == {
        "key": "tenant/conv:1", "engine_id": "decode-engine",
        "params": read_params(coordinates(), kept, kept.expires_at),
        "num_tokens": 12, "num_blocks": 3,
        "expires_in": 50.0, "hold_remaining": 590.0, "created_ago": 10.0,
        "where": "device", "host_tokens": 0,
    }


def test_pin_publishes_the_pins_end_as_the_read_deadline(
        clock: FakeClock, pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    finish(pool, keeper, "k", "r1", 3)
    view = keeper.pin("k", 5)
    assert isinstance(view, dict)
    assert view["pin_id"]
    assert view["pin_expires_in"] == 5.0
    assert view["params"]["remote_blocks_expiry_time"] == clock.now + 5
    assert view["expires_in"] == 60.0  # the lease itself is unchanged
    capped = keeper.pin("k", 1000)
    assert isinstance(capped, dict)
    assert capped["pin_expires_in"] == 30.0  # max_pin
    assert capped["pin_id"] != view["pin_id"]


def test_keepalive_extends_the_lease_up_to_the_hold_cap(clock: FakeClock,
                                                        pool: FakeBlockPool) -> None:
    keeper = make_keeper(pool, clock, ttl=60.0, max_hold=100.0)
    finish(pool, keeper, "k", "r1", 2)
    clock.advance(40)
    view = keeper.keepalive("k")
    assert isinstance(view, dict)
    assert view["expires_in"] == 60.0
    clock.advance(30)
    view = keeper.keepalive("k")
    assert isinstance(view, dict)
    assert view["expires_in"] == 30.0  # created + max_hold
    assert view["hold_remaining"] == 30.0


def _released(keeper: RetentionKeeper, clock: FakeClock) -> None:
    keeper.release("k")


def _expired(keeper: RetentionKeeper, clock: FakeClock) -> None:
    clock.advance(60)


def _expired_and_serviced(keeper: RetentionKeeper, clock: FakeClock) -> None:
    clock.advance(60)
    keeper.service()


def _evicted(keeper: RetentionKeeper, clock: FakeClock) -> None:
    assert keeper.relieve()


_GONE = [(_released, GoneReason.RELEASED), (_expired, GoneReason.EXPIRED),
         (_expired_and_serviced, GoneReason.EXPIRED), (_evicted, GoneReason.EVICTED)]


@pytest.mark.parametrize(("op", "gone", "reason"), [
    pytest.param(op, gone, reason, id=f"{op}-{gone.__name__.strip('_')}")
    for op in ("describe", "pin", "keepalive", "release") for gone, reason in _GONE
    # Releasing an expired retention not yet handed back is a real release (next test).
    if not (op == "release" and gone is _expired)])
def test_control_calls_on_a_gone_retention_say_why(
        clock: FakeClock, pool: FakeBlockPool, keeper: RetentionKeeper, op: str,
        gone: Callable[[RetentionKeeper, FakeClock], None], reason: GoneReason) -> None:
    finish(pool, keeper, "k", "r1", 2)
    gone(keeper, clock)
    calls: dict[str, Callable[[], Any]] = {
        "describe": lambda: keeper.describe("k"), "pin": lambda: keeper.pin("k", 5),
        "keepalive": lambda: keeper.keepalive("k"), "release": lambda: keeper.release("k"),
    }
    answer = calls[op]()
    assert isinstance(answer, Gone) and (answer.key, answer.reason) == ("k", reason)


@pytest.mark.parametrize("gone", [_released, _expired_and_serviced, _evicted])
def test_a_describe_says_what_a_dropped_retention_left_in_the_prefix_cache(
        clock: FakeClock, pool: FakeBlockPool, keeper: RetentionKeeper,
        gone: Callable[[RetentionKeeper, FakeClock], None]) -> None:
    ids, kept = finish(pool, keeper, "k", "r1", 4)
    assert kept is not None and kept.num_tokens == 4 * BS
    gone(keeper, clock)
    keeper.service()  # (a release's blocks are freed on the engine thread)
    answer = keeper.describe("k")
    assert isinstance(answer, Gone) and answer.cached_tokens == 4 * BS  # only freed
    # An allocation took the third block for new content: the history's run stops there.
    pool.blocks[ids[2]].block_hash = ("other",)
    answer = keeper.describe("k")
    assert isinstance(answer, Gone) and answer.cached_tokens == 2 * BS
    pool.blocks[ids[0]].block_hash = None
    answer = keeper.describe("k")
    assert isinstance(answer, Gone) and answer.cached_tokens == 0
    # Retained again: the old blocks say nothing of it any more.
    finish(pool, keeper, "k", "r2", 2)
    assert not isinstance(keeper.describe("k"), Gone)
    keeper.release("k")
    keeper.service()
    answer = keeper.describe("k")
    assert isinstance(answer, Gone) and answer.cached_tokens == 2 * BS


def test_a_describe_of_a_key_never_dropped_here_knows_nothing_cached(
        keeper: RetentionKeeper) -> None:
    answer = keeper.describe("never")
    assert isinstance(answer, Gone) and answer.cached_tokens is None


def test_a_lapsed_lease_not_yet_handed_back_still_holds_all_of_its_history(
        clock: FakeClock, pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    finish(pool, keeper, "k", "r1", 2)
    clock.advance(60)  # expired, not yet handed back: its blocks are still held
    answer = keeper.describe("k")
    assert why(answer) == ("k", GoneReason.EXPIRED)
    assert isinstance(answer, Gone) and answer.cached_tokens == 2 * BS


def test_releasing_an_expired_retention_not_yet_freed_releases_its_blocks(
        clock: FakeClock, pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    finish(pool, keeper, "k", "r1", 2)
    clock.advance(60)
    assert keeper.release("k") is True
    keeper.service()
    assert all_free(pool)
    assert keeper.take_events() == ["created", "released"]


@pytest.mark.parametrize("op", ["describe", "pin", "keepalive", "release"])
def test_control_calls_on_an_unknown_key_say_no_retention(keeper: RetentionKeeper,
                                                          op: str) -> None:
    calls: dict[str, Callable[[str], Any]] = {
        "describe": keeper.describe, "keepalive": keeper.keepalive, "release": keeper.release,
        "pin": lambda k: keeper.pin(k, 5)}
    result = calls[op]("nope")
    assert result == Gone("nope", GoneReason.NO_RETENTION)


def test_stats_and_gauges_count_draining_blocks_as_held(pool: FakeBlockPool,
                                                        keeper: RetentionKeeper) -> None:
    finish(pool, keeper, "a", "r1", 4)
    finish(pool, keeper, "b", "r2", 2)
    assert isinstance(keeper.pin("b", 5), dict)
    keeper.release("b")  # pinned: leaves the table, blocks drain
    stats = keeper.stats()
    assert stats == {
        "engine_id": "decode-engine", "retentions": 1, "retained_blocks": 4,
        "held_blocks": 6, "held_bytes": 6 * 1024, "budget_blocks": 32, "pins": 1,
        "host_only": 0,
        "events": {"created": 2, "renewed": 0, "released": 1, "expired": 0, "evicted": 0,
                   "replaced": 0, "refused": 0, "pinned": 1, "host_evicted": 0,
                   "host_pinned": 0},
    }
    assert keeper.gauges() == (1, 6, 6 * 1024, 0)


# Threads: control calls change the table; only the engine thread frees.


def test_a_release_from_another_thread_only_queues_the_free_and_wakes_the_engine(
        pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    wakes: list[str] = []
    keeper.set_waker(lambda: wakes.append(threading.current_thread().name))
    ids, _ = finish(pool, keeper, "k", "r1", 3)
    assert in_thread(lambda: keeper.release("k")) is True
    assert pool.refs(ids) == [1, 1, 1]  # the control thread never touched the pool
    assert len(wakes) == 1
    assert keeper.due()
    keeper.service()
    assert all_free(pool)
    assert not keeper.due()


def test_an_unpin_from_another_thread_queues_the_drained_blocks_and_wakes_the_engine(
        pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    wakes: list[int] = []
    keeper.set_waker(lambda: wakes.append(1))
    ids, _ = finish(pool, keeper, "k", "r1", 3)
    view = in_thread(lambda: keeper.pin("k", 10))
    assert isinstance(view, dict)
    assert len(wakes) == 1  # a pin is a new deadline
    assert in_thread(lambda: keeper.release("k")) is True
    assert len(wakes) == 1  # pinned: nothing to free yet
    keeper.service()
    assert pool.refs(ids) == [1, 1, 1]

    assert in_thread(lambda: keeper.unpin(view["pin_id"])) is True
    assert len(wakes) == 2
    assert pool.refs(ids) == [1, 1, 1]
    assert keeper.due()
    keeper.service()
    assert all_free(pool)


def test_unpinning_a_retention_still_in_the_table_frees_nothing_and_does_not_wake(
        pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    wakes: list[int] = []
    finish(pool, keeper, "k", "r1", 3)
    view = keeper.pin("k", 10)
    assert isinstance(view, dict)
    keeper.set_waker(lambda: wakes.append(1))
    assert keeper.unpin(view["pin_id"]) is True
    assert keeper.unpin(view["pin_id"]) is False
    assert keeper.unpin("pin-unknown") is False
    assert wakes == []
    assert not keeper.due()


# Expiry and pins, driven by service().


def test_an_expired_retention_is_freed_by_service_once_the_clock_passes(
        clock: FakeClock, pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    ids, _ = finish(pool, keeper, "k", "r1", 3)
    clock.advance(59.9)
    assert not keeper.due()
    keeper.service()
    assert pool.refs(ids) == [1, 1, 1]
    clock.advance(0.1)
    assert keeper.due()
    assert pool.refs(ids) == [1, 1, 1]  # nothing frees by itself
    keeper.service()
    assert all_free(pool)
    assert keeper.take_events() == ["created", "expired"]
    assert not keeper.due()


@pytest.mark.parametrize("drop", ["release", "replace", "expire"])
def test_a_pinned_retention_keeps_its_blocks_until_unpinned(
        clock: FakeClock, pool: FakeBlockPool, drop: str) -> None:
    keeper = make_keeper(pool, clock, ttl=10.0, max_pin=30.0)
    ids, _ = finish(pool, keeper, "k", "r1", 3)
    view = keeper.pin("k", 30)
    assert isinstance(view, dict)
    if drop == "release":
        keeper.release("k")
    elif drop == "replace":
        finish(pool, keeper, "k", "r2", 2)
    else:
        clock.advance(10)
    keeper.service()
    assert keeper.stats()["retained_blocks"] == (2 if drop == "replace" else 0)
    assert pool.refs(ids) == [1, 1, 1]
    assert keeper.has_pins()
    assert keeper.unpin(view["pin_id"])
    keeper.service()
    assert pool.refs(ids) == [0, 0, 0]


def test_a_pinned_retention_that_expires_drains_until_its_pin_lapses(
        clock: FakeClock, pool: FakeBlockPool) -> None:
    keeper = make_keeper(pool, clock, ttl=10.0, max_pin=30.0)
    ids, _ = finish(pool, keeper, "k", "r1", 3)
    assert isinstance(keeper.pin("k", 30), dict)
    clock.advance(10)
    assert keeper.due()
    keeper.service()
    assert why(keeper.describe("k")) == ("k", GoneReason.EXPIRED)
    assert pool.refs(ids) == [1, 1, 1]  # draining: the pin still holds the blocks
    assert keeper.has_pins()
    assert not keeper.due()
    clock.advance(20)
    assert keeper.due()
    keeper.service()
    assert all_free(pool)
    assert not keeper.has_pins()


def test_due_is_true_exactly_when_service_has_work(
        clock: FakeClock, pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    assert not keeper.due()
    finish(pool, keeper, "a", "r1", 1)
    finish(pool, keeper, "b", "r2", 1)
    assert not keeper.due()
    keeper.release("a")
    assert keeper.due()  # a queued free
    keeper.service()
    assert not keeper.due()
    view = keeper.pin("b", 5)
    assert isinstance(view, dict)
    clock.advance(5)
    assert keeper.due()  # a lapsed pin
    keeper.service()
    assert not keeper.due()
    clock.advance(55)
    assert keeper.due()  # an expired lease
    keeper.service()
    assert not keeper.due()
    assert all_free(pool)


def test_has_pins_follows_pins_taken_dropped_and_lapsed(
        clock: FakeClock, pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    finish(pool, keeper, "k", "r1", 2)
    assert not keeper.has_pins()
    first = keeper.pin("k", 5)
    assert isinstance(first, dict)
    assert keeper.has_pins()
    assert keeper.unpin(first["pin_id"])
    assert not keeper.has_pins()
    assert isinstance(keeper.pin("k", 5), dict)
    clock.advance(5)
    assert keeper.has_pins()  # lapsed, not yet serviced
    keeper.service()
    assert not keeper.has_pins()


# Room for live requests.


@pytest.fixture
def three(pool: FakeBlockPool, keeper: RetentionKeeper) -> dict[str, list[int]]:
    """Retentions a, b, c (oldest first) of 8 blocks each: 8 of the 32 blocks stay free."""
    return {key: finish(pool, keeper, key, f"req-{key}", 8)[0] for key in "abc"}


def test_make_room_does_nothing_when_the_pool_already_has_room(
        pool: FakeBlockPool, keeper: RetentionKeeper, three: dict[str, list[int]]) -> None:
    assert keeper.make_room(8) == 0
    assert keeper.stats()["retentions"] == 3


def test_make_room_evicts_least_recently_used_until_enough_blocks_are_free(
        pool: FakeBlockPool, keeper: RetentionKeeper, three: dict[str, list[int]]) -> None:
    assert keeper.make_room(20) == 2
    assert pool.get_num_free_blocks() >= 20
    assert pool.refs(three["a"] + three["b"]) == [0] * 16
    assert pool.refs(three["c"]) == [1] * 8
    assert why(keeper.describe("a")) == ("a", GoneReason.EVICTED)
    assert keeper.take_events()[-2:] == ["evicted", "evicted"]


def test_a_keepalive_moves_a_retention_to_the_back_of_the_eviction_order(
        pool: FakeBlockPool, keeper: RetentionKeeper, three: dict[str, list[int]]) -> None:
    assert keeper.keepalive("a") is not None
    assert keeper.make_room(12) == 1
    assert why(keeper.describe("b")) == ("b", GoneReason.EVICTED)
    assert isinstance(keeper.describe("a"), dict)


def test_make_room_never_evicts_a_pinned_retention(
        pool: FakeBlockPool, keeper: RetentionKeeper, three: dict[str, list[int]]) -> None:
    assert isinstance(keeper.pin("a", 10), dict)
    assert keeper.make_room(32) == 2  # b and c; a is pinned
    assert pool.refs(three["a"]) == [1] * 8
    assert isinstance(keeper.describe("a"), dict)
    assert pool.get_num_free_blocks() == 24


def test_make_room_keeps_evicting_until_the_pool_really_has_the_blocks(
        pool: FakeBlockPool, keeper: RetentionKeeper, three: dict[str, list[int]]) -> None:
    # The conversation's next turn is running and hit retention a's blocks in the prefix
    # cache: evicting a frees none of them, so the waiting request still needs b evicted.
    pool.share(three["a"])
    assert keeper.make_room(12) == 2
    assert pool.get_num_free_blocks() >= 12
    assert isinstance(keeper.describe("c"), dict)


def test_relieve_evicts_the_least_recently_used_retention(
        pool: FakeBlockPool, keeper: RetentionKeeper, three: dict[str, list[int]]) -> None:
    assert keeper.relieve() is True
    assert pool.refs(three["a"]) == [0] * 8
    assert keeper.stats()["retentions"] == 2
    assert keeper.relieve() is True
    assert keeper.relieve() is True
    assert keeper.relieve() is False
    assert all_free(pool)


def test_relieve_is_false_when_only_pinned_retentions_are_left(
        pool: FakeBlockPool, keeper: RetentionKeeper) -> None:
    assert keeper.relieve() is False
    ids, _ = finish(pool, keeper, "k", "r1", 3)
    assert isinstance(keeper.pin("k", 10), dict)
    assert keeper.relieve() is False
    assert pool.refs(ids) == [1, 1, 1]


# Events.


def test_take_events_reports_each_event_once_in_order(
        clock: FakeClock, pool: FakeBlockPool) -> None:
    keeper = make_keeper(pool, clock, budget=0.5, ttl=60.0)  # 16 blocks of budget
    finish(pool, keeper, "k1", "r1", 2)
    keeper.pin("k1", 5)
    keeper.keepalive("k1")
    finish(pool, keeper, "k1", "r2", 2)
    keeper.release("k1")
    finish(pool, keeper, "k2", "r3", 2)
    clock.advance(60)
    keeper.service()
    finish(pool, keeper, "k3", "r4", 2)
    keeper.relieve()
    finish(pool, keeper, "k4", "r5", 17)
    assert keeper.take_events() == [
        "created", "pinned", "renewed", "created", "replaced", "released", "created",
        "expired", "created", "evicted", "refused"]
    assert keeper.take_events() == []
    assert keeper.stats()["events"] == {
        "created": 4, "renewed": 1, "released": 1, "expired": 1, "evicted": 1,
        "replaced": 1, "refused": 1, "pinned": 1, "host_evicted": 0, "host_pinned": 0}
    keeper.unpin("pin-1")
    keeper.service()
    assert all_free(pool)


# Many threads at once.


def test_concurrent_control_calls_and_engine_steps_leave_every_reference_balanced() -> None:
    pool = FakeBlockPool(65)
    pool.owner = threading.get_ident()  # any pool call off this thread raises
    clock = FakeClock()
    keeper = make_keeper(pool, clock, budget=0.5, ttl=5.0, max_hold=20.0, max_pin=3.0)
    wakes = threading.Semaphore(0)
    keeper.set_waker(wakes.release)
    keys = [f"tenant/conv:{i}" for i in range(6)]
    pin_ids: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def control(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                key, op = rng.choice(keys), rng.random()
                if op < 0.35:
                    view = keeper.pin(key, rng.choice([0.5, 2.0, 10.0]))
                    if isinstance(view, dict):
                        pin_ids.append(view["pin_id"])
                elif op < 0.6 and pin_ids:
                    keeper.unpin(rng.choice(pin_ids))
                elif op < 0.8:
                    keeper.keepalive(key)
                elif op < 0.9:
                    keeper.describe(key)
                else:
                    keeper.release(key)
                keeper.stats()
                keeper.due()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=control, args=(i,), daemon=True) for i in range(4)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for thread in threads:
            thread.start()
        rng = random.Random(1234)
        for step in range(1500):
            key, n = rng.choice(keys), rng.randint(1, 4)
            if pool.get_num_free_blocks() < n:
                keeper.make_room(n)
            view = keeper.describe(key)
            # Frees happen only on this thread, so a described retention's blocks stay held
            # until this thread frees something: safe to hit them in the prefix cache.
            shared = view["params"]["remote_block_ids"][0][:2] if isinstance(view, dict) else []
            if pool.get_num_free_blocks() >= n:
                finish(pool, keeper, key, f"req-{step}", n, shared=shared)
            if step % 7 == 0:
                keeper.relieve()
            keeper.service()
            keeper.take_events()
            keeper.gauges()
            keeper.has_pins()
            clock.advance(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        sys.setswitchinterval(switch)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert keeper.stats()["events"]["created"] > 100
    for pin_id in pin_ids:
        keeper.unpin(pin_id)
    for key in keys:
        keeper.release(key)
    keeper.service()
    assert all_free(pool)
    stats = keeper.stats()
    assert (stats["retentions"], stats["held_blocks"], stats["pins"]) == (0, 0, 0)


# With a host tier: evicted retentions keep their lease there, ended leases leave it too.


@pytest.fixture
def host() -> FakeHostTier:
    host = FakeHostTier()
    host.owner = threading.get_ident()
    return host


def host_keeper(pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier,
                budget: float = 0.25) -> RetentionKeeper:
    return make_keeper(pool, clock, budget=budget, ttl=60.0, max_hold=600.0, host=host)


def test_views_say_where_a_retention_lives(pool: FakeBlockPool, clock: FakeClock,
                                           host: FakeHostTier, keeper: RetentionKeeper) -> None:
    finish(pool, keeper, "plain", "r0", 2)
    view = keeper.describe("plain")
    assert isinstance(view, dict) and (view["where"], view["host_tokens"]) == ("device", 0)
    with_host = host_keeper(FakeBlockPool(33), clock, host)
    finish(with_host._pool, with_host, "k", "r1", 3)  # type: ignore[arg-type]
    host.resident["k"] = 3 * BS
    view = with_host.describe("k")
    assert isinstance(view, dict) and (view["where"], view["host_tokens"]) == ("both", 12)
    host.resident["k"] = 99  # a turn in progress may hold more: capped at the retention's
    view = with_host.keepalive("k")
    assert isinstance(view, dict) and view["host_tokens"] == 12
    pinned = with_host.pin("k", 5)
    assert isinstance(pinned, dict) and pinned["where"] == "both"


def test_an_evicted_retention_keeps_its_lease_in_the_host_tier(
        pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier) -> None:
    keeper = host_keeper(pool, clock, host)  # 8 blocks of budget
    finish(pool, keeper, "a", "r1", 4)
    host.resident["a"] = 4 * BS
    finish(pool, keeper, "b", "r2", 4)
    assert keeper.make_room(pool.usable) == 2  # live requests need every block
    assert all_free(pool)
    view = keeper.describe("a")
    assert isinstance(view, dict) and view["where"] == "host" and view["num_blocks"] == 0
    assert view["host_tokens"] == 16 and view["params"]["remote_block_ids"] == [[]]
    assert view["params"]["kvturn"]["block_hashes"] == []  # nothing a prefill could read
    # No pin, but the decode can load it itself: the router may continue the turn there.
    assert keeper.pin("a", 5) == Gone("a", GoneReason.EVICTED, host_tokens=16)
    assert not keeper.has_pins()
    keepalive = keeper.keepalive("a")
    assert isinstance(keepalive, dict) and keepalive["where"] == "host"
    assert keeper.stats()["host_only"] == 2 and keeper.stats()["host"] == host.usage()
    assert keeper.gauges()[3] == 2
    assert keeper.standings().keys() == {"a", "b"}
    # One the host tier holds none of any more is gone: nothing to load either.
    assert keeper.pin("b", 5) == Gone("b", GoneReason.EVICTED)
    assert keeper.standings().keys() == {"a"}


def test_a_host_only_retention_the_host_tier_lost_is_gone_as_evicted(
        pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier) -> None:
    keeper = host_keeper(pool, clock, host)
    finish(pool, keeper, "a", "r1", 4)
    keeper.make_room(pool.usable)
    keeper.take_events()
    assert in_thread(lambda: keeper.keepalive("a")) == Gone("a", GoneReason.EVICTED)
    assert why(keeper.describe("a")) == ("a", GoneReason.EVICTED)
    assert keeper.take_events() == ["host_evicted"]
    keeper.service()  # whatever of it was still in flight there goes too
    assert host.discarded == [["a"]]


def test_an_ended_lease_leaves_the_host_tier_on_the_engine_thread(
        pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier) -> None:
    keeper = host_keeper(pool, clock, host, budget=1.0)
    for key in ("released", "expires", "kept"):
        finish(pool, keeper, key, f"r-{key}", 2)
        host.resident[key] = 2 * BS
    assert in_thread(lambda: keeper.release("released")) is True
    assert host.discarded == []  # the control thread only queues it
    assert keeper.due()
    keeper.service()
    assert host.discarded == [["released"]]
    clock.advance(61)
    keeper.service()
    assert host.discarded[-1] == ["expires", "kept"]
    assert host.resident == {}


def test_a_retention_larger_than_the_budget_is_kept_host_only(
        pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier) -> None:
    keeper = host_keeper(pool, clock, host)  # 8 blocks
    host.resident["big"] = 10 * BS
    _, kept = finish(pool, keeper, "big", "r1", 10)
    assert kept is not None and not kept.on_device
    assert all_free(pool)
    view = keeper.describe("big")
    assert isinstance(view, dict) and view["where"] == "host" and view["host_tokens"] == 40


def test_a_host_only_lease_whose_first_host_block_went_ends_at_the_next_service(
        pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier) -> None:
    keeper = host_keeper(pool, clock, host)
    for key in ("a", "b"):
        finish(pool, keeper, key, f"r-{key}", 4)
        host.resident[key] = 4 * BS
    keeper.make_room(pool.usable)  # both host-only now; not lost: their leases go on
    assert keeper.lost.since(0).lost == []
    host.resident.pop("a")
    keeper.lost_in_host(["a", "nobody"])  # from inside a store: nothing happens yet
    assert keeper.describe("b") != Gone("b", GoneReason.EVICTED) and keeper.due()
    keeper.service()
    assert keeper.lost.since(0).lost == [("a", "evicted", "kvturn-read/r-a")]
    assert why(keeper.describe("a")) == ("a", GoneReason.EVICTED)
    assert host.discarded == [["a"]]


# Host reads: a prefill reads a host-only retention from the decode's host tier.


def host_only(pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier,
              rows: tuple[int, ...] = (7, 3, 9, 4)) -> RetentionKeeper:
    """A keeper whose retention "a" (4 blocks) lives in the host tier alone, at ``rows``."""
    keeper = host_keeper(pool, clock, host)
    finish(pool, keeper, "a", "r1", 4)
    host.resident["a"] = 4 * BS
    host.rows["a"] = rows
    keeper.make_room(pool.usable)
    assert all_free(pool)
    return keeper


def host_pinned(pool: FakeBlockPool, clock: FakeClock,
                host: FakeHostTier) -> tuple[RetentionKeeper, dict[str, Any]]:
    """:func:`host_only`'s keeper on a decode that serves host reads, and "a" pinned for one."""
    keeper = host_only(pool, clock, host)
    host.read_port = 41000
    pinned = keeper.pin("a", 5, host_reads=True)
    assert isinstance(pinned, dict)
    return keeper, pinned


def test_a_host_only_pin_with_host_reads_reads_host_rows_with_the_retentions_hashes(
        pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier) -> None:
    keeper = host_only(pool, clock, host)
    host.read_port = 41000
    device_view = keeper.describe("a")
    assert isinstance(device_view, dict)
    hashes = device_view["params"]["kvturn"]["block_hashes"]
    pinned = in_thread(lambda: keeper.pin("a", 5, host_reads=True))
    assert isinstance(pinned, dict) and pinned["pin_id"] and pinned["where"] == "host"
    params = pinned["params"]
    assert params["remote_block_ids"] == [[7, 3, 9, 4]]
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == \
        ("decode-engine-host", "127.0.0.1", 41000)
    assert len(params["kvturn"]["block_hashes"]) == 4
    assert hashes == [] or hashes == params["kvturn"]["block_hashes"]
    assert pinned["host_tokens"] == 16
    assert host.read_turns == ["r1"]  # the retention's own turn's rows, not another's
    # Pinned: the host tier evicts none of its blocks meanwhile.
    assert keeper.standings()["a"].standing is Standing.PINNED
    assert keeper.unpin(pinned["pin_id"])
    assert keeper.standings()["a"].standing is Standing.LEASED


def test_a_host_pin_reads_no_more_blocks_than_the_retention_hashed(
        pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier) -> None:
    # A later turn of the conversation may hold more host blocks than the retention covers.
    keeper = host_only(pool, clock, host, rows=(1, 2, 3, 4, 5, 6))
    host.read_port = 41000
    pinned = keeper.pin("a", 5, host_reads=True)
    assert isinstance(pinned, dict)
    assert pinned["params"]["remote_block_ids"] == [[1, 2, 3, 4]]


def test_without_host_reads_a_host_only_pin_answers_host_tokens_as_before(
        pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier) -> None:
    keeper = host_only(pool, clock, host)
    # The decode serves no host reads (no side channel reported), or the router did not ask.
    assert keeper.pin("a", 5, host_reads=True) == Gone("a", GoneReason.EVICTED, host_tokens=16)
    host.read_port = 41000
    assert keeper.pin("a", 5) == Gone("a", GoneReason.EVICTED, host_tokens=16)
    host.rows["a"] = ()  # nothing resident to read
    assert keeper.pin("a", 5, host_reads=True) == Gone("a", GoneReason.EVICTED, host_tokens=16)
    assert not keeper.has_pins()


def test_a_device_retention_pinned_with_host_reads_is_read_from_the_device(
        pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier) -> None:
    keeper = host_keeper(pool, clock, host)
    ids, _ = finish(pool, keeper, "a", "r1", 3)
    host.resident["a"] = 3 * BS
    host.rows["a"] = (7, 8, 9)
    host.read_port = 41000
    pinned = keeper.pin("a", 5, host_reads=True)
    assert isinstance(pinned, dict)
    assert pinned["params"]["remote_engine_id"] == "decode-engine"
    assert pinned["params"]["remote_block_ids"] == [ids]


def test_a_host_pinned_retention_released_mid_read_leaves_the_host_tier_at_its_unpin(
        pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier) -> None:
    keeper, pinned = host_pinned(pool, clock, host)
    assert in_thread(lambda: keeper.release("a")) is True
    keeper.service()
    # Released, but a read may be in flight: pinned as far as the host tier goes (its discard
    # keeps what a pinned standing holds, its eviction never takes it) ...
    assert keeper.standings()["a"].standing is Standing.PINNED
    told = len(host.discarded)
    # ... until the last pin goes: then the host tier hears the lease ended (again).
    assert keeper.unpin(pinned["pin_id"])
    keeper.service()
    assert "a" not in keeper.standings()
    assert len(host.discarded) == told + 1 and host.discarded[-1] == ["a"]


def test_a_host_pin_lapses_like_a_device_pin(
        pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier) -> None:
    keeper = host_only(pool, clock, host)
    host.read_port = 41000
    keeper.take_events()
    pinned = keeper.pin("a", 5, host_reads=True)
    assert isinstance(pinned, dict) and pinned["pin_expires_in"] == 5
    # Counted twice: a pin, and one for a read of the host tier (kvturn:retention_events).
    assert keeper.take_events() == ["pinned", "host_pinned"]
    assert keeper.stats()["events"]["host_pinned"] == 1
    clock.advance(6)
    keeper.service()
    assert not keeper.has_pins()
    assert keeper.standings()["a"].standing is Standing.LEASED


def test_a_newer_turn_does_not_unpin_the_host_blocks_a_read_of_the_older_one_holds(
        pool: FakeBlockPool, clock: FakeClock, host: FakeHostTier) -> None:
    keeper, pinned = host_pinned(pool, clock, host)
    finish(pool, keeper, "a", "r2", 2)  # the next turn replaces the pinned retention
    assert keeper.standings()["a"].standing is Standing.PINNED
    assert keeper.unpin(pinned["pin_id"])
    assert keeper.standings()["a"].standing is Standing.LEASED
