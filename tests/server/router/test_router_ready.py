"""``GET /ready``: 200 only with a healthy prefill and decode, after the first health checks,
and not while draining; the body says why not."""

from __future__ import annotations

from tests.fakes.backends import Cluster
from tests.fakes.router_harness import MakeHarness


async def test_ready_follows_backend_health_and_drain(make_harness: MakeHarness) -> None:
    cluster = Cluster(prefills=1, decodes=2)
    h = await make_harness(cluster)
    reply = await h.client.get("/ready")
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"status": "ready", "prefill": {"healthy": 1, "total": 1},
                            "decode": {"healthy": 2, "total": 2}, "draining": False}

    for decode in cluster.decodes:
        decode.health = "down"
    for _ in range(2):  # eject_after = 2
        await h.router.health.check_all()
    reply = await h.client.get("/ready")
    assert reply.status_code == 503
    assert reply.json()["why"] == "no healthy decode backend (2 known, all ejected)"
    assert (await h.client.get("/health")).status_code == 200  # liveness is not readiness

    cluster.decodes[1].health = "ok"
    for _ in range(2):  # readmit_after = 2
        await h.router.health.check_all()
    assert (await h.client.get("/ready")).status_code == 200

    cluster.prefills[0].health = "down"
    for _ in range(2):
        await h.router.health.check_all()
    assert (await h.client.get("/ready")).json()["why"].startswith("no healthy prefill")
    cluster.prefills[0].health = "ok"
    for _ in range(2):
        await h.router.health.check_all()

    h.router.begin_drain("test")
    reply = await h.client.get("/ready")
    assert reply.status_code == 503
    assert reply.json()["draining"] is True
    # Draining takes the router out of rotation; it still serves what reaches it.
    assert (await h.chat()).status_code == 200


async def test_not_ready_until_the_first_health_round(make_harness: MakeHarness) -> None:
    cluster = Cluster()
    cluster.decodes[0].health = "down"
    h = await make_harness(cluster)
    h.router.health.start()  # the loop's first round has not run yet
    reply = await h.client.get("/ready")
    assert reply.status_code == 503
    assert "first health checks" in reply.json()["why"]
    await h.router.health.stop()
