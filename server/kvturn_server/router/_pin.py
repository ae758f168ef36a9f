"""Step 1 of a turn: where the conversation is held, and a pin on that retention.

No record, a record naming an unknown or restarted decode, a ``404 Gone`` or an unreachable
control endpoint all mean "nothing to reuse this turn": the turn gets the X-KVTurn-Reuse
reason instead of a pin, and stale handles are dropped (only the one this turn read) and
counted. Only params pinned for this turn ever reach a prefill.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass

from kvturn.wire import ReuseReason
from kvturn_server.router._control import ControlError, Gone, Retention
from kvturn_server.router._log import event
from kvturn_server.router._plan import pin_gone, refuse_pin
from kvturn_server.router._pool import Backend
from kvturn_server.router._services import TurnContext
from kvturn_server.router._state import Placement, StoreError
from kvturn_server.router._tracing import TurnTrace

log = logging.getLogger("kvturn.router")


@dataclass(frozen=True, slots=True)
class HostHeld:
    """A pin's answer that the decode keeps the retention in its host tier alone: nothing a
    prefill could read on the device (a second pin may offer its host tier: ``take_host``),
    ``tokens`` of the history (from its start) it can load itself. The lease goes on, so the
    record stays."""

    tokens: int


class Pins:
    """One turn's calls about its conversation's retention (all but ``unpin`` need a key)."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: TurnContext) -> None:
        self.ctx = ctx

    async def locate(self) -> tuple[Placement, Backend] | ReuseReason | None:
        """The conversation's record and the decode holding it; a reuse reason when the
        record is stale; None when there is none (or the store failed)."""
        ctx = self.ctx
        try:
            placement = await ctx.services.store.get(self.ctx.conversation)
        except StoreError as exc:
            ctx.state_error("get", exc)
            return None
        if placement is None:
            return None
        holder = ctx.services.decodes.by_url(placement.decode)
        if holder is None:
            # Recorded by a router configured with other decodes (or before a change).
            self.drop(placement, "unknown_decode")
            return ReuseReason.STALE
        return placement, holder

    async def take(self, placement: Placement, holder: Backend,
                   trace: TurnTrace) -> Retention | ReuseReason | HostHeld:
        """Pin the placement's retention on ``holder``; on any failure the reuse reason, and
        :class:`HostHeld` when ``holder`` keeps it in its host tier alone."""
        ctx, key = self.ctx, self.ctx.conversation
        refused = refuse_pin(placement, holder)
        if refused is not None:
            if refused.drop is not None:
                self.drop(placement, refused.drop)
            else:
                event(log, logging.DEBUG, "pin_skipped", request_id=ctx.request_id,
                      conversation=key, decode=holder.url, why=holder.distrust_reason())
            return refused.reason
        assert holder.control_url is not None
        services = ctx.services
        result = await self._call("pin", holder, trace, services.control.pin(
            holder.control_url, key, services.config.effective_pin_ttl))
        if result is None:
            return ReuseReason.STALE
        if isinstance(result, Gone):
            services.decodes.control_answered(holder)
            if result.host_tokens:
                return HostHeld(result.host_tokens)
            gone = pin_gone(result.code)
            if gone.drop is not None:
                self.drop(placement, gone.drop)
            return gone.reason
        services.decodes.control_answered(holder, result.engine_id)
        if placement.engine_id is not None and result.engine_id is not None \
                and result.engine_id != placement.engine_id:
            self.drop(placement, "engine_changed")
            self.unpin(holder, result)
            return ReuseReason.STALE
        if not holder.control_trusted:
            # The control endpoint names another engine than the decode's HTTP side: its
            # blocks are not the ones behind the server that would answer this turn.
            ctx.engines_differ(holder)
            self.unpin(holder, result)
            return ReuseReason.STALE
        return result

    async def take_host(self, placement: Placement, holder: Backend,
                        trace: TurnTrace) -> Retention | None:
        """Pin a retention ``holder`` keeps in its host tier alone for a prefill to read from
        there (a second pin, asked only when the turn is not continued on ``holder``); None
        when the decode serves no host reads (its answer is the first pin's again), the call
        failed, or the answer is not to be trusted (as for :meth:`take`): the prefill
        recomputes the history, as before."""
        ctx = self.ctx
        assert holder.control_url is not None
        services = ctx.services
        result = await self._call("pin", holder, trace, services.control.pin(
            holder.control_url, ctx.conversation, services.config.effective_pin_ttl,
            host_reads=True))
        if result is None or isinstance(result, Gone):
            if result is not None:
                services.decodes.control_answered(holder)
            return None
        services.decodes.control_answered(holder, result.engine_id)
        if (placement.engine_id is not None and result.engine_id is not None
                and result.engine_id != placement.engine_id) or not holder.control_trusted:
            # Another engine than the one the first pin answered for: its host tier is not
            # the one this conversation's record names. The next turn's pin finds out why.
            self.unpin(holder, result)
            return None
        return result

    async def held(self, holder: Backend, trace: TurnTrace) -> int | None:
        """Tokens of the conversation ``holder`` still has cached from its start, for a record
        whose retention is known gone (``_plan.plan_probe``): a live retention's, or what
        the dropped one left in the prefix cache; None when it cannot say."""
        ctx = self.ctx
        if holder.control_url is None or not holder.control_trusted:
            return None
        services = ctx.services
        result = await self._call("probe", holder, trace, services.control.describe(
            holder.control_url, ctx.conversation))
        if result is None:
            return None
        if isinstance(result, Gone):
            services.decodes.control_answered(holder)
            return result.cached_tokens
        services.decodes.control_answered(holder, result.engine_id)
        return result.num_tokens if holder.control_trusted else None

    async def _call(self, leg: str, holder: Backend, trace: TurnTrace,
                    call: Awaitable[Retention | Gone]) -> Retention | Gone | None:
        """One control call on the turn's path, timed as ``leg`` and traced; None when it
        failed (the endpoint's failure recorded)."""
        ctx = self.ctx
        t0 = time.perf_counter()
        span = trace.leg(leg, holder.url)
        try:
            result = await call
        except ControlError as exc:
            span.end(exc.kind)
            ctx.leg(leg, time.perf_counter() - t0)
            ctx.control_failed(holder, leg, exc)
            return None
        span.end()
        ctx.leg(leg, time.perf_counter() - t0)
        return result

    def drop(self, placement: Placement, why: str) -> None:
        """Forget a stale handle (only the one this turn read) and count it."""
        ctx = self.ctx
        ctx.services.metrics.stale(why)
        event(log, logging.DEBUG, "stale_handle", request_id=ctx.request_id,
              conversation=self.ctx.conversation, reason=why, decode=placement.decode)
        ctx.services.spawn(ctx.delete_placement(placement))

    def unpin(self, holder: Backend | None, pin: Retention | None) -> None:
        """Free ``pin`` off the request path (it also expires by itself: ``pin_ttl``)."""
        if pin is None or pin.pin_id is None or holder is None or holder.control_url is None:
            return
        self.ctx.services.spawn(self._unpin_now(holder, holder.control_url, pin.pin_id))

    async def _unpin_now(self, holder: Backend, control_url: str, pin_id: str) -> None:
        try:
            await self.ctx.services.control.unpin(control_url, pin_id)
        except ControlError as exc:
            # The pin expires by itself (pin_ttl); nothing else depends on this call.
            self.ctx.control_failed(holder, "unpin", exc)
