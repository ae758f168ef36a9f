"""One attempt of a turn's leg on one backend: the call, its span and latency, and what a
failure costs the backend (metrics, pool health, a WARNING line).

The turn (``_turn.py``) decides what to try where and what to do with an answer; an attempt
only sends and classifies: a ``Reply`` (any status), an opened stream, or a ``Failed``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvturn_server.router._backend import BackendError, Reply, UpstreamStream
from kvturn_server.router._log import event
from kvturn_server.router._pool import Backend, Pool
from kvturn_server.router._services import TurnContext
from kvturn_server.router._tracing import LegSpan, TurnTrace

log = logging.getLogger("kvturn.router")

# Statuses of a leg that another backend might answer better.
RETRYABLE = frozenset({408, 429})
# Statuses that count against a backend's health (others are about the request).
_UNHEALTHY = frozenset({502, 503, 504})
# Failures before any answer that say the server may be gone, per leg. A decode's "broken"
# too: a kept-alive connection to a killed server reads as a reset, not as a refused connect.
PREFILL_GONE = frozenset({"connect"})
DECODE_GONE = frozenset({"connect", "broken"})


class Failed:
    """A leg that failed: ``kind`` is a BackendError kind or ``status``; ``reply`` the
    backend's answer when it gave one."""

    __slots__ = ("kind", "message", "reply")

    def __init__(self, kind: str, message: str, reply: Reply | None = None) -> None:
        self.kind = kind
        self.message = message
        self.reply = reply


@dataclass(slots=True)
class OpenedStream:
    """A decode stream whose head was 200 and whose first chunk arrived; ``span`` is still
    open and the decodes' pool still counts it in flight (the relay's end closes both:
    ``Pool.leg_ended``)."""

    upstream: UpstreamStream
    first: bytes
    span: LegSpan


class Attempts:
    """One turn's leg attempts: ``path`` is the client's path, ``headers`` what every leg
    carries (its request id; each leg adds its span's trace context)."""

    __slots__ = ("ctx", "headers", "path")

    def __init__(self, ctx: TurnContext, *, path: str, headers: dict[str, str]) -> None:
        self.ctx = ctx
        self.path = path
        self.headers = headers

    def _headers(self, span: LegSpan) -> dict[str, str]:
        return {**self.headers, **span.headers} if span.headers else self.headers

    async def call(self, pool: Pool, backend: Backend, leg: str, data: bytes, *,
                   timeout: float, trace: TurnTrace, t0: float,
                   gone: frozenset[str]) -> Reply | Failed:
        """POST ``data`` and read the whole reply (``t0``: when the leg started)."""
        span = trace.leg(leg, backend.url)
        try:
            with pool.lease(backend):
                reply = await self.ctx.services.client.call(
                    "POST", backend.url + self.path, data, timeout=timeout,
                    headers=self._headers(span))
        except BackendError as exc:
            span.end(exc.kind)
            return self.failed(pool, backend, leg, exc.kind, str(exc), gone=exc.kind in gone)
        finally:
            self.ctx.leg(leg, time.perf_counter() - t0)
        span.end(None if reply.status == 200 else f"status {reply.status}")
        return reply

    async def open_stream(self, backend: Backend, data: bytes, *, trace: TurnTrace,
                          t0: float) -> OpenedStream | Reply | Failed:
        """POST ``data`` to a decode for a stream: opened, or its non-200 reply, or Failed."""
        services = self.ctx.services
        decodes = services.decodes
        decodes.leg_started(backend)
        upstream: UpstreamStream | None = None
        span = trace.leg("decode", backend.url)
        try:
            upstream = await services.client.open_stream(
                backend.url + self.path, data, timeout=services.config.decode_timeout,
                headers=self._headers(span))
            if upstream.status != 200:
                body = await upstream.read_all()
                await upstream.aclose()
                decodes.leg_ended(backend)
                span.end(f"status {upstream.status}")
                return Reply(upstream.status, upstream.content_type, body)
            first = await upstream.next_chunk()
            if first is None:
                raise BackendError("broken", f"{backend.url}: stream ended before any data")
        except BackendError as exc:
            if upstream is not None:
                await upstream.aclose()
            decodes.leg_ended(backend)
            span.end(exc.kind)
            self.ctx.leg("decode", time.perf_counter() - t0)
            return self.failed(decodes, backend, "decode", exc.kind, str(exc),
                               gone=exc.kind in DECODE_GONE)
        return OpenedStream(upstream, first, span)

    def failed(self, pool: Pool, backend: Backend, leg: str, kind: str, message: str,
               reply: Reply | None = None, *, gone: bool | None = None) -> Failed:
        """``gone``: the failure says the server may be gone (default: a refused connection);
        its control endpoint is then distrusted until a health check passes."""
        ctx = self.ctx
        ctx.services.metrics.failure(backend.role, backend.url, kind if reply is None
                                     else f"status_{reply.status}")
        if reply is None or reply.status in _UNHEALTHY:
            pool.leg_failed(backend, f"{leg}: {message}",
                            refused=kind == "connect" if gone is None else gone)
        event(log, logging.WARNING, f"{leg}_attempt_failed", request_id=ctx.request_id,
              conversation=ctx.key, backend=backend.url, kind=kind, error=message)
        return Failed(kind, message, reply)
