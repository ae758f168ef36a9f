"""GET /metrics: every metric the router promises, in Prometheus text format."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.backends import Cluster
from tests.fakes.router_harness import MakeHarness


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_cover_requests_reuse_latency_health_and_table(
        make_harness: MakeHarness) -> None:
    h = await make_harness(Cluster(decodes=2))
    await h.chat("c")
    await h.chat("c")
    await h.chat("c", stream=True)
    await h.chat(None)
    await h.client.post("/v1/chat/completions", content=b"nope")
    resp = await h.client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    s = _samples(resp.text)
    assert s[("kvturn_router_requests_total", (("endpoint", "chat"), ("outcome", "ok")))] == 4
    assert s[("kvturn_router_requests_total",
              (("endpoint", "chat"), ("outcome", "invalid")))] == 1
    assert s[("kvturn_router_reuse_total", (("outcome", "hit"),))] == 2
    assert s[("kvturn_router_reuse_total", (("outcome", "miss"),))] == 2
    assert s[("kvturn_router_reused_tokens_total", ())] == 96
    assert s[("kvturn_router_ttft_seconds_count", ())] == 1
    assert s[("kvturn_router_leg_seconds_count", (("leg", "prefill"),))] == 4
    assert s[("kvturn_router_leg_seconds_count", (("leg", "decode"),))] == 4
    assert s[("kvturn_router_leg_seconds_count", (("leg", "pin"),))] == 2
    assert s[("kvturn_router_leg_seconds_count", (("leg", "capture"),))] == 1
    assert s[("kvturn_router_captures_total", (("outcome", "recorded"),))] == 3
    assert s[("kvturn_router_conversations", ())] == 1
    for url in h.cluster.decode_urls:
        labels = (("backend", url), ("role", "decode"))
        assert s[("kvturn_router_backend_healthy", labels)] == 1
        assert s[("kvturn_router_backend_in_flight", labels)] == 0
    for name in ("requests", "reuse", "reused_tokens", "ttft_seconds", "leg_seconds",
                 "retries", "backend_failures", "backend_healthy", "backend_in_flight",
                 "stale_handles", "captures", "conversations", "conversation_evictions",
                 "state_errors"):
        assert f"# HELP kvturn_router_{name}" in resp.text, name


async def test_failures_and_evictions_are_counted(make_harness: MakeHarness) -> None:
    h = await make_harness(Cluster(prefills=2), max_conversations=1)
    h.router.prefills.members[1].in_flight = 1
    h.cluster.prefills[0].fail_next("connect")
    await h.chat("a")
    await h.chat("b")
    s = _samples((await h.client.get("/metrics")).text)
    assert s[("kvturn_router_retries_total", (("leg", "prefill"),))] == 1
    assert s[("kvturn_router_backend_failures_total",
              (("backend", h.cluster.prefills[0].url), ("kind", "connect"),
               ("role", "prefill")))] == 1
    assert s[("kvturn_router_conversation_evictions_total", ())] == 1
    assert s[("kvturn_router_conversations", ())] == 1
