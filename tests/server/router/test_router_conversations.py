"""Keepalive and release of a conversation, forwarded to the decode that holds it."""

from __future__ import annotations

from urllib.parse import quote

import pytest

from tests.fakes.backends import Cluster
from tests.fakes.router_harness import MakeHarness


def _path(conversation: str, suffix: str = "") -> str:
    return f"/kvturn/v1/conversations/{quote(conversation, safe='')}{suffix}"


@pytest.fixture(params=["memory", "redis"])
def state(request: pytest.FixtureRequest) -> str:
    return "memory" if request.param == "memory" else str(
        request.getfixturevalue("redis_url"))


async def test_keepalive_renews_on_the_holding_decode(make_harness: MakeHarness,
                                                      state: str) -> None:
    cluster = Cluster(decodes=2)
    h = await make_harness(cluster, state=state)
    await h.chat("a/b")
    [holder] = [d for d in cluster.decodes if "-/a/b" in d.retentions]
    holder.retentions["-/a/b"].expires_in = 12.0
    h.clock.advance(100)
    resp = await h.client.post(_path("a/b", "/keepalive"))
    assert resp.status_code == 200
    assert resp.json() == {"conversation_id": "a/b", "retained": True, "expires_in": 480.0,
                           "hold_remaining": 3000.0, "num_tokens": 100}
    [call] = cluster.calls(f"{holder.name}.control", "POST")
    assert call.path == "/kvturn/v1/retentions/-/a/b/keepalive"
    placement = await h.router.store.get("-/a/b")
    assert placement is not None and placement.expires_at == h.clock() + 480.0


async def test_keepalive_of_an_unknown_conversation_is_a_404(make_harness: MakeHarness) -> None:
    h = await make_harness()
    resp = await h.client.post(_path("nope", "/keepalive"))
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "no_retention"
    assert resp.headers["x-should-retry"] == "false"
    assert h.cluster.log == []


async def test_keepalive_of_an_expired_retention_is_a_404_and_marks_it_lost(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.chat("c")
    h.cluster.decodes[0].expire("-/c")
    resp = await h.client.post(_path("c", "/keepalive"))
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "expired"
    # The decode and the prefill that served it stay known (affinity), the record lost.
    record = await h.router.store.get("-/c")
    assert record is not None and not record.retained and record.lost == "expired"


async def test_keepalive_after_a_decode_restart_is_stale(make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.router.health.check_all()
    await h.chat("c")
    h.cluster.decodes[0].restart()
    await h.router.health.check_all()
    resp = await h.client.post(_path("c", "/keepalive"))
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "stale"


async def test_keepalive_with_the_decode_unreachable_is_retryable(
        make_harness: MakeHarness) -> None:
    h = await make_harness(retry_after=2)
    await h.chat("c")
    h.cluster.decodes[0].control_fail_next("connect")
    resp = await h.client.post(_path("c", "/keepalive"))
    assert resp.status_code == 503
    assert resp.headers["x-should-retry"] == "true" and resp.headers["Retry-After"] == "2"
    assert await h.router.store.get("-/c") is not None
    # As a pin that found it unreachable would: the endpoint is out of use (no pins, no
    # captures, no further keepalives) until a health check finds it answering, and counted.
    decode = h.router.decodes.by_url(h.cluster.decode_urls[0])
    assert decode is not None and not decode.control_ok and not decode.control_trusted
    assert h.router.metrics.registry.get_sample_value(
        "kvturn_router_backend_failures_total",
        {"role": "control", "backend": decode.url, "kind": "connect"}) == 1
    resp = await h.client.post(_path("c", "/keepalive"))
    assert resp.status_code == 503
    await h.router.health.check_all()
    assert decode.control_trusted
    assert (await h.client.post(_path("c", "/keepalive"))).status_code == 200


async def test_a_release_the_decode_does_not_answer_takes_its_control_endpoint_out_of_use(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.chat("c")
    h.cluster.decodes[0].control_fail_next("connect")
    assert (await h.client.delete(_path("c"))).status_code == 503
    decode = h.router.decodes.by_url(h.cluster.decode_urls[0])
    assert decode is not None and not decode.control_ok


async def test_release_is_idempotent(make_harness: MakeHarness, state: str) -> None:
    h = await make_harness(state=state)
    await h.chat("c")
    resp = await h.client.delete(_path("c"))
    assert resp.status_code == 200
    assert resp.json() == {"conversation_id": "c", "released": True}
    assert "-/c" not in h.cluster.decodes[0].retentions
    assert await h.router.store.get("-/c") is None
    again = await h.client.delete(_path("c"))
    assert again.json() == {"conversation_id": "c", "released": False}
    # The next turn starts over.
    assert (await h.chat("c")).headers["X-KVTurn-Reuse"] == "miss"


async def test_release_of_a_retention_the_decode_already_dropped(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.chat("c")
    h.cluster.decodes[0].expire("-/c")
    resp = await h.client.delete(_path("c"))
    assert resp.json() == {"conversation_id": "c", "released": False}
    assert await h.router.store.get("-/c") is None


async def test_conversation_endpoints_are_tenant_scoped(make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.chat("c", headers={"Authorization": "Bearer alice"})
    resp = await h.client.post(_path("c", "/keepalive"),
                               headers={"Authorization": "Bearer mallory"})
    assert resp.status_code == 404
    resp = await h.client.delete(_path("c"), headers={"Authorization": "Bearer mallory"})
    assert resp.json()["released"] is False
    assert len(h.cluster.decodes[0].retentions) == 1
    resp = await h.client.post(_path("c", "/keepalive"),
                               headers={"Authorization": "Bearer alice"})
    assert resp.status_code == 200


@pytest.mark.parametrize("bad", ["", "has%20space", "x" * 300])
async def test_conversation_endpoints_validate_ids(make_harness: MakeHarness, bad: str) -> None:
    h = await make_harness()
    resp = await h.client.delete(f"/kvturn/v1/conversations/{bad}")
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "conversation_id"


async def test_unknown_conversation_routes_are_404(make_harness: MakeHarness) -> None:
    h = await make_harness()
    resp = await h.client.post("/kvturn/v1/conversations/c/renew")
    assert resp.status_code == 404


async def test_a_gone_code_the_router_does_not_know_goes_no_further(
        make_harness: MakeHarness) -> None:
    # A decode's raw word never reaches the client's error code or a metric label: an unknown
    # one (a newer connector's, or garbage) is read as no_retention.
    h = await make_harness()
    await h.chat("c")
    decode = h.cluster.decodes[0]
    decode.retentions.pop("-/c")
    decode.gone["-/c"] = "shredded by=\"x\""
    resp = await h.client.post(_path("c", "/keepalive"))
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "no_retention"
    registry = h.router.metrics.registry
    assert registry.get_sample_value("kvturn_router_stale_handles_total",
                                     {"reason": "no_retention"}) == 1
    reasons = {s.labels.get("reason") for m in registry.collect() for s in m.samples
               if s.name == "kvturn_router_stale_handles_total"}
    assert reasons == {"no_retention"}
