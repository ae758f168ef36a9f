"""A decode's control endpoint is trusted only while it speaks for the engine behind its HTTP
endpoint (``Backend.control_trusted``).

The case that made this necessary, on the real stack: ``kill -9`` of a decode's API server
leaves vLLM's engine core alive for minutes, and the control endpoint (and NIXL) live in it. The
control endpoint kept answering: keepalives said ``retained: true``, a turn pinned blocks of the
dead server, the prefill read them and the router reported ``hit`` while the client got a 502.
Here the fake decode's HTTP side refuses connections while its control side answers, as then.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.fakes.backends import Cluster
from tests.fakes.router_harness import MakeHarness


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _kill_api_server(cluster: Cluster, how: str = "connect") -> None:
    """The decode's HTTP side is gone; its engine core (control endpoint) answers on. A leg
    finds the port refusing (``connect``), or a kept-alive connection reset (``broken``: what
    the real stack showed)."""
    decode = cluster.decodes[0]
    decode.health = "down"
    decode.fail_next(*[how] * 8)


def _pins(cluster: Cluster) -> int:
    return len([e for e in cluster.log if e.backend == "decode0.control"
                and e.path.endswith("/pin")])


async def test_once_a_check_finds_the_http_side_gone_nothing_is_pinned_or_renewed(
        make_harness: MakeHarness) -> None:
    cluster = Cluster()
    h = await make_harness(cluster)
    await h.router.health.check_all()
    assert (await h.chat("c")).status_code == 200
    assert (await h.chat("c")).headers["X-KVTurn-Reuse"] == "hit"
    pins = _pins(cluster)
    _kill_api_server(cluster)
    await h.router.health.check_all()
    backend = h.router.decodes.members[0]
    assert backend.healthy  # not ejected yet (eject_after 2): the control side still answers
    assert backend.control_ok and not backend.control_trusted
    keepalive = await h.client.post("/kvturn/v1/conversations/c/keepalive")
    assert keepalive.status_code == 503  # not "retained: true"
    assert not any(e.path.endswith("/keepalive") for e in cluster.log)
    resp = await h.chat("c")
    assert resp.status_code in (502, 503)
    assert resp.headers["X-KVTurn-Reuse"] == "stale"
    assert resp.headers["X-KVTurn-Reused-Tokens"] == "0"
    assert _pins(cluster) == pins  # no pin of the dead server's blocks
    assert await h.router.store.get("-/c") is None  # nor a handle to them


@pytest.mark.parametrize("how", ["connect", "broken"])
async def test_a_death_between_two_checks_is_not_reported_as_a_hit(
        make_harness: MakeHarness, how: str) -> None:
    cluster = Cluster()
    h = await make_harness(cluster)
    await h.router.health.check_all()
    await h.chat("c")
    _kill_api_server(cluster, how)  # no health check sees it before the next turn
    resp = await h.chat("c")
    # The pin and the prefill's read went through (the engine core still serves them), the
    # decode leg did not: the client got no answer, and the turn is no hit.
    assert _pins(cluster) == 1
    assert resp.status_code in (502, 503)
    assert (resp.headers["X-KVTurn-Reuse"], resp.headers["X-KVTurn-Reused-Tokens"]) == (
        "stale", "0")
    metrics = (await h.client.get("/metrics")).text
    assert _metric(metrics, "kvturn_router_reuse_total", reason="hit") == 0
    assert await h.router.store.get("-/c") is None  # the handle to the dead server is gone
    # The next turn pins nothing there: the refused connection says the server is gone.
    resp = await h.chat("c")
    assert resp.status_code in (502, 503) and _pins(cluster) == 1


async def test_after_a_restart_the_next_turn_recomputes_and_the_one_after_reuses(
        make_harness: MakeHarness) -> None:
    cluster = Cluster()
    h = await make_harness(cluster)
    await h.router.health.check_all()
    await h.chat("c")
    _kill_api_server(cluster)
    await h.router.health.check_all()
    assert (await h.chat("c")).status_code in (502, 503)
    decode = cluster.decodes[0]
    decode.script.clear()
    decode.restart()  # the supervisor restarted it: a new engine on the same ports
    decode.health = "ok"
    for _ in range(2):  # readmit_after
        await h.router.health.check_all()
    assert h.router.decodes.members[0].control_trusted
    resp = await h.chat("c")
    assert resp.status_code == 200 and resp.headers["X-KVTurn-Reuse"] in ("stale", "miss")
    resp = await h.chat("c")
    assert resp.status_code == 200 and resp.headers["X-KVTurn-Reuse"] == "hit"


async def test_a_control_endpoint_naming_another_engine_is_not_trusted(
        make_harness: MakeHarness) -> None:
    """The HTTP side's replies name one engine, the control endpoint another (an orphaned
    engine core on the control port, a decode started with another control port): no pins."""
    cluster = Cluster()
    h = await make_harness(cluster)
    await h.router.health.check_all()
    decode = cluster.decodes[0]
    decode.reply_engine_id = "someone-else"
    assert (await h.chat("c")).status_code == 200
    backend = h.router.decodes.members[0]
    assert backend.http_engine_id == "someone-else"
    assert backend.control_engine_id == "decode0-engine-1"
    assert not backend.control_trusted
    pins = _pins(cluster)
    resp = await h.chat("c")
    assert resp.status_code == 200 and resp.headers["X-KVTurn-Reuse"] == "stale"
    assert _pins(cluster) == pins
    # When the two agree again, reuse resumes.
    decode.reply_engine_id = None
    await h.chat("c")
    assert backend.control_trusted
    assert (await h.chat("c")).headers["X-KVTurn-Reuse"] == "hit"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_pin_answer_naming_another_engine_is_unpinned(
        make_harness: MakeHarness, stream: bool) -> None:
    cluster = Cluster()
    h = await make_harness(cluster)
    await h.router.health.check_all()
    await h.chat("c")  # the reply names decode0-engine-1
    decode = cluster.decodes[0]
    # The control endpoint now belongs to another engine that holds the same key (as a fake
    # can): its pin answer names that engine.
    decode.engine_id = "decode0-engine-other"
    for retention in decode.retentions.values():
        retention.engine_id = decode.engine_id
    h.router.decodes.members[0].engine_id = None  # so that only the tie can tell
    placement = await h.router.store.get("-/c")
    assert placement is not None
    await h.router.store.put("-/c", replace(placement, engine_id=None))
    resp = await h.chat("c", stream=stream)
    assert resp.headers["X-KVTurn-Reuse"] != "hit"
    assert decode.pins == {}  # the pin it took was given back


async def test_a_dead_holder_is_no_hit_even_when_no_pin_was_taken(
        make_harness: MakeHarness) -> None:
    """On the real stack the pin can be skipped (the prefill's own cache covers what the
    retention offers, or its read floor says reading is not worth it) and the turn reports the
    prefill's own coverage: a 502 from the dead holder is still no hit."""
    cluster = Cluster()
    cluster.prefills[0].prompt_tokens = 33
    h = await make_harness(cluster)
    await h.router.health.check_all()
    await h.chat("c")
    placement = await h.router.store.get("-/c")
    assert placement is not None
    # No pin (the prefill's read floor is above the gain); its own cache reports a hit.
    h.router.prefills.members[0].read_floor = 10**6
    h.router.prefills.members[0].read_floor_at = 10**12
    cluster.prefills[0].report = {"reason": "hit", "reused_tokens": 0, "local_tokens": 32}
    _kill_api_server(cluster, "broken")
    resp = await h.chat("c")
    assert resp.status_code in (502, 503)
    assert (resp.headers["X-KVTurn-Reuse"], resp.headers["X-KVTurn-Reused-Tokens"]) == (
        "stale", "0")
