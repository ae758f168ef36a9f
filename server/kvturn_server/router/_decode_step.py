"""Step 4 of a turn: the decode leg, and the client's answer from it.

The turn (``_turn.py``) hands the step the decode's request body; the step picks the decode
(the conversation's holder when healthy, ``_placement.py``), retries once on another decode
when the first failed before its first byte, and answers the client: a reply with the decode's
transfer params taken out, or a stream relayed unbuffered (``_stream.py``). Either way the
capture (``_capture.py``) follows. When both attempts fail the client gets the decode's own
error reply or an OpenAI-shaped 502/504; a holder that went down takes its handle with it.

``not_ok`` is shared with the prefill leg: a 4xx is the request's own fault, returned as is.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from starlette.responses import Response

from kvturn.wire import ReuseReason
from kvturn_server.router import _json
from kvturn_server.router._apis import Api
from kvturn_server.router._attempts import DECODE_GONE, RETRYABLE, Attempts, Failed, OpenedStream
from kvturn_server.router._backend import Reply
from kvturn_server.router._capture import Capture
from kvturn_server.router._errors import error_response, retry_headers
from kvturn_server.router._legs import without_transfer_params
from kvturn_server.router._pin import Pins
from kvturn_server.router._placement import choose_decode
from kvturn_server.router._pool import Backend, Pool
from kvturn_server.router._services import TurnReport
from kvturn_server.router._state import Placement
from kvturn_server.router._stream import RelayResponse, StreamEnd, UsageTap
from kvturn_server.router._tracing import TurnTrace


class ReplyHook(Protocol):
    """What an API that keeps state of its own (Responses) does with a turn's answer, before
    the client has it: ``reply`` gets a non-streaming reply (and returns what the client
    gets), ``final_event`` a stream's final event (held back until it returns)."""

    async def reply(self, payload: dict[str, Any]) -> dict[str, Any]: ...

    async def final_event(self, event: bytes) -> None: ...


def not_ok(attempts: Attempts, report: TurnReport, pool: Pool, backend: Backend, leg: str,
           reply: Reply | Failed) -> Response | Failed:
    """A leg that did not answer 200: a 4xx is the request's own fault (unknown model, bad
    parameter: any backend would refuse it the same way), so the client gets it now;
    others are failures to retry."""
    if isinstance(reply, Failed):
        return reply
    if 400 <= reply.status < 500 and reply.status not in RETRYABLE:
        attempts.ctx.services.metrics.request(report.endpoint, "client_error")
        report.log_done(reply.status, "client_error")
        headers = report.headers()
        headers.update(retry_headers(None))
        return Response(reply.body, status_code=reply.status, headers=headers,
                        media_type=reply.content_type)
    return attempts.failed(pool, backend, leg, "status", f"answered {reply.status}", reply)


class DecodeStep:
    """One turn's decode leg.

    Args:
        attempts: the turn's leg attempts (its context, path and request id).
        report: the turn's report: the step sets the decode that answered and the reuse it
            found or lost; the client's headers are read from it when the step answers.
        trace: the turn's trace.
        api: the turn's API (how a stream's final event and an error event look).
        hook: what an API that keeps state of its own does with the answer.
        capture: the turn's capture; None for a turn with no conversation key.
        retains: the decode is asked to retain this turn (the step then captures it; a keyed
            turn that is not retained only remembers its decode, for affinity).
        pins: the turn's pins, to drop the handle of a holder that went down.
        holder: the decode holding the conversation, None when none does.
        placement: the conversation's record the turn found, None when none.
        strip_usage: the leg's body asked for the decode's usage on the router's behalf
            (the client did not): a stream's usage event is cut out of the client's stream.
    """

    __slots__ = ("api", "attempts", "capture", "holder", "hook", "pins", "placement",
                 "report", "retains", "strip_usage", "trace")

    def __init__(self, attempts: Attempts, report: TurnReport, trace: TurnTrace, *, api: Api,
                 hook: ReplyHook | None, capture: Capture | None, retains: bool, pins: Pins,
                 holder: Backend | None, placement: Placement | None,
                 strip_usage: bool = False) -> None:
        self.attempts = attempts
        self.report = report
        self.trace = trace
        self.api = api
        self.hook = hook
        self.capture = capture
        self.retains = retains
        self.pins = pins
        self.holder = holder
        self.placement = placement
        self.strip_usage = strip_usage

    async def run(self, data: bytes) -> Response:
        """Send ``data`` to a decode, and once more to another when that failed before its
        first byte; the client's answer either way."""
        svc = self.attempts.ctx.services
        report = self.report
        backend = choose_decode(svc.decodes, self.holder, slack=svc.config.decode_affinity_slack)
        if backend is None:
            report.count()
            svc.metrics.request(report.endpoint, "backend_error")
            return error_response(503, "no decode backend is healthy", type_="server_error",
                                  code="no_backend", retry_after=svc.config.retry_after,
                                  headers=report.headers())
        for attempt in (0, 1):
            result = await self.attempt(backend, data)
            if not isinstance(result, Failed):
                report.count()
                return result
            other = svc.decodes.pick(exclude=backend)
            if other is None and result.kind == "connect":
                other = backend
            if attempt == 1 or other is None:
                return self._gave_up(result)
            svc.metrics.retry("decode")
            backend = other
        raise AssertionError("unreachable")  # pragma: no cover

    async def attempt(self, backend: Backend, data: bytes) -> Response | Failed:
        """One decode attempt: the client's answer, or Failed when nothing reached it."""
        return await (self._open_stream(backend, data) if self.report.stream
                      else self._reply_on(backend, data))

    def _gave_up(self, failed: Failed) -> Response:
        svc = self.attempts.ctx.services
        report = self.report
        holder = self.holder
        if holder is not None and holder.http_down:
            # The conversation's decode failed to answer (killed, its engine core orphaned):
            # nothing of what was read or held reached the client, and its retentions are
            # about to go with it. Not a hit, whatever served the prompt; the handle is
            # dropped, the next turn recomputes.
            report.reason = ReuseReason.STALE
            report.reused_tokens = 0
            if self.placement is not None:
                self.pins.drop(self.placement, "decode_failed")
        report.count()
        svc.metrics.request(report.endpoint, "backend_error")
        report.log_done(failed.reply.status if failed.reply else 0, "backend_error")
        if failed.reply is not None:
            headers = report.headers()
            headers.update(retry_headers(svc.config.retry_after))
            return Response(failed.reply.body, status_code=failed.reply.status,
                            headers=headers, media_type=failed.reply.content_type)
        timeout = failed.kind == "timeout"
        return error_response(
            504 if timeout else 502, "the decode backend timed out before answering" if timeout
            else f"the decode backend failed before answering ({failed.kind})",
            type_="server_error", code="backend_timeout" if timeout else "backend_unavailable",
            retry_after=svc.config.retry_after, headers=report.headers())

    async def _reply_on(self, backend: Backend, data: bytes) -> Response | Failed:
        svc = self.attempts.ctx.services
        report = self.report
        t0 = time.perf_counter()
        reply = await self.attempts.call(svc.decodes, backend, "decode", data,
                                         timeout=svc.config.decode_timeout, trace=self.trace,
                                         t0=t0, gone=DECODE_GONE)
        if isinstance(reply, Failed) or reply.status != 200:
            return not_ok(self.attempts, report, svc.decodes, backend, "decode", reply)
        svc.decodes.leg_succeeded(backend)
        report.decode = backend
        content = reply.body
        try:
            payload = reply.json()
        except ValueError:
            payload = None
        if isinstance(payload, dict):
            report.usage = self.api.usage(payload)
            own = None
            if self.capture is not None and self.retains:
                own = await self.capture.from_reply(backend, payload, t0, report.usage)
            elif self.capture is not None:
                await self.capture.remember_affinity(backend, report.usage)
            # A continued turn's reuse, from what the decode says its cache supplied (the
            # headers of a non-streaming reply are still to be sent).
            report.settle(own)
            # Block ids and hosts of the decode are the router's business, not the client's.
            payload, found = without_transfer_params(payload)
            if self.hook is not None:
                payload = await self.hook.reply(payload)
                found = True
            if found:
                content = _json.dumps(payload)
        svc.metrics.request(report.endpoint, "ok")
        report.log_done(200, "ok")
        return Response(content, status_code=200, headers=report.headers(),
                        media_type=reply.content_type)

    async def _open_stream(self, backend: Backend, data: bytes) -> Response | Failed:
        ctx = self.attempts.ctx
        svc = ctx.services
        report = self.report
        t0 = time.perf_counter()
        opened = await self.attempts.open_stream(backend, data, trace=self.trace, t0=t0)
        if not isinstance(opened, OpenedStream):
            return not_ok(self.attempts, report, svc.decodes, backend, "decode", opened)
        upstream, first, span = opened.upstream, opened.first, opened.span
        now = time.perf_counter()
        ctx.leg("decode", now - t0)
        svc.metrics.ttft.observe(now - report.started)
        svc.decodes.leg_succeeded(backend)
        report.decode = backend
        decode_started = t0
        captured = False
        hook, capturing, retains = self.hook, self.capture, self.retains
        tap = UsageTap(strip=self.strip_usage)

        async def capture(final: bytes = b"") -> None:
            nonlocal captured
            if not captured:
                captured = True
                report.usage = self.api.usage(tap.event(final))
                report.settle()
                # Before [DONE]: the client's next turn must find this turn recorded.
                if capturing is not None and retains:
                    await capturing.described(backend, decode_started, report.usage)
                elif capturing is not None:
                    await capturing.remember_affinity(backend, report.usage)
            if final and hook is not None:
                await hook.final_event(final)

        async def finish(end: StreamEnd) -> None:
            svc.decodes.leg_ended(backend)
            span.end(None if end.error is None else end.error.kind)
            if end.error is not None:
                self.attempts.failed(svc.decodes, backend, "decode", end.error.kind,
                                     str(end.error))
            await capture()  # a stream that did not complete: the decode may still hold KV
            report.count(at_end=True)
            svc.metrics.request(report.endpoint, end.outcome)
            report.log_done(200, end.outcome)

        media_type = upstream.content_type or "text/event-stream"
        report.relaying()
        return RelayResponse(upstream, first, report.headers(), media_type, finish,
                             before_done=capture, split_final=self.api.split_final,
                             error_event=self.api.error_event, usage=tap)
