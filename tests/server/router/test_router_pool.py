"""Backend pools: choice by load and affinity, ejection and re-admission, health checks."""

from __future__ import annotations

import pytest

from kvturn_server.router._pool import Backend, Pool
from tests.fakes.backends import Cluster, wait_for
from tests.fakes.router_harness import MakeHarness


def _pool(n: int = 3) -> Pool:
    return Pool("decode", [Backend("decode", f"http://d{i}") for i in range(n)],
                eject_after=2, readmit_after=2)


def test_pick_prefers_the_healthy_holder_then_the_least_loaded() -> None:
    pool = _pool()
    a, b, c = pool.members
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert pool.pick() is b
    assert pool.pick(prefer=a) is a
    a.healthy = False
    assert pool.pick(prefer=a) is b
    assert pool.pick(exclude=b) is c
    b.healthy = c.healthy = False
    # Everything ejected: the least loaded ejected backend is tried rather than refusing.
    assert pool.pick() is b
    assert pool.pick(exclude=b) is c


def test_pick_gives_none_only_without_another_backend() -> None:
    a = _pool().members[0]
    a.healthy = False
    single = Pool("decode", [a], eject_after=3, readmit_after=2)
    assert single.pick() is a
    assert single.pick(exclude=a) is None


def test_ties_go_round() -> None:
    pool = _pool()
    picks = [pool.pick() for _ in range(6)]
    assert {id(p) for p in picks} == {id(m) for m in pool.members}
    assert all(picks.count(m) == 2 for m in pool.members)


def test_ejection_and_readmission_counts() -> None:
    pool = _pool(1)
    [b] = pool.members
    pool.leg_failed(b, "x")
    assert b.healthy
    pool.leg_succeeded(b)  # a success in between resets the count
    pool.leg_failed(b, "x")
    assert b.healthy
    pool.check_failed(b, "y")
    assert not b.healthy
    pool.check_passed(b)
    assert not b.healthy
    pool.check_failed(b, "y")  # readmission needs consecutive good checks
    pool.check_passed(b)
    assert not b.healthy
    pool.check_passed(b)
    assert b.healthy and b.failures == 0


@pytest.mark.parametrize("mode", ["down", "503"])
async def test_health_checks_eject_and_readmit(make_harness: MakeHarness, mode: str) -> None:
    cluster = Cluster(decodes=2)
    h = await make_harness(cluster)
    sick = cluster.decodes[0]
    sick.health = mode
    await h.router.health.check_all()
    backend = h.router.decodes.by_url(sick.url)
    assert backend is not None and backend.healthy  # one failure is not enough
    await h.router.health.check_all()
    assert not backend.healthy
    for i in range(4):
        await h.chat(f"c{i}")
    assert cluster.bodies(sick.name) == []
    metrics = (await h.client.get("/metrics")).text
    assert f'kvturn_router_backend_healthy{{backend="{sick.url}",role="decode"}} 0.0' in metrics
    assert (await h.client.get("/health")).json()["decode"] == {"healthy": 1, "total": 2}
    sick.health = "ok"
    await h.router.health.check_all()
    assert not backend.healthy
    await h.router.health.check_all()
    assert backend.healthy


async def test_failing_legs_eject_but_500s_do_not(make_harness: MakeHarness) -> None:
    cluster = Cluster(decodes=2)
    h = await make_harness(cluster)
    backend = h.router.decodes.members[0]
    h.router.decodes.members[1].in_flight = 100  # decode0 is always picked first
    cluster.decodes[0].fail_next(("status", 500), ("status", 500), ("status", 500))
    for i in range(3):
        await h.chat(f"a{i}")
    assert backend.healthy
    cluster.decodes[0].fail_next("connect", "connect")
    for i in range(2):
        await h.chat(f"b{i}")
    assert not backend.healthy


async def test_the_health_loop_runs_on_its_interval(make_harness: MakeHarness) -> None:
    cluster = Cluster(prefills=2)
    h = await make_harness(cluster, health_checks=True, health_interval=0.01)
    cluster.prefills[1].health = "down"
    backend = h.router.prefills.members[1]
    await wait_for(lambda: not backend.healthy)
    cluster.prefills[1].health = "ok"
    await wait_for(lambda: backend.healthy)
    assert h.router.health.rounds >= 3


async def test_with_every_prefill_ejected_an_ejected_one_is_still_tried(
        make_harness: MakeHarness) -> None:
    # Ejected by health checks that failed while it was starting, say: it may be back.
    h = await make_harness()
    h.router.prefills.members[0].healthy = False
    assert (await h.client.get("/health")).json()["status"] == "degraded"
    resp = await h.chat("c")
    assert resp.status_code == 200
    assert len(h.cluster.bodies("prefill0")) == 1


async def test_with_every_prefill_down_the_decode_computes(make_harness: MakeHarness) -> None:
    h = await make_harness()
    h.router.prefills.members[0].healthy = False
    h.cluster.prefills[0].fail_next("connect", "connect")
    resp = await h.chat("c")
    assert resp.status_code == 200
    assert h.cluster.bodies("decode0")[0]["kv_transfer_params"] == {
        "do_remote_prefill": False, "kvturn": {"conversation": "-/c"}}


async def test_health_checks_learn_engine_ids_and_control_outages(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    backend = h.router.decodes.members[0]
    await h.router.health.check_all()
    assert backend.engine_id == "decode0-engine-1" and backend.control_ok
    h.cluster.decodes[0].control_health = "down"
    await h.router.health.check_all()
    assert not backend.control_ok and backend.healthy  # it still decodes
    await h.chat("c")
    h.cluster.log.clear()
    resp = await h.chat("c")
    assert resp.status_code == 200 and resp.headers["X-KVTurn-Reuse"] == "stale"
    assert h.cluster.calls("decode0.control") == []


def test_a_request_that_goes_through_readmits_an_ejected_backend() -> None:
    pool = _pool()
    a = pool.members[0]
    for _ in range(pool.eject_after):
        pool.leg_failed(a, "connect")
    assert not a.healthy
    pool.leg_succeeded(a)
    assert a.healthy and a.failures == 0
