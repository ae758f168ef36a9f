"""W3C trace context on the backend legs, and (``--otel``) an OpenTelemetry span per leg.

- **Propagation, always**: a client's ``traceparent`` (and its ``tracestate``) is passed on to
  every prefill and decode leg, so vLLM's own spans (``--otlp-traces-endpoint``) join the
  client's trace. A malformed ``traceparent`` is dropped, with its ``tracestate``, as the W3C
  spec asks.
- **Spans, with the ``kvturn[otel]`` extra and ``otel = true``**: one CLIENT span per leg
  (``kvturn.pin``, ``kvturn.prefill``, ``kvturn.decode``: to the end of a stream,
  ``kvturn.capture``), a child of the client's trace context; the ``traceparent`` sent on a
  leg then names that leg's span, so the backend's spans nest under it. A turn without a
  client context gets one trace of its own (the legs' parent is then a span id that the router
  does not export). Spans go over OTLP/HTTP, configured by the standard ``OTEL_*`` variables
  (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER``, ...).

The turn code sees only ``TurnTrace.leg(...) -> LegSpan``: headers to send, then ``end``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any, Protocol

from kvturn_server.router._config import RouterConfigError

log = logging.getLogger("kvturn.router")

_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_MAX_TRACESTATE = 512  # the spec's limit a propagator must accept


def incoming_trace(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's W3C trace headers worth passing on: a well-formed ``traceparent``
    (version not ``ff``, ids not all zero) and, with it, a sane ``tracestate``."""
    parent = headers.get("traceparent", "").strip()
    if not _TRACEPARENT.fullmatch(parent) or parent.startswith("ff") \
            or parent[3:35] == "0" * 32 or parent[36:52] == "0" * 16:
        return {}
    out = {"traceparent": parent}
    state = headers.get("tracestate", "").strip()
    if state and len(state) <= _MAX_TRACESTATE and state.isascii() and state.isprintable():
        out["tracestate"] = state
    return out


class LegSpan(Protocol):
    """One backend leg's span: ``headers`` go on the leg's request; ``end`` once it is over."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def end(self, error: str | None = None) -> None: ...


class TurnTrace(Protocol):
    def leg(self, name: str, backend: str) -> LegSpan: ...


class Tracing(Protocol):
    enabled: bool

    def turn(self, incoming: Mapping[str, str], request_id: str) -> TurnTrace: ...

    def shutdown(self) -> None: ...


class _Passed:
    """No spans: every leg carries the client's trace headers as they came."""

    __slots__ = ("headers",)

    def __init__(self, headers: Mapping[str, str]) -> None:
        self.headers = headers

    def leg(self, name: str, backend: str) -> LegSpan:
        return self

    def end(self, error: str | None = None) -> None:
        return None


class PassThrough:
    """Tracing off (the default): propagation only."""

    enabled = False
    _NONE = _Passed({})

    def turn(self, incoming: Mapping[str, str], request_id: str) -> TurnTrace:
        return _Passed(incoming) if incoming else self._NONE

    def shutdown(self) -> None:
        return None


class OtelTracing:
    """Spans per leg through a private TracerProvider (not the process-global one, which
    another library in the process may own).

    Args:
        exporter: where spans go (default: OTLP/HTTP from the ``OTEL_*`` variables); tests
            pass an in-memory one, exported synchronously.
    """

    enabled = True

    def __init__(self, exporter: Any = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
            if exporter is None:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
        except ImportError as exc:
            raise RouterConfigError(
                f"--otel (KVTURN_OTEL) needs the OpenTelemetry SDK and OTLP exporter: pip "
                f"install 'kvturn[otel]' ({exc})") from exc
        resource = Resource.create(
            {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "kvturn-router"})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter()) if exporter is None
            else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("kvturn.router")
        self.propagator = TraceContextTextMapPropagator()

    def turn(self, incoming: Mapping[str, str], request_id: str) -> TurnTrace:
        return _OtelTurn(self, incoming, request_id)

    def shutdown(self) -> None:
        """Export what is buffered (the router's shutdown)."""
        self.provider.shutdown()


class _OtelTurn:
    __slots__ = ("context", "request_id", "tracing")

    def __init__(self, tracing: OtelTracing, incoming: Mapping[str, str],
                 request_id: str) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self.tracing = tracing
        self.request_id = request_id
        context = tracing.propagator.extract(dict(incoming)) if incoming else None
        if not trace.get_current_span(context).get_span_context().is_valid:
            ids = RandomIdGenerator()
            parent = trace.SpanContext(trace_id=ids.generate_trace_id(),
                                       span_id=ids.generate_span_id(), is_remote=True,
                                       trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
            context = trace.set_span_in_context(trace.NonRecordingSpan(parent))
        self.context = context

    def leg(self, name: str, backend: str) -> LegSpan:
        from opentelemetry import trace

        span = self.tracing.tracer.start_span(
            f"kvturn.{name}", context=self.context, kind=trace.SpanKind.CLIENT,
            attributes={"kvturn.leg": name, "kvturn.backend": backend,
                        "kvturn.request_id": self.request_id})
        headers: dict[str, str] = {}
        self.tracing.propagator.inject(headers, context=trace.set_span_in_context(span))
        return _OtelLeg(span, headers)


class _OtelLeg:
    __slots__ = ("headers", "span")

    def __init__(self, span: Any, headers: dict[str, str]) -> None:
        self.span = span
        self.headers = headers

    def end(self, error: str | None = None) -> None:
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()


def make_tracing(enabled: bool) -> Tracing:
    """The router's tracing for ``otel = enabled``; RouterConfigError without the extra."""
    return OtelTracing() if enabled else PassThrough()
