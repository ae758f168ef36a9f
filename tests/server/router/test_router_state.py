"""The state store: one suite, run against the in-memory store and a real redis-server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from kvturn_server.router import MemoryStore, Placement, StoreError
from kvturn_server.router._state import SUPERSEDED, ConversationStore
from kvturn_server.router._state_redis import RedisStore
from kvturn_server.router._wiring import open_store
from tests.fakes.backends import AsgiCall, Cluster, ManualClock
from tests.fakes.router_harness import MakeHarness

MakeStore = Callable[..., Awaitable[ConversationStore]]


@pytest.fixture(params=["memory", "redis"])
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[MakeStore]:
    stores: list[ConversationStore] = []
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None

    async def make(clock: ManualClock, *, max_entries: int = 100,
                   remember_expired: float = 60.0, prefix: str = "t:") -> ConversationStore:
        store: ConversationStore
        if url is None:
            store = MemoryStore(max_entries=max_entries, remember_expired=remember_expired,
                                clock=clock)
        else:
            store = RedisStore(url, max_entries=max_entries, remember_expired=remember_expired,
                               prefix=prefix, clock=clock)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.aclose()


def _placement(clock: ManualClock, turn: str = "t1", *, decode: str = "http://d0:8200",
               ttl: float = 480.0, **kw: Any) -> Placement:
    return Placement(decode=decode, engine_id=kw.get("engine_id", "e1"),
                     num_tokens=kw.get("num_tokens", 10), expires_at=clock() + ttl, turn=turn)


async def test_put_get_replace(make_store: MakeStore) -> None:
    clock = ManualClock()
    store = await make_store(clock)
    assert await store.get("k") is None
    p = _placement(clock)
    assert await store.put("k", p) == 0
    assert await store.get("k") == p
    q = _placement(clock, "t2", num_tokens=20, engine_id=None)
    await store.put("k", q)
    assert await store.get("k") == q
    assert await store.size() == 1


async def test_keys_may_hold_any_id_character(make_store: MakeStore) -> None:
    clock = ManualClock()
    store = await make_store(clock)
    key = "0123456789abcdef/a/b:c#d?e%f&g*[]{}\"'\\"
    await store.put(key, _placement(clock))
    assert await store.get(key) is not None
    assert await store.get(key[:-1]) is None


async def test_the_cap_evicts_the_least_recently_used(make_store: MakeStore) -> None:
    clock = ManualClock()
    store = await make_store(clock, max_entries=3)
    for key in "abc":
        await store.put(key, _placement(clock))
    await store.get("a")  # a is now the most recently used
    assert await store.put("d", _placement(clock)) == 1
    assert await store.get("b") is None
    assert [await store.get(k) is not None for k in "acd"] == [True, True, True]
    await store.put("c", _placement(clock, "t2"))  # a put counts as use too
    assert await store.put("e", _placement(clock)) == 1
    assert await store.get("a") is None
    assert await store.size() == 3


async def test_entries_live_until_the_lease_plus_remember_expired(
        make_store: MakeStore) -> None:
    clock = ManualClock()
    store = await make_store(clock, remember_expired=5.0)
    await store.put("k", _placement(clock, ttl=10.0))
    clock.advance(14.9)
    placement = await store.get("k")
    assert placement is not None and placement.expires_at < clock()  # expired, remembered
    clock.advance(0.1)
    assert await store.get("k") is None
    assert await store.size() == 0


async def test_purge_removes_entries_past_their_deadline(make_store: MakeStore) -> None:
    clock = ManualClock()
    store = await make_store(clock, remember_expired=0.0)
    await store.put("short", _placement(clock, ttl=1.0))
    await store.put("long", _placement(clock, ttl=100.0))
    await store.put("renewed", _placement(clock, ttl=1.0))
    await store.put("renewed", _placement(clock, ttl=100.0))
    assert await store.purge() == 0
    clock.advance(2.0)
    assert await store.purge() == 1
    assert await store.size() == 2
    assert await store.get("renewed") is not None and await store.get("long") is not None


async def test_delete_only_the_turn_that_was_read(make_store: MakeStore) -> None:
    clock = ManualClock()
    store = await make_store(clock)
    await store.put("k", _placement(clock, "t1"))
    assert not await store.delete("k", turn="t0")
    assert await store.get("k") is not None
    assert await store.delete("k", turn="t1")
    assert await store.get("k") is None
    assert not await store.delete("k")
    await store.put("k", _placement(clock, "t2", ttl=1.0))
    clock.advance(100.0)
    assert not await store.delete("k")  # past its deadline: nothing live went
    assert await store.size() == 0


async def test_redis_stores_share_state_and_prefixes_isolate(redis_url: str) -> None:
    clock = ManualClock()
    a = RedisStore(redis_url, prefix="x:", clock=clock)
    b = RedisStore(redis_url, prefix="x:", clock=clock)
    other = RedisStore(redis_url, prefix="y:", clock=clock)
    try:
        await a.put("k", _placement(clock))
        assert await b.get("k") == await a.get("k")
        assert await other.get("k") is None
    finally:
        for s in (a, b, other):
            await s.aclose()


async def test_an_unreachable_redis_fails_at_start_with_a_clear_message() -> None:
    with pytest.raises(StoreError, match="cannot reach the Redis state store at redis://"):
        await open_store("redis://127.0.0.1:1/0", max_entries=10, remember_expired=1.0,
                         timeout=0.5)


# The router over both stores.

@pytest.fixture(params=["memory", "redis"])
def state(request: pytest.FixtureRequest) -> str:
    return "memory" if request.param == "memory" else str(
        request.getfixturevalue("redis_url"))


async def test_turns_capture_and_reuse_over_either_store(make_harness: MakeHarness,
                                                         state: str) -> None:
    h = await make_harness(state=state)
    for stream in (False, True):
        first = await h.chat(f"c-{stream}", stream=stream)
        second = await h.chat(f"c-{stream}", stream=stream)
        assert (first.headers["X-KVTurn-Reuse"], second.headers["X-KVTurn-Reuse"]) == (
            "miss", "hit")
    assert await h.router.store.size() == 2
    metrics = (await h.client.get("/metrics")).text
    assert "kvturn_router_conversations 2.0" in metrics


async def test_a_router_restart_keeps_conversations_with_redis(
        make_harness: MakeHarness, redis_url: str) -> None:
    cluster = Cluster(decodes=2)
    clock = ManualClock()
    before = await make_harness(cluster, clock=clock, state=redis_url)
    await before.chat("long-running")
    holder = (await before.router.store.get("-/long-running"))
    assert holder is not None
    await before.router.aclose()

    after = await make_harness(cluster, clock=clock, state=redis_url)
    cluster.log.clear()
    resp = await after.chat("long-running")
    assert resp.headers["X-KVTurn-Reuse"] == "hit"
    [pin] = [e for e in cluster.log if e.path.endswith("/pin")]
    assert pin.backend == f"{holder.decode.split('//')[1].split(':')[0]}.control"


async def test_a_state_store_outage_costs_reuse_not_turns(make_harness: MakeHarness) -> None:
    clock = ManualClock()
    broken = RedisStore("redis://127.0.0.1:1/0", timeout=0.2, clock=clock)
    h = await make_harness(store=broken, clock=clock)
    for stream in (False, True):
        resp = await h.chat("c", stream=stream)
        assert resp.status_code == 200 and resp.headers["X-KVTurn-Reuse"] == "miss"
    metrics = (await h.client.get("/metrics")).text
    assert "kvturn_router_state_errors_total" in metrics
    line = next(x for x in metrics.splitlines()
                if x.startswith("kvturn_router_state_errors_total "))
    assert float(line.split()[1]) >= 4


async def test_put_keeps_the_newest_version(make_store: MakeStore) -> None:
    clock = ManualClock()
    store = await make_store(clock)
    newer = Placement(decode="http://d1:8200", engine_id="e", num_tokens=20,
                      expires_at=clock() + 100, turn="t2", version=clock() + 1.0)
    older = Placement(decode="http://d0:8200", engine_id="e", num_tokens=10,
                      expires_at=clock() + 100, turn="t1", version=clock())
    assert await store.put("k", newer) == 0
    assert await store.put("k", older) == SUPERSEDED
    assert await store.get("k") == newer
    # The same version again (a keepalive renewing the lease) is written.
    renewed = Placement(decode="http://d1:8200", engine_id="e", num_tokens=20,
                        expires_at=clock() + 200, turn="t2", version=clock() + 1.0)
    assert await store.put("k", renewed) == 0
    assert await store.get("k") == renewed
    # A record of an older router (no version) never beats a versioned one.
    assert await store.put("k", _placement(clock, "t0")) == SUPERSEDED


async def test_an_entry_past_its_deadline_does_not_block_an_older_version(
        make_store: MakeStore) -> None:
    clock = ManualClock()
    store = await make_store(clock, remember_expired=0.0)
    await store.put("k", Placement(decode="http://d1:8200", engine_id="e", num_tokens=1,
                                   expires_at=clock() + 1, turn="t2", version=clock() + 50))
    clock.advance(2)
    assert await store.put("k", _placement(clock, "t3")) == 0


async def test_two_replicas_racing_keep_the_newest(redis_url: str) -> None:
    clock = ManualClock()
    routers = [RedisStore(redis_url, prefix="race:", clock=clock) for _ in range(2)]
    try:
        for round_ in range(20):
            key = f"k{round_}"
            offers = [Placement(decode=f"http://d{i}:8200", engine_id="e", num_tokens=i,
                                expires_at=clock() + 100, turn=f"t{i}",
                                version=clock() + (i + round_) % 2)
                      for i in range(2)]
            order = [0, 1] if round_ % 2 else [1, 0]
            await asyncio.gather(*(routers[i].put(key, offers[i]) for i in order))
            newest = max(offers, key=lambda p: p.version)
            assert await routers[0].get(key) == newest
    finally:
        for store in routers:
            await store.aclose()


async def test_a_turn_whose_retention_is_superseded_releases_its_own(
        make_harness: MakeHarness) -> None:
    cluster = Cluster(decodes=2)
    h = await make_harness(cluster)
    await h.chat("c")
    key, first = next((k, d) for d in cluster.decodes for k in d.retentions)
    other = next(d for d in cluster.decodes if d is not first)
    # The next turn decodes on the holder; while it streams, a concurrent turn on another
    # router records a newer retention on the other decode.
    first.gate = asyncio.Event()
    call = AsgiCall(h.app, "POST", "/v1/chat/completions", json.dumps(
        {"model": "m", "messages": [], "stream": True, "conversation_id": "c"}).encode(),
        {"content-type": "application/json"})
    await call.next_body()
    newest = Placement(decode=other.url, engine_id=None, num_tokens=99,
                       expires_at=h.clock() + 100, turn="other-router",
                       version=h.clock() + 10)
    await h.router.store.put(key, newest)
    first.gate.set()
    await call.done()
    await h.router.wait_idle()
    assert await h.router.store.get(key) == newest
    releases = [e for e in cluster.calls(f"{first.name}.control", "DELETE")
                if "/retentions/" in e.path]
    assert len(releases) == 1
    assert not cluster.calls(f"{other.name}.control", "DELETE")
