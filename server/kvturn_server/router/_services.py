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
from typing import TYPE_CHECKING, Any

from kvturn_server.router._log import event
from kvturn_server.router._state import StoreError

if TYPE_CHECKING:
    from kvturn_server.router._backend import BackendClient
    from kvturn_server.router._config import RouterConfig
    from kvturn_server.router._control import ControlClient, ControlError
    from kvturn_server.router._legs import DecodeUsage
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


def control_call_failed(backend: Backend, call: str, exc: ControlError, *,
                        request_id: str, conversation: str | None) -> None:
    """Log a failed control call (pin, unpin, describe, keepalive, release)."""
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
        if exc.kind in ("connect", "timeout", "unauthorized"):
            backend.control_ok = False  # until a health check finds it answering again
        self.services.metrics.failure("control", backend.url, exc.kind)
        control_call_failed(backend, call, exc, request_id=self.request_id,
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
    its per-request debug line. ``route`` is "decode" (the decode continued the turn alone),
    "prefill" (prefill leg, then decode leg) or "fallback" (no prefill leg succeeded and the
    decode computed the prompt); ``prefill`` / ``decode`` are the backends that answered;
    ``usage`` is what the decode leg that answered reported of its tokens (``DecodeUsage``:
    prompt, completion and cached tokens), set before the turn's capture runs (for a stream,
    once it has ended), None until then or when the decode sent none."""

    __slots__ = ("conversation_id", "ctx", "decode", "endpoint", "prefill", "prefill_choice",
                 "reason", "reused_tokens", "route", "started", "stream", "usage")

    def __init__(self, ctx: TurnContext, *, conversation_id: str | None, endpoint: str,
                 stream: bool, started: float) -> None:
        self.ctx = ctx
        self.conversation_id = conversation_id
        self.endpoint = endpoint
        self.stream = stream
        self.started = started
        self.reason = "miss"
        self.reused_tokens = 0
        self.route = "prefill"
        self.prefill_choice: str | None = None
        self.prefill: Backend | None = None
        self.decode: Backend | None = None
        self.usage: DecodeUsage | None = None

    def headers(self) -> dict[str, str]:
        headers = {"x-request-id": self.ctx.request_id, "X-KVTurn-Reuse": self.reason,
                   "X-KVTurn-Reused-Tokens": str(self.reused_tokens),
                   "X-KVTurn-Route": self.route}
        if self.route == "prefill" and self.prefill_choice is not None:
            headers["X-KVTurn-Prefill-Choice"] = self.prefill_choice
        if self.conversation_id is not None:
            headers["X-KVTurn-Conversation"] = self.conversation_id
        return headers

    def count(self) -> None:
        """Count the turn's reuse and route (once, when its answer is decided)."""
        metrics = self.ctx.services.metrics
        metrics.reuse(self.reason, self.reused_tokens)
        metrics.route(self.route, self.prefill_choice if self.route == "prefill" else "")

    def log_done(self, status: int, outcome: str) -> None:
        if log.isEnabledFor(logging.DEBUG):
            ctx = self.ctx
            event(log, logging.DEBUG, "request", request_id=ctx.request_id,
                  conversation=ctx.key, endpoint=self.endpoint, stream=self.stream,
                  status=status, outcome=outcome, reuse=self.reason,
                  reused_tokens=self.reused_tokens, route=self.route,
                  prefill_choice=self.prefill_choice if self.route == "prefill" else None,
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
