"""What a turn is given: the router's collaborators it uses, and what it reports through.

``Router`` (``_wiring.py``) builds one ``TurnServices`` when it starts and hands it to every
``Turn`` (``_turn.py``); a turn never sees the router itself. ``TurnContext`` is one turn's
identity in logs and metrics, shared by the turn and its steps (``_pin.py``, ``_attempts.py``,
``_decode_step.py``, ``_capture.py``). ``TurnReport`` is what the turn tells the client about
itself (the X-KVTurn-* headers), counts and logs, written by the turn and its decode step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvturn.wire import (
    HEADER_BLOCK_SIZE,
    HEADER_CONVERSATION_ECHO,
    HEADER_PREFILL_CHOICE,
    HEADER_REQUEST_ID,
    HEADER_REUSE,
    HEADER_REUSED_TOKENS,
    HEADER_ROUTE,
    PENDING,
    PrefillChoice,
    ReuseReason,
    Route,
)
from kvturn_server.router._log import event
from kvturn_server.router._plan import settle_continued
from kvturn_server.router._state import StoreError

if TYPE_CHECKING:
    from kvturn_server.router._backend import BackendClient
    from kvturn_server.router._config import RouterConfig
    from kvturn_server.router._control import ControlClient, ControlError
    from kvturn_server.router._legs import DecodeUsage, ReuseReport
    from kvturn_server.router._metrics import RouterMetrics
    from kvturn_server.router._pool import Backend, Pool
    from kvturn_server.router._state import ConversationStore, Placement
    from kvturn_server.router._tracing import Tracing

log = logging.getLogger("kvturn.router")


@dataclass(frozen=True, slots=True)
class TurnServices:
    """The router's collaborators a turn uses.

    ``spawn`` runs a coroutine off the request path (shutdown waits for it);
    ``check_control`` asks a decode's control endpoint which engine it is now.
    """

    config: RouterConfig
    client: BackendClient
    control: ControlClient
    prefills: Pool
    decodes: Pool
    store: ConversationStore
    metrics: RouterMetrics
    tracing: Tracing
    clock: Callable[[], float]
    sleep: Callable[[float], Awaitable[None]]
    spawn: Callable[[Coroutine[Any, Any, Any]], None]
    check_control: Callable[[Backend], Coroutine[Any, Any, None]]


def control_call_failed(services: TurnServices, backend: Backend, call: str, exc: ControlError,
                        *, request_id: str, conversation: str | None) -> None:
    """A control call (pin, unpin, describe, keepalive, release) failed: the endpoint is out
    of use when the failure says it is down (``Pool.control_failed``), counted and logged."""
    services.decodes.control_failed(backend, exc.kind)
    services.metrics.failure("control", backend.url, exc.kind)
    event(log, logging.WARNING, "control_call_failed", request_id=request_id,
          conversation=conversation, backend=backend.url, call=call, kind=exc.kind,
          error=str(exc))


class TurnContext:
    """One turn's identity in logs and metrics, and the reports its steps share."""

    __slots__ = ("key", "legs_ms", "request_id", "services")

    def __init__(self, services: TurnServices, *, request_id: str, key: str | None) -> None:
        self.services = services
        self.request_id = request_id
        self.key = key
        # Each leg's latency (the last one of a retried leg), for the per-request debug line.
        self.legs_ms: dict[str, float] = {}

    @property
    def conversation(self) -> str:
        """The key, for the steps only a keyed turn takes (pin, capture)."""
        assert self.key is not None
        return self.key

    def leg(self, leg: str, seconds: float) -> None:
        self.services.metrics.leg(leg, seconds)
        self.legs_ms[leg] = round(seconds * 1000, 2)

    def state_error(self, op: str, exc: StoreError) -> None:
        self.services.metrics.state_errors.inc()
        event(log, logging.WARNING, "state_store_failed", request_id=self.request_id,
              conversation=self.key, op=op, error=str(exc))

    def control_failed(self, backend: Backend, call: str, exc: ControlError) -> None:
        control_call_failed(self.services, backend, call, exc, request_id=self.request_id,
                            conversation=self.key)

    def engines_differ(self, backend: Backend) -> None:
        event(log, logging.WARNING, "control_distrusted", request_id=self.request_id,
              backend=backend.url, why=backend.distrust_reason())
        # A restart between two health checks: asking the control endpoint again now ties
        # the two sides back together (or confirms that they differ) without waiting a round.
        self.services.spawn(self.services.check_control(backend))

    async def delete_placement(self, placement: Placement) -> None:
        """Forget the record this turn read (only that one: a newer turn's stays)."""
        assert self.key is not None
        try:
            await self.services.store.delete(self.key, turn=placement.turn)
        except StoreError as exc:
            self.state_error("delete", exc)


class TurnReport:
    """What a turn says about itself: its X-KVTurn-* headers, its reuse and route counts and
    its per-request debug line. ``reason`` is a :class:`ReuseReason`, or ``PENDING`` (below);
    ``route`` is ``decode`` (the decode continued the turn alone), ``prefill`` (prefill leg,
    then decode leg) or ``fallback`` (no prefill leg succeeded and the decode computed the
    prompt); ``prefill`` / ``decode`` are the backends that answered;
    ``usage`` is what the decode leg that answered reported of its tokens (``DecodeUsage``:
    prompt, completion and cached tokens), set before the turn's capture runs (for a stream,
    once it has ended), None until then or when the decode sent none.

    A turn the decode continues alone reads nothing: its reuse is what the decode's own prefix
    cache supplied, which only the decode's usage tells (``settle``). Until then its reason is
    ``pending``: a stream's headers go out before the decode has computed anything, so they
    say ``pending`` (with the block size that decides hit from partial), and the truth follows
    in the usage event, the metrics and the debug line, which a relayed stream counts and
    logs once it has ended.
    """

    __slots__ = ("_counted", "_relaying", "block_size", "conversation_id", "ctx", "decode",
                 "endpoint", "expected_tokens", "prefill", "prefill_choice", "reason",
                 "reused_tokens", "route", "started", "stream", "usage")

    def __init__(self, ctx: TurnContext, *, conversation_id: str | None, endpoint: str,
                 stream: bool, started: float) -> None:
        self.ctx = ctx
        self.conversation_id = conversation_id
        self.endpoint = endpoint
        self.stream = stream
        self.started = started
        self.reason: ReuseReason | Literal["pending"] = ReuseReason.MISS
        self.reused_tokens = 0
        self.route = Route.PREFILL
        self.prefill_choice: PrefillChoice | None = None
        self.prefill: Backend | None = None
        self.decode: Backend | None = None
        self.usage: DecodeUsage | None = None
        # A continued turn: what the router's record says the decode's cache holds of the
        # conversation (its retention's full blocks), and their block size.
        self.expected_tokens = 0
        self.block_size = 0
        self._counted = False
        self._relaying = False

    def continued(self, *, expected_tokens: int, block_size: int) -> None:
        """The decode continues the turn alone: its reuse is pending until its usage says."""
        self.route = Route.DECODE
        self.reason = PENDING
        self.reused_tokens = 0
        self.expected_tokens = expected_tokens
        self.block_size = block_size

    def settle(self, connector: ReuseReport | None = None) -> None:
        """A continued turn's reuse from the decode's usage (else ``connector``, the decode
        connector's own count in a non-streamed reply): what its cache really supplied. A
        turn more than a block short of the record found its retention (partly) gone:
        evicted, or expired and its blocks reused."""
        if self.route != Route.DECODE or self.reason != PENDING:
            return
        found = settle_continued(self.usage, connector, self.block_size)
        if found is None:
            return
        self.reason, self.reused_tokens = found.reason, found.reused_tokens
        if found.reused_tokens < self.expected_tokens - max(self.block_size, 1):
            self.ctx.services.metrics.continued_short()

    def relaying(self) -> None:
        """The answer is a relayed stream: counted when it has ended (``count(at_end=True)``),
        when the decode's usage has settled a continued turn's reuse."""
        self._relaying = True

    def headers(self) -> dict[str, str]:
        headers = {HEADER_REQUEST_ID: self.ctx.request_id, HEADER_REUSE: self.reason,
                   HEADER_REUSED_TOKENS: str(self.reused_tokens), HEADER_ROUTE: self.route}
        if self.route == Route.PREFILL and self.prefill_choice is not None:
            headers[HEADER_PREFILL_CHOICE] = self.prefill_choice
        if self.reason == PENDING and self.block_size > 0:
            headers[HEADER_BLOCK_SIZE] = str(self.block_size)
        if self.conversation_id is not None:
            headers[HEADER_CONVERSATION_ECHO] = self.conversation_id
        return headers

    def count(self, *, at_end: bool = False) -> None:
        """Count the turn's reuse and route, once, when its answer is decided (a relayed
        stream's when it has ended: ``at_end``)."""
        if self._counted or (self._relaying and not at_end):
            return
        self._counted = True
        metrics = self.ctx.services.metrics
        metrics.reuse(self.reason, self.reused_tokens)
        metrics.route(self.route, self.prefill_choice if self.route == Route.PREFILL else "")

    def log_done(self, status: int, outcome: str) -> None:
        if log.isEnabledFor(logging.DEBUG):
            ctx = self.ctx
            event(log, logging.DEBUG, "request", request_id=ctx.request_id,
                  conversation=ctx.key, endpoint=self.endpoint, stream=self.stream,
                  status=status, outcome=outcome, reuse=self.reason,
                  reused_tokens=self.reused_tokens, route=self.route,
                  expected_tokens=self.expected_tokens if self.route == Route.DECODE else None,
                  prefill_choice=self.prefill_choice if self.route == Route.PREFILL else None,
                  prefill=self.prefill.url if self.prefill else None,
                  decode=self.decode.url if self.decode else None,
                  **_usage_fields(self.usage),
                  ms=round((time.perf_counter() - self.started) * 1000, 2),
                  **{f"{leg}_ms": ms for leg, ms in ctx.legs_ms.items()})


def _usage_fields(usage: DecodeUsage | None) -> dict[str, int | None]:
    """The decode's usage in the debug line (absent when it sent none)."""
    if usage is None:
        return {}
    return {"prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
            "completion_tokens": usage.completion_tokens}
