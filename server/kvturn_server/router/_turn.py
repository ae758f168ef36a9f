"""One turn: pin -> prefill leg -> unpin -> decode leg -> capture (docs/http-api.md, B).

This executes a turn: its decisions (where it runs, pin or not, which fallback, what it
reports) are ``_plan.py``'s pure functions, which the simulator runs too; here are the calls,
and how every fault degrades:

- **Pin** the conversation's retention on the decode that holds it (``_pin.py``); any
  failure means "nothing to reuse this turn" (reported in ``X-KVTurn-Reuse``). A decode that
  keeps the retention in its host tier alone says so: the turn may continue there instead.
- **Prefill leg** on the prefill ``_placement.py`` chooses; a failure (transport, timeout,
  5xx, 408/429, an answer without transfer params) is retried once on another prefill; if
  that fails too, the decode computes the prompt itself. A 4xx is the client's mistake and is
  returned as is. Each attempt of a leg is one call of ``_attempts.py``.
- **Unpin** once the prefill answered, off the request path. After a prefill timeout the pin is
  left to expire (that prefill may still be reading) and a retry takes a new one.
- **Decode leg** on the holder (affinity) when healthy, else the least loaded decode; or, when
  the part the holder lacks is short, on the holder alone with no prefill leg. A failure
  before the first byte is retried once on another decode; streams are relayed unbuffered
  (``_stream.py``); a stream that breaks ends with an error event (``_decode_step.py``).
- **Capture** what the decode retained and record it (``_capture.py``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from starlette.responses import Response

from kvturn.wire import HEADER_REQUEST_ID, GoneReason, ReuseReason, Route
from kvturn_server.router import _json
from kvturn_server.router._apis import CHAT, Api
from kvturn_server.router._attempts import PREFILL_GONE, Attempts, Failed
from kvturn_server.router._capture import Capture
from kvturn_server.router._control import Retention
from kvturn_server.router._decode_step import DecodeStep, ReplyHook, not_ok
from kvturn_server.router._history import Transcript
from kvturn_server.router._identity import Identity
from kvturn_server.router._legs import decode_body, reuse_report
from kvturn_server.router._log import event
from kvturn_server.router._pin import HostHeld, Pins
from kvturn_server.router._placement import choose_prefill
from kvturn_server.router._plan import (
    NOT_CONTINUED_FAILED,
    RoutePlan,
    TurnPath,
    TurnPolicy,
    gave_up_reason,
    gone_reuse,
    plan_host_route,
    plan_pin,
    plan_probe,
    plan_retry,
    plan_route,
    settle_prefill,
)
from kvturn_server.router._pool import Backend
from kvturn_server.router._services import TurnContext, TurnReport, TurnServices
from kvturn_server.router._state import Placement
from kvturn_server.router._tracing import incoming_trace

log = logging.getLogger("kvturn.router")


class Turn:
    """The state of one completion request while it runs."""

    __slots__ = ("api", "attempts", "begun", "body", "continued", "ctx", "holder", "hook",
                 "identity", "key", "path", "pin", "pin_skipped", "pins", "placement",
                 "policy", "prefill_tokens", "report", "request_id", "retention_sent",
                 "strip_usage", "svc", "trace", "transcript")

    def __init__(self, services: TurnServices, *, request_id: str, path: str,
                 body: dict[str, Any], identity: Identity | None, no_reuse: bool,
                 started: float, api: Api = CHAT, hook: ReplyHook | None = None) -> None:
        self.svc = services
        self.request_id = request_id
        self.api = api
        self.hook = hook
        self.path = path
        self.body = body
        self.identity = identity
        self.key = identity.key if identity is not None else None
        self.ctx = TurnContext(services, request_id=request_id, key=self.key)
        self.pins = Pins(self.ctx)
        # The settings that decide this turn (``_plan.py``): the client may opt out of reuse.
        self.policy = TurnPolicy.of(services.config, no_reuse=no_reuse)
        # The store's version of this turn's record: when the turn began, on the router's
        # clock. Of two concurrent turns of one conversation the later one carries the longer
        # history; a capture that retried or a slow describe must not outrank it.
        self.begun = services.clock()
        # X-KVTurn-Reuse ("miss" until something better is known), the route and the
        # backends that answered; the decode step answers the client from it.
        self.report = TurnReport(
            self.ctx, conversation_id=identity.conversation_id if identity else None,
            endpoint=api.name, stream=body.get("stream") is True, started=started)
        self.attempts = Attempts(self.ctx, path=path, headers={HEADER_REQUEST_ID: request_id})
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
        self.prefill_tokens = 0
        self.continued = 0  # estimated tokens this turn holds of the decode's budget
        self.transcript: Transcript | None = None
        self.strip_usage = False  # the decode leg's usage was asked for by the router alone

    # The turn.

    async def run(self) -> Response:
        svc = self.svc
        report = self.report
        if self.key is not None:
            if self.policy.reads_transcript:
                self.transcript = self.api.transcript(self.body)
            await self._locate()
        now = svc.clock()
        held = None
        if plan_probe(self.policy, placement=self.placement, holder=self.holder,
                      transcript=self.transcript, now=now):
            assert self.holder is not None
            held = await self.pins.held(self.holder, self.trace)
        route = plan_route(self.policy, placement=self.placement, holder=self.holder,
                           transcript=self.transcript, now=now, held=held)
        if route.reason is not None:
            report.reason = route.reason
        if route.where is not TurnPath.PREFILL:
            alone = await self._decode_alone(route)
            if alone is not None:
                return alone
        first, report.prefill_choice = choose_prefill(
            svc.prefills, svc.config.prefill_policy, self.placement,
            slack=svc.config.prefill_affinity_slack)
        not_continued = route.not_continued
        if self._plan_pin(first):
            host_held = await self._take_pin()
            if host_held is not None:
                host_route = self._host_route(host_held)
                if host_route is not None:
                    # Continued after all (or counted as a failed continuation).
                    not_continued = None
                    alone = await self._decode_alone(host_route)
                    if alone is not None:
                        return alone
                await self._take_host_pin()
        if not_continued:
            svc.metrics.not_continued(not_continued)
        params = await self._prefill(first)
        if isinstance(params, Response):
            return params
        self._settle_reuse(params)
        data = self._decode_data(params, self.key if self._retains else None)
        return await self._decode_step().run(data)

    # Where the turn runs and whether it pins (``_plan.py``).

    async def _decode_alone(self, route: RoutePlan) -> Response | None:
        """Serve the turn on the decode that served the conversation, with no prefill leg
        (``route.where``: kvturn's continuation, or stock conditional disaggregation, which
        retains, pins and captures nothing); None when that decode failed before its first
        byte and the turn takes the prefill path instead."""
        svc, report = self.svc, self.report
        placement, holder = self.placement, self.holder
        assert placement is not None and holder is not None
        key = None
        if route.where is TurnPath.CONTINUE:
            # What it reuses is what its cache still holds: its usage says (TurnReport.settle).
            report.continued(expected_tokens=placement.cached_tokens,
                             block_size=placement.block_size)
            self.continued = route.estimate
            svc.decodes.continuation_started(holder, route.estimate)
            key = self.key
        else:
            report.route = route.where.route
        data = self._decode_data(None, key)
        try:
            result = await self._decode_step().attempt(holder, data)
        finally:
            self._end_continuation()
        if isinstance(result, Failed):
            # Nothing reached the client: the prefill path may still serve it.
            report.route = TurnPath.PREFILL.route
            if route.fallback_reason is not None:
                report.reason = route.fallback_reason
                report.reused_tokens = 0
            svc.metrics.not_continued(NOT_CONTINUED_FAILED)
            return None
        report.count()
        return result

    def _host_route(self, held: HostHeld) -> RoutePlan | None:
        """The pin found the retention in the holder's host tier alone: the turn continues
        there when ``plan_host_route`` allows it (the decode loads the history from host
        memory); None: the prefill path, which recomputes it."""
        assert self.placement is not None and self.holder is not None
        return plan_host_route(self.policy, placement=self.placement, holder=self.holder,
                               transcript=self.transcript, host_tokens=held.tokens)

    def _end_continuation(self) -> None:
        """The continued turn's prompt is computed (first token out) or abandoned."""
        if self.continued and self.holder is not None:
            self.svc.decodes.continuation_ended(self.holder, self.continued)
            self.continued = 0

    def _plan_pin(self, prefill: Backend | None) -> bool:
        """Whether ``prefill`` gets the retention pinned for it; the reason the turn reports
        when not."""
        plan = plan_pin(self.policy, placement=self.placement, holder=self.holder,
                        prefill=prefill, now=time.monotonic())
        self.pin_skipped = plan.skipped
        if plan.reason is not None:
            self.report.reason = plan.reason
        return plan.pin

    # Step 1: where the conversation is, and a pin on its retention.

    async def _locate(self) -> None:
        found = await self.pins.locate()
        if isinstance(found, ReuseReason):
            self.report.reason = found
        elif found is not None:
            self.placement, self.holder = found

    async def _take_pin(self) -> HostHeld | None:
        """Pin the placement's retention; on any failure set the reason and leave no pin.
        Returns what the decode said it keeps in its host tier alone, if that was the
        failure."""
        assert self.placement is not None and self.holder is not None
        result = await self.pins.take(self.placement, self.holder, self.trace)
        if isinstance(result, HostHeld):
            self.report.reason = gone_reuse(GoneReason.EVICTED)
            return result
        if isinstance(result, ReuseReason):
            self.report.reason = result
        else:
            self.pin = result
        return None

    async def _take_host_pin(self) -> None:
        """The prefill leg of a turn whose history the holder keeps in its host tier alone:
        pinned there, the prefill reads it from host memory instead of recomputing it."""
        assert self.placement is not None and self.holder is not None
        pin = await self.pins.take_host(self.placement, self.holder, self.trace)
        if pin is not None:
            self.pin = pin
            self.report.reason = ReuseReason.MISS  # until the prefill reports what it read

    # Step 2: the prefill leg (and step 3, unpin).

    async def _prefill(self, first: Backend | None) -> dict[str, Any] | Response | None:
        svc, report = self.svc, self.report
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
        other, choice = choose_prefill(svc.prefills, svc.config.prefill_policy, self.placement,
                                       slack=svc.config.prefill_affinity_slack, exclude=first)
        retry = plan_retry(result.kind, first, other, pinned=pin is not None)
        second = retry.on
        if second is None:
            if not retry.keep_pin:
                self.pins.unpin(self.holder, pin)
            self._prefill_gave_up(pin, f"the only prefill failed ({result.kind})")
            return None
        svc.metrics.retry("prefill")
        report.prefill_choice = choice if second is not first else report.prefill_choice
        # A timed-out first prefill may still be reading under its pin: leave that pin to
        # expire and pin again (never pass on params this turn did not just pin). A first
        # prefill that held the conversation took no pin; this one may lack what the decode has.
        repin = retry.repin
        if not repin and pin is None and report.reason == ReuseReason.BELOW_THRESHOLD \
                and self._plan_pin(second):
            report.reason = ReuseReason.MISS
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
        self.report.prefill = backend
        if isinstance(result, dict):
            self.retention_sent = pin is not None
        return result

    def _prefill_gave_up(self, pin: Retention | None, why: str) -> None:
        event(log, logging.WARNING, "prefill_skipped", request_id=self.request_id,
              conversation=self.key, why=why, fallback="the decode computes the prompt")
        self.report.route = Route.FALLBACK
        reason = gave_up_reason(pin is not None)
        if reason is not None:
            self.report.reason = reason

    async def _prefill_on(self, backend: Backend,
                          data: bytes) -> dict[str, Any] | Response | Failed:
        """One prefill attempt: its transfer params, a client error to return, or Failed."""
        svc = self.svc
        reply = await self.attempts.call(svc.prefills, backend, "prefill", data,
                                         timeout=svc.config.prefill_timeout, trace=self.trace,
                                         t0=time.perf_counter(), gone=PREFILL_GONE)
        if isinstance(reply, Failed) or reply.status != 200:
            return not_ok(self.attempts, self.report, svc.prefills, backend, "prefill", reply)
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

    def _settle_reuse(self, params: dict[str, Any] | None) -> None:
        """X-KVTurn-Reuse after the prefill leg (``settle_prefill``); the prefill's read floor
        learns from its report."""
        if params is None:
            return
        placement = self.placement
        settled = settle_prefill(reuse_report(params), read_offered=self.retention_sent,
                                 pin_skipped=self.pin_skipped,
                                 prompt_tokens=self.prefill_tokens,
                                 block_size=placement.block_size if placement else 0)
        if settled is None:
            return
        report = self.report
        report.reason, report.reused_tokens = settled.reason, settled.reused_tokens
        if settled.learn is not None and report.prefill is not None:
            self.svc.prefills.read_reported(
                report.prefill, declined=settled.learn.declined_tokens,
                reused=settled.learn.reused_tokens, now=time.monotonic())

    @property
    def _retains(self) -> bool:
        """Whether the decode is asked to retain this turn (and the router captures it)."""
        return self.key is not None and self.policy.retain

    # Step 4, the decode leg (``_decode_step.py``), and step 5, its capture (``_capture.py``).

    def _decode_data(self, params: dict[str, Any] | None, key: str | None) -> bytes:
        """The decode leg's body: a stream asks for the decode's usage (``_apis.py``)."""
        body, self.strip_usage = self.api.ask_usage(decode_body(self.body, params, key))
        return _json.dumps(body)

    def _decode_step(self) -> DecodeStep:
        """The decode leg, once the turn knows what the decode is sent (and, on the prefill
        path, which prefill computed the prompt: the capture records it)."""
        capture = None if self.key is None else Capture(
            self.ctx, self.trace, version=self.begun,
            late=bool(self.body.get(self.api.stop_field)), old=self.placement,
            prefill=self.report.prefill, prefill_tokens=self.prefill_tokens,
            transcript=self.transcript)
        return DecodeStep(self.attempts, self.report, self.trace, api=self.api, hook=self.hook,
                          capture=capture, retains=self._retains, pins=self.pins,
                          holder=self.holder, placement=self.placement,
                          strip_usage=self.strip_usage)


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
