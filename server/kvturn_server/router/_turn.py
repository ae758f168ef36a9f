"""One turn: pin -> prefill leg -> unpin -> decode leg -> capture (docs/http-api.md, B).

This is where the decision to reuse is made and where every fault degrades:

- **Pin** the conversation's retention on the decode that holds it (``_pin.py``); any
  failure means "nothing to reuse this turn" (reported in ``X-KVTurn-Reuse``).
- **Prefill leg** on the prefill ``_placement.py`` chooses; a failure (transport, timeout,
  5xx, 408/429, an answer without transfer params) is retried once on another prefill; if
  that fails too, the decode computes the prompt itself. A 4xx is the client's mistake and is
  returned as is. Each attempt of a leg is one call of ``_attempts.py``.
- **Unpin** once the prefill answered, off the request path. After a prefill timeout the pin is
  left to expire (that prefill may still be reading) and a retry takes a new one.
- **Decode leg** on the holder (affinity) when healthy, else the least loaded decode; or, when
  the part the holder lacks is short, on the holder alone with no prefill leg. A failure
  before the first byte is retried once on another decode; streams are relayed unbuffered
  (``_stream.py``); a stream that breaks ends with an error event.
- **Capture** what the decode retained and record it (``_capture.py``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from starlette.responses import Response

from kvturn_server.router import _json
from kvturn_server.router._apis import CHAT, Api
from kvturn_server.router._attempts import (
    DECODE_GONE,
    PREFILL_GONE,
    RETRYABLE,
    Attempts,
    Failed,
    OpenedStream,
)
from kvturn_server.router._backend import Reply
from kvturn_server.router._capture import Capture
from kvturn_server.router._control import Retention
from kvturn_server.router._errors import error_response, retry_headers
from kvturn_server.router._history import Transcript
from kvturn_server.router._identity import Identity
from kvturn_server.router._legs import (
    decode_body,
    local_coverage,
    reuse_report,
    without_transfer_params,
)
from kvturn_server.router._log import event
from kvturn_server.router._pin import Pins
from kvturn_server.router._placement import (
    choose_decode,
    choose_prefill,
    continuation,
    learn_read_floor,
    read_floor,
    read_gain,
)
from kvturn_server.router._pool import Backend, Pool
from kvturn_server.router._services import TurnContext, TurnServices
from kvturn_server.router._state import Placement
from kvturn_server.router._stream import RelayResponse, StreamEnd
from kvturn_server.router._tracing import incoming_trace

log = logging.getLogger("kvturn.router")


class ReplyHook(Protocol):
    """What an API that keeps state of its own (Responses) does with a turn's answer, before
    the client has it: ``reply`` gets a non-streaming reply (and returns what the client
    gets), ``final_event`` a stream's final event (held back until it returns)."""

    async def reply(self, payload: dict[str, Any]) -> dict[str, Any]: ...

    async def final_event(self, event: bytes) -> None: ...


class Turn:
    """The state of one completion request while it runs."""

    __slots__ = ("api", "attempts", "begun", "body", "continued", "ctx", "decode_backend",
                 "endpoint", "holder", "hook", "identity", "key", "no_reuse", "path", "pin",
                 "pin_skipped", "pins", "placement", "prefill_backend", "prefill_choice",
                 "prefill_tokens", "reason", "request_id", "retention_sent", "reused_tokens",
                 "route", "started", "stream", "svc", "trace", "transcript")

    def __init__(self, services: TurnServices, *, request_id: str, path: str,
                 body: dict[str, Any], identity: Identity | None, no_reuse: bool,
                 started: float, api: Api = CHAT, hook: ReplyHook | None = None) -> None:
        self.svc = services
        self.request_id = request_id
        self.api = api
        self.endpoint = api.name
        self.hook = hook
        self.path = path
        self.body = body
        self.identity = identity
        self.key = identity.key if identity is not None else None
        self.ctx = TurnContext(services, request_id=request_id, key=self.key)
        self.pins = Pins(self.ctx)
        self.no_reuse = no_reuse
        self.started = started
        # The store's version of this turn's record: when the turn began, on the router's
        # clock. Of two concurrent turns of one conversation the later one carries the longer
        # history; a capture that retried or a slow describe must not outrank it.
        self.begun = services.clock()
        self.stream = body.get("stream") is True
        self.attempts = Attempts(self.ctx, path=path, headers={"x-request-id": request_id})
        # Spans per leg and the traceparent each leg carries (``_tracing.py``); the client's
        # trace context, when it sent one, is set by the endpoint.
        self.trace = services.tracing.turn({}, request_id)
        self.placement: Placement | None = None
        self.holder: Backend | None = None
        self.pin: Retention | None = None
        self.retention_sent = False
        # A pin skipped because the chosen prefill holds what the retention would add: the
        # reuse value then comes from that prefill's own cache (``_settle_reuse``).
        self.pin_skipped = False
        self.reason = "miss"
        self.reused_tokens = 0
        self.prefill_backend: Backend | None = None
        self.prefill_choice: str | None = None
        self.prefill_tokens = 0
        self.decode_backend: Backend | None = None
        # "decode": the decode continued the turn alone; "prefill": prefill leg, then decode
        # leg; "fallback": no prefill leg succeeded and the decode computed the prompt.
        self.route = "prefill"
        self.continued = 0  # estimated tokens this turn holds of the decode's budget
        self.transcript: Transcript | None = None

    # The turn.

    async def run(self) -> Response:
        svc = self.svc
        reuse = svc.config.kv_reuse and not self.no_reuse
        if self.key is not None:
            if svc.config.kv_reuse:
                self.transcript = self.api.transcript(self.body)
            await self._locate()
        if not reuse:
            self.reason = "disabled"
        elif self.placement is not None and self.holder is not None:
            continued = await self._continue_on_decode()
            if continued is not None:
                return continued
        first, self.prefill_choice = choose_prefill(
            svc.prefills, svc.config.prefill_policy, self.placement,
            slack=svc.config.prefill_affinity_slack)
        if reuse and first is not None and self._worth_pinning(first):
            await self._take_pin()
        params = await self._prefill(first)
        if isinstance(params, Response):
            return params
        self._settle_reuse(params)
        return await self._decode(params)

    def response_headers(self) -> dict[str, str]:
        headers = {"x-request-id": self.request_id, "X-KVTurn-Reuse": self.reason,
                   "X-KVTurn-Reused-Tokens": str(self.reused_tokens),
                   "X-KVTurn-Route": self.route}
        if self.route == "prefill" and self.prefill_choice is not None:
            headers["X-KVTurn-Prefill-Choice"] = self.prefill_choice
        if self.identity is not None:
            headers["X-KVTurn-Conversation"] = self.identity.conversation_id
        return headers

    # Where the turn runs (``_placement.py``).

    async def _continue_on_decode(self) -> Response | None:
        """Serve the turn on the decode that holds the conversation, with no prefill leg,
        when the part it lacks is short; None when the turn takes the prefill path (also
        when that decode failed before its first byte)."""
        svc = self.svc
        placement, holder = self.placement, self.holder
        assert placement is not None and holder is not None
        cfg = svc.config
        estimate, why = continuation(
            placement=placement, holder=holder, transcript=self.transcript, now=svc.clock(),
            max_tokens=cfg.decode_continue_tokens, budget=cfg.decode_continue_budget)
        if why:
            svc.metrics.not_continued(why)
            return None
        self.route = "decode"
        self.reason = "hit"
        self.reused_tokens = placement.cached_tokens
        self.continued = estimate
        holder.continuing += estimate
        data = _json.dumps(decode_body(self.body, None, self.key))
        try:
            result = await (self._open_stream(holder, data) if self.stream
                            else self._decode_on(holder, data))
        finally:
            self._end_continuation()
        if isinstance(result, Failed):
            # Nothing reached the client: the prefill path may still serve it.
            self.route = "prefill"
            self.reason = "miss"
            self.reused_tokens = 0
            svc.metrics.not_continued("decode_failed")
            return None
        self._count_turn()
        return result

    def _end_continuation(self) -> None:
        """The continued turn's prompt is computed (first token out) or abandoned."""
        if self.continued and self.holder is not None:
            self.holder.continuing = max(0, self.holder.continuing - self.continued)
            self.continued = 0

    def _worth_pinning(self, prefill: Backend) -> bool:
        """A pin costs a round trip to the decode before the prefill leg: take it only when
        the retention holds at least ``min_read_tokens`` beyond what ``prefill`` holds."""
        placement = self.placement
        if placement is None or self.holder is None:
            return False
        gain = read_gain(placement, prefill)
        floor = read_floor(prefill, time.monotonic())
        if gain >= max(1, self.svc.config.min_read_tokens) and gain > floor:
            self.pin_skipped = False
            return True
        self.pin_skipped = gain == 0
        self.reason = "below-threshold"
        return False

    # Step 1: where the conversation is, and a pin on its retention.

    async def _locate(self) -> None:
        found = await self.pins.locate()
        if isinstance(found, str):
            self.reason = found
        elif found is not None:
            self.placement, self.holder = found

    async def _take_pin(self) -> None:
        """Pin the placement's retention; on any failure set ``reason`` and leave no pin."""
        assert self.placement is not None and self.holder is not None
        result = await self.pins.take(self.placement, self.holder, self.trace)
        if isinstance(result, str):
            self.reason = result
        else:
            self.pin = result

    # Step 2: the prefill leg (and step 3, unpin).

    async def _prefill(self, first: Backend | None) -> dict[str, Any] | Response | None:
        svc = self.svc
        if first is None:
            self.pins.unpin(self.holder, self.pin)
            self._prefill_gave_up(self.pin, "no prefill backend is healthy")
            return None
        pin = self.pin
        data = self._prefill_data()
        result = await self._prefill_on(first, data)
        if not isinstance(result, Failed):
            self.pins.unpin(self.holder, pin)
            return self._prefill_answer(first, result, pin)
        second, choice = choose_prefill(svc.prefills, svc.config.prefill_policy, self.placement,
                                        slack=svc.config.prefill_affinity_slack, exclude=first)
        if second is None and result.kind == "connect":
            second = first  # it never got the request: the same one may take it now
        timed_out = result.kind == "timeout"
        if second is None:
            if not timed_out:
                self.pins.unpin(self.holder, pin)
            self._prefill_gave_up(pin, f"the only prefill failed ({result.kind})")
            return None
        svc.metrics.retry("prefill")
        self.prefill_choice = choice if second is not first else self.prefill_choice
        # A timed-out first prefill may still be reading under its pin: leave that pin to
        # expire and pin again (never pass on params this turn did not just pin). A first
        # prefill that held the conversation took no pin; this one may lack what the decode has.
        repin = timed_out and pin is not None
        if not repin and pin is None and self.reason == "below-threshold" \
                and self._worth_pinning(second):
            self.reason = "miss"
            repin = True
        if repin:
            self.pin = None
            await self._take_pin()
            pin = self.pin
            data = self._prefill_data()
        result = await self._prefill_on(second, data)
        if not (isinstance(result, Failed) and result.kind == "timeout"):
            self.pins.unpin(self.holder, pin)
        if isinstance(result, Failed):
            self._prefill_gave_up(pin, f"both prefill attempts failed ({result.kind})")
            return None
        return self._prefill_answer(second, result, pin)

    def _prefill_data(self) -> bytes:
        return _json.dumps(self.api.prefill_body(self.body,
                                                 self.pin.params if self.pin else None))

    def _prefill_answer(self, backend: Backend, result: dict[str, Any] | Response,
                        pin: Retention | None) -> dict[str, Any] | Response:
        self.prefill_backend = backend
        if isinstance(result, dict):
            self.retention_sent = pin is not None
        return result

    def _prefill_gave_up(self, pin: Retention | None, why: str) -> None:
        event(log, logging.WARNING, "prefill_skipped", request_id=self.request_id,
              conversation=self.key, why=why, fallback="the decode computes the prompt")
        self.route = "fallback"
        if pin is not None:
            self.reason = "stale"

    async def _prefill_on(self, backend: Backend,
                          data: bytes) -> dict[str, Any] | Response | Failed:
        """One prefill attempt: its transfer params, a client error to return, or Failed."""
        svc = self.svc
        reply = await self.attempts.call(svc.prefills, backend, "prefill", data,
                                         timeout=svc.config.prefill_timeout, trace=self.trace,
                                         t0=time.perf_counter(), gone=PREFILL_GONE)
        if isinstance(reply, Failed) or reply.status != 200:
            return self._not_ok(svc.prefills, backend, "prefill", reply)
        try:
            payload = reply.json()
        except ValueError:
            return self.attempts.failed(svc.prefills, backend, "prefill", "bad_reply",
                                        "answer is not JSON")
        params = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
        if not isinstance(params, dict):
            return self.attempts.failed(svc.prefills, backend, "prefill", "bad_reply",
                                        "answer without kv_transfer_params")
        svc.prefills.leg_succeeded(backend)
        self.prefill_tokens = self.api.prompt_tokens(payload)
        return params

    def _not_ok(self, pool: Pool, backend: Backend, leg: str,
                reply: Reply | Failed) -> Response | Failed:
        """A leg that did not answer 200: a 4xx is the request's own fault (unknown model, bad
        parameter: any backend would refuse it the same way), so the client gets it now;
        others are failures to retry."""
        if isinstance(reply, Failed):
            return reply
        if 400 <= reply.status < 500 and reply.status not in RETRYABLE:
            self.svc.metrics.request(self.endpoint, "client_error")
            self._log_done(reply.status, "client_error")
            return self._passthrough(reply)
        return self.attempts.failed(pool, backend, leg, "status", f"answered {reply.status}",
                                    reply)

    def _settle_reuse(self, params: dict[str, Any] | None) -> None:
        """X-KVTurn-Reuse: the prefill's own report when it was given a retention to read,
        else the router's reason (miss / disabled / expired / stale)."""
        if params is not None and self.retention_sent:
            report = reuse_report(params)
            if report is not None:
                self.reason = report.reason
                self.reused_tokens = report.reused_tokens
                if self.prefill_backend is not None:
                    learn_read_floor(self.prefill_backend, declined=report.declined_tokens,
                                     reused=report.reused_tokens, now=time.monotonic())
            else:
                self.reason = "miss"
        elif params is not None and self.pin_skipped:
            placement = self.placement
            self.reason = local_coverage(reuse_report(params), self.prefill_tokens,
                                         placement.block_size if placement else 0)

    def _count_turn(self) -> None:
        self.svc.metrics.reuse(self.reason, self.reused_tokens)
        self.svc.metrics.route(self.route, self.prefill_choice if self.route == "prefill" else "")

    @property
    def _retains(self) -> bool:
        """Whether the decode is asked to retain this turn (and the router captures it)."""
        return self.key is not None and self.svc.config.kv_reuse

    # Step 4: the decode leg.

    async def _decode(self, params: dict[str, Any] | None) -> Response:
        svc = self.svc
        data = _json.dumps(decode_body(self.body, params, self.key if self._retains else None))
        backend = choose_decode(svc.decodes, self.holder, slack=svc.config.decode_affinity_slack)
        if backend is None:
            self._count_turn()
            svc.metrics.request(self.endpoint, "backend_error")
            return error_response(503, "no decode backend is healthy", type_="server_error",
                                  code="no_backend", retry_after=svc.config.retry_after,
                                  headers=self.response_headers())
        for attempt in (0, 1):
            result = await (self._open_stream(backend, data) if self.stream
                            else self._decode_on(backend, data))
            if not isinstance(result, Failed):
                self._count_turn()
                return result
            other = svc.decodes.pick(exclude=backend)
            if other is None and result.kind == "connect":
                other = backend
            if attempt == 1 or other is None:
                return self._decode_gave_up(result)
            svc.metrics.retry("decode")
            backend = other
        raise AssertionError("unreachable")  # pragma: no cover

    def _decode_gave_up(self, failed: Failed) -> Response:
        svc = self.svc
        holder = self.holder
        if holder is not None and holder.http_down:
            # The conversation's decode failed to answer (killed, its engine core orphaned):
            # nothing of what was read or held reached the client, and its retentions are
            # about to go with it. Not a hit, whatever served the prompt; the handle is
            # dropped, the next turn recomputes.
            self.reason = "stale"
            self.reused_tokens = 0
            if self.placement is not None:
                self.pins.drop(self.placement, "decode_failed")
        self._count_turn()
        svc.metrics.request(self.endpoint, "backend_error")
        self._log_done(failed.reply.status if failed.reply else 0, "backend_error")
        if failed.reply is not None:
            headers = self.response_headers()
            headers.update(retry_headers(svc.config.retry_after))
            return Response(failed.reply.body, status_code=failed.reply.status,
                            headers=headers, media_type=failed.reply.content_type)
        timeout = failed.kind == "timeout"
        return error_response(
            504 if timeout else 502, "the decode backend timed out before answering" if timeout
            else f"the decode backend failed before answering ({failed.kind})",
            type_="server_error", code="backend_timeout" if timeout else "backend_unavailable",
            retry_after=svc.config.retry_after, headers=self.response_headers())

    async def _decode_on(self, backend: Backend, data: bytes) -> Response | Failed:
        svc = self.svc
        t0 = time.perf_counter()
        reply = await self.attempts.call(svc.decodes, backend, "decode", data,
                                         timeout=svc.config.decode_timeout, trace=self.trace,
                                         t0=t0, gone=DECODE_GONE)
        if isinstance(reply, Failed) or reply.status != 200:
            return self._not_ok(svc.decodes, backend, "decode", reply)
        svc.decodes.leg_succeeded(backend)
        self.decode_backend = backend
        content = reply.body
        try:
            payload = reply.json()
        except ValueError:
            payload = None
        if isinstance(payload, dict):
            if self._retains:
                reuse = await self._capture().from_reply(backend, payload, t0)
                if self.route == "decode" and reuse is not None:
                    # The decode's own count of what its prefix cache supplied (the headers
                    # of a non-streaming reply are still to be sent).
                    self.reason = reuse.reason
                    self.reused_tokens = reuse.reused_tokens
            elif self.key is not None:
                self._capture().remember_affinity(backend)
            # Block ids and hosts of the decode are the router's business, not the client's.
            payload, found = without_transfer_params(payload)
            if self.hook is not None:
                payload = await self.hook.reply(payload)
                found = True
            if found:
                content = _json.dumps(payload)
        svc.metrics.request(self.endpoint, "ok")
        self._log_done(200, "ok")
        return Response(content, status_code=200, headers=self.response_headers(),
                        media_type=reply.content_type)

    async def _open_stream(self, backend: Backend, data: bytes) -> Response | Failed:
        svc = self.svc
        t0 = time.perf_counter()
        opened = await self.attempts.open_stream(backend, data, trace=self.trace, t0=t0)
        if not isinstance(opened, OpenedStream):
            return self._not_ok(svc.decodes, backend, "decode", opened)
        upstream, first, span = opened.upstream, opened.first, opened.span
        now = time.perf_counter()
        self.ctx.leg("decode", now - t0)
        svc.metrics.ttft.observe(now - self.started)
        svc.decodes.leg_succeeded(backend)
        self.decode_backend = backend
        decode_started = t0
        captured = False
        if not self._retains and self.key is not None:
            self._capture().remember_affinity(backend)

        async def capture(final: bytes = b"") -> None:
            nonlocal captured
            if self._retains and not captured:
                captured = True
                await self._capture().described(backend, decode_started)
            if final and self.hook is not None:
                await self.hook.final_event(final)

        async def finish(end: StreamEnd) -> None:
            backend.in_flight -= 1
            span.end(None if end.error is None else end.error.kind)
            if end.error is not None:
                self.attempts.failed(svc.decodes, backend, "decode", end.error.kind,
                                     str(end.error))
            svc.metrics.request(self.endpoint, end.outcome)
            self._log_done(200, end.outcome)
            await capture()  # a stream that did not complete: the decode may still hold KV

        media_type = upstream.content_type or "text/event-stream"
        return RelayResponse(upstream, first, self.response_headers(), media_type, finish,
                             before_done=capture, split_final=self.api.split_final,
                             error_event=self.api.error_event)

    def _passthrough(self, reply: Reply) -> Response:
        headers = self.response_headers()
        headers.update(retry_headers(None))
        return Response(reply.body, status_code=reply.status, headers=headers,
                        media_type=reply.content_type)

    def _capture(self) -> Capture:
        """Step 5 (``_capture.py``), once the decode leg answered."""
        return Capture(self.ctx, self.trace, version=self.begun,
                       late=bool(self.body.get(self.api.stop_field)), old=self.placement,
                       prefill=self.prefill_backend, prefill_tokens=self.prefill_tokens,
                       transcript=self.transcript)

    # Shared bits.

    def _log_done(self, status: int, outcome: str) -> None:
        if log.isEnabledFor(logging.DEBUG):
            event(log, logging.DEBUG, "request", request_id=self.request_id,
                  conversation=self.key, endpoint=self.endpoint, stream=self.stream,
                  status=status, outcome=outcome, reuse=self.reason,
                  reused_tokens=self.reused_tokens, route=self.route,
                  prefill_choice=self.prefill_choice if self.route == "prefill" else None,
                  prefill=self.prefill_backend.url if self.prefill_backend else None,
                  decode=self.decode_backend.url if self.decode_backend else None,
                  ms=round((time.perf_counter() - self.started) * 1000, 2),
                  **{f"{leg}_ms": ms for leg, ms in self.ctx.legs_ms.items()})


def request_id_of(given: str | None) -> str:
    """The client's ``x-request-id`` when it is a sane one (it is echoed, logged and sent to
    the backends), else a fresh one."""
    if given and len(given) <= 128 and given.isascii() and given.isprintable():
        return given
    return uuid.uuid4().hex


def traced(turn: Turn, headers: Mapping[str, str]) -> None:
    """Give ``turn``'s legs the client's W3C trace context (``_tracing.py``)."""
    incoming = incoming_trace(headers)
    if incoming or turn.svc.tracing.enabled:
        turn.trace = turn.svc.tracing.turn(incoming, turn.request_id)
