"""The decode's lost log: retentions it dropped on its own, for routers to follow
(connector/_lost.py, the keeper, ``GET /kvturn/v1/lost``; router/_lost.py follows it)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvturn.wire import GoneReason
from kvturn_server.connector._control import ControlServer
from kvturn_server.connector._lost import LostLog
from kvturn_server.connector._params import READ_PREFIX
from kvturn_server.connector._retention import RetentionTable
from tests.fakes.keeper import FakeBlockPool, FakeClock, finish, make_keeper

# The log.


def test_entries_are_numbered_and_read_after_a_cursor() -> None:
    log = LostLog()
    log.add([("a", "evicted", "r-a"), ("b", "expired", "r-b")])
    assert log.since(0).seq == 2
    assert log.since(0).lost == [("a", "evicted", "r-a"), ("b", "expired", "r-b")]
    assert log.since(1).lost == [("b", "expired", "r-b")]
    nothing = log.since(2)
    assert (nothing.seq, nothing.lost, nothing.truncated) == (2, [], False)


def test_a_reader_that_fell_behind_the_capacity_is_told() -> None:
    log = LostLog(capacity=2)
    log.add([(k, "evicted", f"r-{k}") for k in "abc"])
    behind = log.since(0)
    assert behind.truncated and [k for k, _, _ in behind.lost] == ["b", "c"]
    assert not log.since(1).truncated


def test_a_cursor_from_another_engine_starts_over_at_the_end() -> None:
    log = LostLog()
    log.add([("a", "evicted", "r-a")])
    other = log.since(7)  # the router followed the decode's previous engine
    assert (other.seq, other.lost, other.truncated) == (1, [], True)


def test_a_long_poll_returns_when_an_entry_arrives() -> None:
    log = LostLog()
    threading.Timer(0.05, log.add, [[("a", "evicted", "r-a")]]).start()
    started = time.monotonic()
    got = log.since(0, wait=5.0)
    assert got.lost == [("a", "evicted", "r-a")] and time.monotonic() - started < 4.0
    # With nothing new it waits the whole time, then answers empty.
    started = time.monotonic()
    assert log.since(1, wait=0.05).lost == [] and time.monotonic() - started >= 0.05


# What the table logs.

def _table(clock: FakeClock, budget: int = 10) -> RetentionTable:
    return RetentionTable(budget_blocks=budget, ttl=60.0, max_hold=600.0, clock=clock)


def _retain(table: RetentionTable, key: str, request_id: str, n: int) -> None:
    start = sum(r.num_blocks for r in table.retentions()) + 1
    table.retain(key, request_id, tuple(range(start, start + n)),
                 tuple(bytes([i]) * 16 for i in range(n)), n * 4)


def test_the_table_logs_evictions_and_expiries_only() -> None:
    clock = FakeClock()
    table = _table(clock)
    _retain(table, "a", "ra", 4)
    _retain(table, "b", "rb", 4)
    _retain(table, "a", "ra2", 4)  # replaced: the caller knows
    table.release("b")  # released: the caller knows
    _retain(table, "big", "rbig", 11)  # refused over the budget: the capture knows
    assert table.take_lost() == []
    _retain(table, "c", "rc", 4)
    _retain(table, "d", "rd", 4)  # over the budget: "a" goes, its blocks stay cached
    assert table.get("a") is None and table.take_lost() == []
    table.evict_for(4)  # live requests need blocks: "c", the least recently used, goes
    lost = table.take_lost()
    assert [(r.key, r.request_id, why) for r, why in lost] == [("c", "rc", GoneReason.EVICTED)]
    clock.advance(61)
    table.expire()
    assert [(r.key, why) for r, why in table.take_lost()] == [("d", GoneReason.EXPIRED)]
    assert table.take_lost() == []


def test_the_keeper_logs_what_live_requests_evicted_with_the_read_id() -> None:
    clock = FakeClock()
    pool = FakeBlockPool(9)
    keeper = make_keeper(pool, clock)
    finish(pool, keeper, "k", "req-1", 4)
    keeper.make_room(8)  # a live request needs every block
    got = keeper.lost.since(0)
    assert got.lost == [("k", "evicted", READ_PREFIX + "req-1")]
    assert keeper.describe("k").reason == GoneReason.EVICTED  # type: ignore[union-attr]


# The control route.

def _server(keeper: Any) -> ControlServer:
    return ControlServer("127.0.0.1", 0, engine_id="decode-engine", role="decode",
                         keeper=keeper)


def test_the_route_answers_the_log_after_a_cursor() -> None:
    clock = FakeClock()
    pool = FakeBlockPool(9)
    keeper = make_keeper(pool, clock)
    finish(pool, keeper, "k", "req-1", 4)
    keeper.make_room(8)
    server = _server(keeper)
    status, body = server.handle("GET", "/kvturn/v1/lost?after=0&wait=0", {})
    assert status == 200
    assert body == {"engine_id": "decode-engine", "seq": 1, "truncated": False,
                    "lost": [{"key": "k", "reason": "evicted",
                              "read_id": READ_PREFIX + "req-1"}]}
    assert server.handle("GET", "/kvturn/v1/lost?after=1", {})[1]["lost"] == []


@pytest.mark.parametrize("query", ["after=x", "after=-1", "wait=31", "wait=-1", "wait=no"])
def test_the_route_refuses_a_bad_query(query: str) -> None:
    server = _server(make_keeper(FakeBlockPool(9), FakeClock()))
    status, body = server.handle("GET", f"/kvturn/v1/lost?{query}", {})
    assert (status, body["error"]["code"]) == (400, "bad_query")
