"""W3C trace context on every backend leg, and OpenTelemetry spans per leg (``--otel``)."""

from __future__ import annotations

import sys

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvturn_server.router import RouterConfig, RouterConfigError, create_app
from kvturn_server.router._tracing import OtelTracing, incoming_trace
from tests.fakes.backends import Cluster
from tests.fakes.router_harness import TEST_SETTINGS, MakeHarness

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TRACESTATE = "vendor=abc,other=1"


def _leg_headers(cluster: Cluster) -> list[dict[str, str]]:
    return [e.headers for e in cluster.log if e.path.startswith("/v1/")]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_clients_trace_context_reaches_every_leg(make_harness: MakeHarness,
                                                           stream: bool) -> None:
    h = await make_harness()
    for _ in range(2):  # the second turn pins and reads: every kind of leg
        reply = await h.chat("c", stream=stream,
                             headers={"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
        assert reply.status_code == 200
    legs = _leg_headers(h.cluster)
    assert len(legs) == 4  # prefill and decode, twice
    for headers in legs:
        assert headers["traceparent"] == TRACEPARENT
        assert headers["tracestate"] == TRACESTATE


async def test_a_malformed_traceparent_is_dropped_with_its_tracestate(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.chat("c", headers={"traceparent": "00-xyz-00f067aa0ba902b7-01",
                               "tracestate": TRACESTATE})
    await h.chat(headers={})  # and no trace headers at all without one
    for headers in _leg_headers(h.cluster):
        assert "traceparent" not in headers and "tracestate" not in headers


@pytest.mark.parametrize("value", [
    f"ff-{TRACE_ID}-{PARENT_ID}-01", f"00-{'0' * 32}-{PARENT_ID}-01",
    f"00-{TRACE_ID}-{'0' * 16}-01", f"00-{TRACE_ID.upper()}-{PARENT_ID}-01", ""])
def test_invalid_traceparents(value: str) -> None:
    assert incoming_trace({"traceparent": value, "tracestate": TRACESTATE}) == {}


@pytest.mark.parametrize("stream", [False, True])
async def test_otel_exports_a_span_per_leg_in_the_clients_trace(make_harness: MakeHarness,
                                                                stream: bool) -> None:
    h = await make_harness()
    exporter = InMemorySpanExporter()
    h.router.tracing = OtelTracing(exporter)
    await h.chat("c", stream=stream)
    exporter.clear()
    await h.chat("c", stream=stream, headers={"traceparent": TRACEPARENT,
                                              "tracestate": TRACESTATE})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    expected = {"kvturn.pin", "kvturn.prefill", "kvturn.decode"}
    if stream:
        expected.add("kvturn.capture")  # non-streaming replies say what was retained
    assert set(spans) == expected
    for span in spans.values():
        assert span.context is not None and span.parent is not None
        assert f"{span.context.trace_id:032x}" == TRACE_ID
        assert f"{span.parent.span_id:016x}" == PARENT_ID
        assert span.attributes is not None and span.attributes["kvturn.backend"]
        assert span.status.is_ok
    # Each leg carries its own span as the parent of what the backend does.
    prefill, decode = h.cluster.legs("prefill0")[-1], h.cluster.legs("decode0")[-1]
    for entry, name in ((prefill, "kvturn.prefill"), (decode, "kvturn.decode")):
        context = spans[name].context
        assert context is not None
        assert entry.headers["traceparent"] == f"00-{TRACE_ID}-{context.span_id:016x}-01"
        assert entry.headers["tracestate"] == TRACESTATE


async def test_otel_without_a_client_context_gives_each_turn_one_trace(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    exporter = InMemorySpanExporter()
    h.router.tracing = OtelTracing(exporter)
    await h.chat("a")
    await h.chat("b")
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["kvturn.prefill", "kvturn.decode"] * 2
    traces = [s.context.trace_id for s in spans if s.context is not None]
    assert traces[0] == traces[1] != traces[2] == traces[3]


async def test_a_failed_leg_has_an_error_span(make_harness: MakeHarness) -> None:
    h = await make_harness(Cluster(prefills=2))
    exporter = InMemorySpanExporter()
    h.router.tracing = OtelTracing(exporter)
    h.cluster.prefills[0].fail_next("connect")
    h.cluster.prefills[1].fail_next("connect")
    await h.chat("c")
    failed = [s for s in exporter.get_finished_spans() if s.name == "kvturn.prefill"]
    assert failed and all(not s.status.is_ok for s in failed)


def test_otel_without_the_extra_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    cluster = Cluster()
    config = RouterConfig(prefill=cluster.prefill_urls, decode=cluster.decode_urls,
                          otel=True, **TEST_SETTINGS)
    with pytest.raises(RouterConfigError, match=r"pip install 'kvturn\[otel\]'"):
        create_app(config, cluster.transport())


async def test_otel_on_builds_an_otlp_exporter() -> None:
    cluster = Cluster()
    config = RouterConfig(prefill=cluster.prefill_urls, decode=cluster.decode_urls,
                          otel=True, **TEST_SETTINGS)
    app = create_app(config, cluster.transport())
    assert app.router.tracing.enabled
    app.router.tracing.shutdown()
