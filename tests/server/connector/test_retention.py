"""Decode-side retention leases: TTL, keepalive, hold cap, release, replacement, LRU budget."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from kvturn.wire import GoneReason
from kvturn_server.connector._hashing import block_hashes
from kvturn_server.connector._lease import Retention
from kvturn_server.connector._retention import RetentionTable
from kvturn_server.connector._tiers import LeaseView, Standing

BS = 4


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


_next_block = 0


def blocks(n: int) -> tuple[int, ...]:
    """Fresh block ids, distinct across every retention of a test run."""
    global _next_block
    start = _next_block
    _next_block += n
    return tuple(range(start, start + n))


def hashes(n: int) -> list[bytes]:
    return block_hashes(list(range(n * BS)), BS)


def retain(table: RetentionTable, key: str, n: int, **kw: Any) -> list[Retention]:
    return table.retain(key, kw.pop("request_id", f"req-{key}"), blocks(n), hashes(n),
                        kw.pop("num_tokens", n * BS), **kw)


def keys(retentions: list[Retention]) -> list[str]:
    return [r.key for r in retentions]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock) -> RetentionTable:
    return RetentionTable(budget_blocks=10, ttl=480.0, max_hold=3600.0, clock=clock)


# Creation and lookup.


def test_retain_and_get(table: RetentionTable, clock: FakeClock) -> None:
    ids = blocks(3)
    hs = hashes(2)  # a partial third block: held, not readable
    assert table.retain("conv", "req-1", ids, hs, 10) == []
    r = table.get("conv")
    assert r == Retention(
        key="conv", request_id="req-1", block_ids=ids, block_hashes=tuple(hs), num_tokens=10,
        created_at=1000.0, expires_at=1480.0, hold_until=4600.0, last_used=1000.0)
    assert r.num_blocks == 3
    assert r.readable_block_ids == ids[:2]
    assert len(table) == 1 and table.retained_blocks == 3
    assert table.stats.created == 1
    assert table.get("other") is None


def test_retention_is_frozen(table: RetentionTable) -> None:
    retain(table, "conv", 2)
    r = table.get("conv")
    assert r is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.expires_at = 0.0  # type: ignore[misc]


def test_defaults() -> None:
    t = RetentionTable(budget_blocks=1)
    assert t.ttl == 480.0 and t.max_hold == 3600.0


# Expiry.


def test_ttl_expiry_boundary(table: RetentionTable, clock: FakeClock) -> None:
    retain(table, "conv", 2)
    clock.advance(479.999)
    assert table.get("conv") is not None
    assert table.expire() == []
    clock.advance(0.001)  # now == expires_at: the lease is over
    assert table.get("conv") is None
    # Still held (and counted) until expire() hands it back for freeing.
    assert len(table) == 1 and table.retained_blocks == 2
    freed = table.expire()
    assert keys(freed) == ["conv"]
    assert len(table) == 0 and table.retained_blocks == 0
    assert table.stats.expired == 1
    assert table.expire() == []


def test_expire_returns_only_expired_soonest_first(
    table: RetentionTable, clock: FakeClock,
) -> None:
    retain(table, "a", 1)
    clock.advance(10)
    retain(table, "b", 1)
    clock.advance(10)
    retain(table, "c", 1)
    clock.advance(480 - 10)  # a and b are past their TTL, c is not
    assert keys(table.expire()) == ["a", "b"]
    assert table.get("c") is not None


def test_expired_retention_cannot_be_touched_or_kept_alive(
    table: RetentionTable, clock: FakeClock,
) -> None:
    retain(table, "conv", 2)
    clock.advance(480)
    assert table.touch("conv") is None
    assert table.keepalive("conv") is None
    assert table.stats.renewed == 0
    assert keys(table.expire()) == ["conv"]


# Keepalive and the maximum hold.


def test_keepalive_extends_from_now(table: RetentionTable, clock: FakeClock) -> None:
    retain(table, "conv", 2)
    clock.advance(400)
    r = table.keepalive("conv")
    assert r is not None and r.expires_at == 1400.0 + 480.0
    assert r.last_used == 1400.0
    assert table.get("conv") == r
    clock.advance(479)
    # The superseded expiry at 1480 must not drop the renewed lease.
    assert table.expire() == []
    assert table.get("conv") is not None
    clock.advance(1)
    assert keys(table.expire()) == ["conv"]
    assert table.stats.renewed == 1


def test_keepalive_is_capped_by_max_hold(table: RetentionTable, clock: FakeClock) -> None:
    retain(table, "conv", 2)
    for _ in range(7):
        clock.advance(470)
        assert table.keepalive("conv") is not None  # 1000 + 7 * 470 = 4290
    clock.advance(300)  # 4590: ten seconds of hold left
    r = table.keepalive("conv")
    assert r is not None and r.expires_at == r.hold_until == 4600.0
    clock.advance(10)
    assert table.keepalive("conv") is None
    assert keys(table.expire()) == ["conv"]


def test_max_hold_shorter_than_ttl_caps_the_first_lease(clock: FakeClock) -> None:
    t = RetentionTable(budget_blocks=10, ttl=480.0, max_hold=60.0, clock=clock)
    retain(t, "conv", 1)
    r = t.get("conv")
    assert r is not None and r.expires_at == r.hold_until == 1060.0


def test_keepalive_missing_key(table: RetentionTable) -> None:
    assert table.keepalive("nobody") is None


# Release and replacement.


def test_release(table: RetentionTable) -> None:
    retain(table, "conv", 3)
    existed, freed = table.release("conv")
    assert existed and keys(freed) == ["conv"]
    assert table.get("conv") is None and len(table) == 0 and table.retained_blocks == 0
    assert table.release("conv") == (False, [])
    assert table.stats.released == 1
    assert table.gone_reason("conv") == GoneReason.RELEASED


def test_release_hands_back_an_expired_retention_still_held(
    table: RetentionTable, clock: FakeClock,
) -> None:
    retain(table, "conv", 3)
    clock.advance(500)
    existed, freed = table.release("conv")
    assert existed and [r.num_blocks for r in freed] == [3]
    assert table.expire() == []
    assert table.retained_blocks == 0


def test_next_turn_replaces_previous_retention(table: RetentionTable, clock: FakeClock) -> None:
    retain(table, "conv", 2, request_id="turn-1")
    clock.advance(5)
    freed = retain(table, "conv", 3, request_id="turn-2")
    assert [r.request_id for r in freed] == ["turn-1"]
    r = table.get("conv")
    assert r is not None and r.request_id == "turn-2" and r.created_at == 1005.0
    assert len(table) == 1 and table.retained_blocks == 3
    assert table.stats.replaced == 1 and table.stats.created == 2
    # The old lease's expiry entry must not drop the new retention.
    clock.advance(476)
    assert table.expire() == []


def test_replacing_an_expired_retention(table: RetentionTable, clock: FakeClock) -> None:
    retain(table, "conv", 2, request_id="turn-1")
    clock.advance(600)
    freed = retain(table, "conv", 2, request_id="turn-2")
    assert [r.request_id for r in freed] == ["turn-1"]
    assert table.get("conv") is not None


# Use and LRU order.


def test_touch_is_multi_use_and_does_not_extend_the_lease(
    table: RetentionTable, clock: FakeClock,
) -> None:
    retain(table, "conv", 2)
    clock.advance(100)
    first = table.touch("conv")
    clock.advance(100)
    second = table.touch("conv")
    assert first is not None and second is not None
    assert second.last_used == 1200.0
    assert second.expires_at == 1480.0
    assert table.get("conv") == second
    assert table.touch("missing") is None


def test_budget_evicts_least_recently_used(table: RetentionTable, clock: FakeClock) -> None:
    retain(table, "a", 4)
    retain(table, "b", 4)
    freed = retain(table, "c", 4)  # 12 > 10
    assert keys(freed) == ["a"]
    assert table.retained_blocks == 8 and table.stats.evicted == 1


def test_touch_changes_lru_order(table: RetentionTable, clock: FakeClock) -> None:
    retain(table, "a", 4)
    retain(table, "b", 4)
    clock.advance(1)
    table.touch("a")
    assert keys(retain(table, "c", 4)) == ["b"]
    assert table.get("a") is not None


def test_keepalive_changes_lru_order(table: RetentionTable, clock: FakeClock) -> None:
    retain(table, "a", 4)
    retain(table, "b", 4)
    clock.advance(1)
    table.keepalive("a")
    assert keys(retain(table, "c", 4)) == ["b"]


def test_get_does_not_change_lru_order(table: RetentionTable) -> None:
    retain(table, "a", 4)
    retain(table, "b", 4)
    table.get("a")
    assert keys(retain(table, "c", 4)) == ["a"]


def test_budget_may_evict_several(table: RetentionTable) -> None:
    for key in "abcde":
        retain(table, key, 2)
    assert keys(retain(table, "big", 7)) == ["a", "b", "c", "d"]
    assert table.retained_blocks == 9 and table.stats.evicted == 4


def test_exactly_filling_the_budget_evicts_nothing(table: RetentionTable) -> None:
    retain(table, "a", 6)
    assert retain(table, "b", 4) == []
    assert table.retained_blocks == 10


def test_budget_frees_expired_before_lru(table: RetentionTable, clock: FakeClock) -> None:
    retain(table, "old", 3)
    clock.advance(10)
    retain(table, "live", 3)
    clock.advance(1)
    table.touch("old")  # most recently used, but it expires first
    table.keepalive("live")
    clock.advance(475)  # old expired at 1480; live renewed to 1491
    freed = retain(table, "new", 6)
    assert keys(freed) == ["old"]
    assert table.stats.expired == 1 and table.stats.evicted == 0
    assert table.get("live") is not None


def test_replacement_frees_room_before_eviction(table: RetentionTable) -> None:
    retain(table, "a", 5)
    retain(table, "b", 5)
    freed = retain(table, "b", 5)
    assert keys(freed) == ["b"]
    assert table.stats.evicted == 0


def test_retention_larger_than_budget_is_refused(table: RetentionTable) -> None:
    retain(table, "a", 4)
    freed = retain(table, "huge", 11)
    assert keys(freed) == ["huge"]
    assert table.get("huge") is None
    assert table.get("a") is not None  # nothing evicted for something that cannot fit
    assert table.retained_blocks == 4
    assert table.stats.refused == 1 and table.stats.created == 1


def test_refused_retention_still_replaces_the_previous_turn(table: RetentionTable) -> None:
    retain(table, "conv", 4, request_id="turn-1")
    freed = retain(table, "conv", 11, request_id="turn-2")
    assert [r.request_id for r in freed] == ["turn-1", "turn-2"]
    assert table.get("conv") is None and len(table) == 0
    assert table.stats.replaced == 1 and table.stats.refused == 1


def test_zero_budget_refuses_everything(clock: FakeClock) -> None:
    t = RetentionTable(budget_blocks=0, clock=clock)
    assert keys(retain(t, "conv", 1)) == ["conv"]
    assert len(t) == 0


# Making room for live requests.


def test_evict_for_frees_lru_until_enough(table: RetentionTable, clock: FakeClock) -> None:
    retain(table, "a", 2)
    retain(table, "b", 3)
    retain(table, "c", 4)
    clock.advance(1)
    table.touch("a")
    freed = table.evict_for(4)  # b (3) is not enough, c (4) more than covers it
    assert keys(freed) == ["b", "c"]
    assert table.retained_blocks == 2 and table.stats.evicted == 2


def test_evict_for_stops_as_soon_as_enough_is_freed(table: RetentionTable) -> None:
    retain(table, "a", 3)
    retain(table, "b", 3)
    assert keys(table.evict_for(3)) == ["a"]
    assert keys(table.evict_for(1)) == ["b"]


def test_evict_for_more_than_held_frees_everything(table: RetentionTable) -> None:
    retain(table, "a", 2)
    retain(table, "b", 2)
    assert keys(table.evict_for(100)) == ["a", "b"]
    assert len(table) == 0 and table.retained_blocks == 0
    assert table.evict_for(5) == []


def test_evict_for_zero_frees_nothing(table: RetentionTable) -> None:
    retain(table, "a", 2)
    assert table.evict_for(0) == []
    assert len(table) == 1


def test_evict_for_takes_expired_first(table: RetentionTable, clock: FakeClock) -> None:
    retain(table, "lru", 2)
    clock.advance(100)
    retain(table, "mru", 2)
    clock.advance(400)  # lru expired at 1480
    table.keepalive("mru")
    assert keys(table.evict_for(1)) == ["lru"]
    assert table.stats.expired == 1 and table.stats.evicted == 0


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_evict_for_rejects_bad_counts(table: RetentionTable, bad: object) -> None:
    with pytest.raises(ValueError, match="blocks_needed must be a non-negative int"):
        table.evict_for(bad)  # type: ignore[arg-type]


# Malformed input.


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget_blocks": -1}, "budget_blocks must be a non-negative int"),
        ({"budget_blocks": 1.5}, "budget_blocks must be a non-negative int"),
        ({"budget_blocks": True}, "budget_blocks must be a non-negative int"),
        ({"budget_blocks": 1, "ttl": 0}, "ttl must be a positive number"),
        ({"budget_blocks": 1, "ttl": "480"}, "ttl must be a positive number"),
        ({"budget_blocks": 1, "max_hold": -5}, "max_hold must be a positive number"),
        ({"budget_blocks": 1, "max_hold": float("nan")}, "max_hold must be a positive number"),
    ],
)
def test_table_rejects_bad_settings(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RetentionTable(**kwargs)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", "r", [1], hashes(1), 4), "key must be a non-empty str"),
        ((None, "r", [1], hashes(1), 4), "key must be a non-empty str"),
        (("k", 7, [1], hashes(1), 4), "request_id must be a str"),
        (("k", "r", [], [], 4), "has no blocks to keep"),
        (("k", "r", [1, 1], hashes(2), 8), "lists a block id more than once"),
        (("k", "r", [1, -2], hashes(2), 8), "block ids must be non-negative ints"),
        (("k", "r", [1, [2]], hashes(2), 8), "block ids must be non-negative ints"),
        (("k", "r", [1, False], hashes(2), 8), "block ids must be non-negative ints"),
        (("k", "r", [1], hashes(2), 8), "2 hashes for 1 blocks"),
        (("k", "r", [1, 2], [b"short"], 8), "block hashes must be 16 bytes"),
        (("k", "r", [1, 2], ["x" * 16], 8), "block hashes must be 16 bytes"),
        (("k", "r", [1], hashes(1), 0), "num_tokens must be a positive int"),
        (("k", "r", [1], hashes(1), 4.0), "num_tokens must be a positive int"),
    ],
)
def test_retain_rejects_malformed_input(
    table: RetentionTable, args: tuple[Any, ...], message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        table.retain(*args)
    assert len(table) == 0 and table.stats.created == 0


def test_malformed_retain_leaves_previous_retention_alone(table: RetentionTable) -> None:
    retain(table, "k", 2)
    with pytest.raises(ValueError):
        table.retain("k", "r", [], [], 4)
    assert table.get("k") is not None


# Long-running behaviour.


def test_frequent_keepalives_do_not_grow_the_expiry_heap(
    table: RetentionTable, clock: FakeClock,
) -> None:
    retain(table, "a", 1)
    retain(table, "b", 1)
    for _ in range(1000):
        clock.advance(1)
        table.keepalive("a")
    assert len(table._expiry) <= 2 * len(table) + 64 + 1
    clock.advance(480)
    assert keys(table.expire()) == ["b", "a"]


def test_random_operations_keep_the_books_balanced(clock: FakeClock) -> None:
    rng = random.Random(7)
    table = RetentionTable(budget_blocks=40, ttl=50.0, max_hold=120.0, clock=clock)
    held: dict[int, str] = {}  # block id -> key, as the allocator would see it

    def free(retentions: list[Retention]) -> None:
        for r in retentions:
            for block_id in r.block_ids:
                assert held.pop(block_id) == r.key

    pins: list[str] = []
    for step in range(3000):
        clock.advance(rng.random() * 5)
        key = f"c{rng.randrange(12)}"
        op = rng.randrange(8)
        if op == 0:
            n = rng.randrange(1, 15)
            ids = blocks(n)
            for block_id in ids:
                held[block_id] = key
            free(table.retain(key, f"r{step}", ids, hashes(n - 1), n * BS - 1))
        elif op == 6:
            pinned = table.pin(key, rng.random() * 20 + 1)
            if pinned is not None:
                pins.append(pinned[1].pin_id)
        elif op == 7 and pins:
            free(table.unpin(pins.pop(rng.randrange(len(pins))))[1])
        elif op == 1:
            table.touch(key)
        elif op == 2:
            table.keepalive(key)
        elif op == 3:
            free(table.release(key)[1])
        elif op == 4:
            free(table.expire())
        else:
            free(table.evict_for(rng.randrange(10)))
        assert table.held_blocks == len(held)
        assert table.retained_blocks <= 40
        for r in table._entries.values():
            assert r.expires_at <= r.hold_until
    for pin_id in pins:
        free(table.unpin(pin_id)[1])
    free(table.evict_for(10**6))
    assert held == {} and len(table) == 0 and table.held_blocks == 0


# Pins: a read in flight keeps its blocks whatever happens to the retention.


def test_pin_returns_the_live_retention_and_does_not_extend_it(
    table: RetentionTable, clock: FakeClock,
) -> None:
    retain(table, "conv", 2)
    pinned = table.pin("conv", 30)
    assert pinned is not None
    retention, pin = pinned
    assert retention.key == "conv" and pin.key == "conv" and pin.expires_at == 1030.0
    assert table.get("conv") == retention  # not a use, not a renewal
    assert table.stats.pinned == 1 and table.num_pins == 1
    assert table.pin("other", 30) is None


def test_pin_ttl_is_capped(clock: FakeClock) -> None:
    table = RetentionTable(budget_blocks=10, max_pin=5.0, clock=clock)
    retain(table, "conv", 1)
    pinned = table.pin("conv", 100)
    assert pinned is not None and pinned[1].expires_at == 1005.0
    with pytest.raises(ValueError, match="pin ttl"):
        table.pin("conv", 0)


def test_an_expired_retention_cannot_be_pinned(table: RetentionTable, clock: FakeClock) -> None:
    retain(table, "conv", 1)
    clock.advance(480)
    assert table.pin("conv", 30) is None
    assert table.gone_reason("conv") == GoneReason.EXPIRED


def test_release_of_a_pinned_retention_drains_until_unpin(table: RetentionTable) -> None:
    retain(table, "conv", 3)
    pinned = table.pin("conv", 30)
    assert pinned is not None
    assert table.release("conv") == (True, [])
    assert table.get("conv") is None and table.pin("conv", 30) is None
    assert table.retained_blocks == 0 and table.held_blocks == 3
    existed, freed = table.unpin(pinned[1].pin_id)
    assert existed and keys(freed) == ["conv"] and table.held_blocks == 0
    assert table.unpin(pinned[1].pin_id) == (False, [])


def test_replacement_of_a_pinned_retention_drains(table: RetentionTable) -> None:
    retain(table, "conv", 2, request_id="turn-1")
    pinned = table.pin("conv", 30)
    assert pinned is not None
    assert retain(table, "conv", 3, request_id="turn-2") == []
    assert table.held_blocks == 5
    freed = table.unpin(pinned[1].pin_id)[1]
    assert [r.request_id for r in freed] == ["turn-1"]
    current = table.get("conv")
    assert current is not None and current.request_id == "turn-2"


def test_two_pins_hold_until_the_last_goes(table: RetentionTable) -> None:
    retain(table, "conv", 2)
    first, second = table.pin("conv", 30), table.pin("conv", 30)
    assert first is not None and second is not None
    table.release("conv")
    assert table.unpin(first[1].pin_id) == (True, [])
    assert keys(table.unpin(second[1].pin_id)[1]) == ["conv"]


def test_unpinning_a_retention_still_in_the_table_frees_nothing(table: RetentionTable) -> None:
    retain(table, "conv", 2)
    pinned = table.pin("conv", 30)
    assert pinned is not None
    assert table.unpin(pinned[1].pin_id) == (True, [])
    assert table.get("conv") is not None and table.held_blocks == 2


def test_a_lapsed_pin_lets_an_expired_retention_go(table: RetentionTable, clock: FakeClock) -> None:
    retain(table, "conv", 2)
    clock.advance(470)
    assert table.pin("conv", 20) is not None
    clock.advance(10)
    assert table.expire() == []  # expired, but the read may still be running
    assert table.held_blocks == 2 and table.get("conv") is None
    clock.advance(10)
    assert keys(table.expire()) == ["conv"]
    assert table.held_blocks == 0 and table.stats.pins_expired == 1


def test_eviction_skips_pinned_retentions(clock: FakeClock) -> None:
    table = RetentionTable(budget_blocks=6, clock=clock)
    retain(table, "old", 3)
    clock.advance(1)
    retain(table, "mid", 3)
    assert table.pin("old", 30) is not None
    clock.advance(1)
    assert keys(retain(table, "new", 3)) == ["mid"]  # "old" is older but pinned
    assert keys(table.evict_for(100)) == ["new"]
    assert table.evict_for(100) == []  # only the pinned one is left
    assert table.gone_reason("mid") == GoneReason.EVICTED


def test_draining_blocks_count_against_the_budget(clock: FakeClock) -> None:
    table = RetentionTable(budget_blocks=6, clock=clock)
    retain(table, "a", 4)
    assert table.pin("a", 30) is not None
    table.release("a")
    retain(table, "b", 1)
    assert keys(retain(table, "c", 2)) == ["b"]  # 4 draining + 2 new fill the budget


def test_next_deadline_covers_leases_and_pins(table: RetentionTable, clock: FakeClock) -> None:
    assert table.next_deadline() is None
    retain(table, "conv", 1)
    assert table.next_deadline() == 1480.0
    assert table.pin("conv", 10) is not None
    assert table.next_deadline() == 1010.0


def test_gone_reasons_are_remembered_within_bounds(clock: FakeClock) -> None:
    table = RetentionTable(budget_blocks=100, remember=2, clock=clock)
    for key in ("a", "b", "c"):
        retain(table, key, 1)
        table.release(key)
    assert table.gone_reason("a") == GoneReason.NO_RETENTION  # forgotten: cap of 2
    assert table.gone_reason("c") == GoneReason.RELEASED
    retain(table, "c", 1)
    table.retain("c", "again", blocks(1), hashes(1), BS)
    assert table.gone_reason("never") == GoneReason.NO_RETENTION


# With a host tier: eviction takes the device blocks, the lease goes on host-only.


@pytest.fixture
def host_table(clock: FakeClock) -> RetentionTable:
    return RetentionTable(budget_blocks=10, ttl=480.0, max_hold=3600.0, clock=clock,
                          host_tier=True)


def test_with_a_host_tier_eviction_hands_back_device_blocks_and_keeps_the_lease(
        host_table: RetentionTable, clock: FakeClock) -> None:
    retain(host_table, "a", 4)
    retain(host_table, "b", 4)
    freed = retain(host_table, "c", 4)  # over the budget: a, least recently used, leaves
    assert keys(freed) == ["a"] and len(freed[0].block_ids) == 4
    a = host_table.get("a")
    assert a is not None and not a.on_device and a.block_ids == () and a.num_blocks == 0
    assert a.readable_block_ids == () and len(a.block_hashes) == 4  # hashes kept, none readable
    assert host_table.retained_blocks == 8 and host_table.host_only == 1
    assert host_table.stats.evicted == 1
    # The lease itself is unchanged: keepalive, touch and release apply, expiry too.
    assert host_table.keepalive("a") is not None and host_table.touch("a") is not None
    # A host-only retention has nothing a prefill could read: no pin, "evicted".
    assert host_table.pin("a", 5) is None
    assert host_table.gone_reason("a") is GoneReason.EVICTED
    # And it is never chosen to make room again (it frees nothing).
    assert keys(host_table.evict_for(3)) == ["b"]
    existed, gone = host_table.release("a")
    assert existed and keys(gone) == ["a"] and gone[0].block_ids == ()
    assert host_table.take_ended() == ["a"]


def test_with_a_host_tier_a_retention_larger_than_the_budget_is_kept_host_only(
        host_table: RetentionTable) -> None:
    freed = retain(host_table, "big", 11)
    assert keys(freed) == ["big"] and len(freed[0].block_ids) == 11  # device blocks back
    big = host_table.get("big")
    assert big is not None and not big.on_device and big.num_tokens == 11 * BS
    assert host_table.stats.refused == 1 and host_table.stats.created == 1
    assert host_table.retained_blocks == 0


def test_ended_leases_are_reported_once_with_a_host_tier_only(
        host_table: RetentionTable, table: RetentionTable, clock: FakeClock) -> None:
    for t in (host_table, table):
        retain(t, "released", 2)
        retain(t, "expires", 2)
        retain(t, "replaced", 2)
        retain(t, "replaced", 2)  # a lease going on: not ended
        t.release("released")
        clock.advance(481)
        t.expire()
    assert host_table.take_ended() == ["released", "expires", "replaced"]
    assert host_table.take_ended() == []
    assert table.take_ended() == []  # nobody would take them


def test_standings_are_the_live_leases_with_their_last_use_and_pins(
        host_table: RetentionTable, clock: FakeClock) -> None:
    retain(host_table, "old", 2)
    clock.advance(300)
    retain(host_table, "a", 2)
    retain(host_table, "b", 2)
    assert host_table.pin("b", 30) is not None
    clock.advance(200)  # "old" expired (not handed back yet); a and b live
    host_table.keepalive("a")
    assert host_table.standings() == {"a": LeaseView(Standing.LEASED, clock.now),
                                      "b": LeaseView(Standing.PINNED, clock.now - 200)}


def test_a_host_only_retention_whose_host_copy_is_gone_is_dropped_as_evicted(
        host_table: RetentionTable) -> None:
    retain(host_table, "a", 6)
    retain(host_table, "b", 6)  # a leaves the device
    assert not host_table.drop_lost("a", "someone-else")  # another turn: not this one
    assert not host_table.drop_lost("b", "req-b")  # on the device: its host copy is a spare
    assert host_table.drop_lost("a", "req-a")
    assert host_table.get("a") is None and host_table.gone_reason("a") is GoneReason.EVICTED
    assert host_table.stats.host_evicted == 1 and host_table.take_ended() == ["a"]
    assert not host_table.drop_lost("a", "req-a")
