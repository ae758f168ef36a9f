"""Step 5 of a turn: capture what the decode retained, record it, release what it replaced.

Non-streaming, the decode's reply says what it retained (``kv_transfer_params.kvturn``);
streaming (or a reply that does not say), the router asks the decode's control endpoint once
the stream ended. The store then says ``key -> (decode, engine_id, num_tokens, expires_at)``;
when a conversation moved to another decode, its retention on the old one is released. With
``kv_reuse`` off nothing is retained, but the record still sends the conversation's next turn
to the same prefill and decode (session affinity).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvturn_server.router._control import ControlError, Gone, Retention
from kvturn_server.router._history import Transcript
from kvturn_server.router._legs import (
    DecodeUsage,
    ReuseReport,
    read_id_of,
    readable_tokens,
    retained_report,
)
from kvturn_server.router._log import event
from kvturn_server.router._placement import served_tokens
from kvturn_server.router._plan import moved_from, recorded_prefill
from kvturn_server.router._pool import Backend
from kvturn_server.router._services import TurnContext
from kvturn_server.router._state import SUPERSEDED, Placement, StoreError
from kvturn_server.router._tracing import TurnTrace

log = logging.getLogger("kvturn.router")


class Capture:
    """One turn's capture, once its decode leg answered.

    Args:
        ctx: the turn's services and identity (its key is set: only keyed turns capture).
        trace: the turn's trace (the describe calls are its ``capture`` leg).
        version: when the turn began, on the router's clock (``Placement.version``).
        late: the request has stop strings: the decode retains after its reply ends.
        old: the record the turn found (None: the conversation's first turn, or unknown).
        prefill: the prefill that computed this turn's prompt, None when none did.
        prefill_tokens: the prompt tokens that prefill computed.
        transcript: the conversation so far, for a later turn's continuation estimate.
    """

    __slots__ = ("ctx", "late", "old", "prefill", "prefill_tokens", "trace", "transcript",
                 "version")

    def __init__(self, ctx: TurnContext, trace: TurnTrace, *, version: float, late: bool,
                 old: Placement | None, prefill: Backend | None, prefill_tokens: int,
                 transcript: Transcript | None) -> None:
        assert ctx.key is not None
        self.ctx = ctx
        self.trace = trace
        self.version = version
        self.late = late
        self.old = old
        self.prefill = prefill
        self.prefill_tokens = prefill_tokens
        self.transcript = transcript

    async def from_reply(self, backend: Backend, payload: dict[str, Any],
                         decode_started: float, usage: DecodeUsage | None) -> ReuseReport | None:
        """Capture from a non-streaming reply; returns what the decode's own prefix cache
        supplied, when the reply says (a turn the decode continued itself)."""
        report = retained_report(payload)
        if report is not None and report.engine_id is not None:
            self.ctx.services.decodes.http_engine_seen(backend, report.engine_id)
            if backend.control_engine_id not in (None, report.engine_id) \
                    and backend.control_url is not None:
                # A restart between two health checks, most likely: ask the control endpoint
                # now, before the client has this reply and can send its next turn.
                await self.ctx.services.check_control(backend)
                if not backend.control_trusted:
                    self.ctx.engines_differ(backend)
        if report is None:
            # The reply does not say (a stop string ended it: vLLM's front end answered before
            # the engine finished the request; or an older connector): ask the decode, before
            # the client has the reply and can send its next turn.
            await self.described(backend, decode_started, usage)
            return None
        services = self.ctx.services
        if not report.retained:
            services.metrics.capture("not_retained")
            await self._record_unretained(backend, report.engine_id or backend.engine_id, usage)
            return report.reuse
        expires_in = report.expires_in if report.expires_in is not None \
            else services.config.retention_ttl
        await self._record(backend, report.engine_id or backend.engine_id,
                           report.num_tokens or 0, expires_in,
                           readable=report.readable_tokens, block_size=report.block_size,
                           read_id=report.read_id)
        return report.reuse

    async def described(self, backend: Backend, decode_started: float,
                        usage: DecodeUsage | None) -> None:
        """After a stream: ask the decode what it retained under the key.

        The decode retains when the request finishes, which may trail the stream's last byte;
        a retention older than this turn's decode leg is the previous turn's, so ask again
        (``capture_attempts``) before taking it. A request with stop strings trails most: vLLM
        ends it with an abort sent to the engine after the reply, so for those "nothing
        retained" is asked again too (for others it is final at once: a turn too short to
        fill a block, or the conversation's first turn on this decode).
        """
        ctx, services, key = self.ctx, self.ctx.services, self.ctx.conversation
        if backend.control_url is None or not backend.control_trusted:
            services.metrics.capture("failed")
            await self._record_unretained(backend, backend.engine_id, usage)
            return
        t0 = time.perf_counter()
        span = self.trace.leg("capture", backend.url)
        result: Retention | Gone | None = None
        for attempt in range(services.config.capture_attempts):
            if attempt:
                await services.sleep(services.config.capture_retry_delay)
            try:
                result = await services.control.describe(backend.control_url, key)
            except ControlError as exc:
                span.end(exc.kind)
                ctx.control_failed(backend, "describe", exc)
                services.metrics.capture("failed")
                await self._record_unretained(backend, backend.engine_id, usage)
                return
            services.decodes.control_answered(backend)
            if isinstance(result, Gone):
                if not self.late:
                    break
            elif result.created_ago is None \
                    or result.created_ago <= time.perf_counter() - decode_started:
                break
        span.end()
        ctx.leg("capture", time.perf_counter() - t0)
        if isinstance(result, Gone):
            services.metrics.capture("not_retained")
            await self._record_unretained(backend, backend.engine_id, usage)
            return
        assert result is not None
        readable, block_size = readable_tokens(result.params)
        await self._record(backend, result.engine_id or backend.engine_id, result.num_tokens,
                           result.expires_in, readable=readable, block_size=block_size,
                           read_id=read_id_of(result.params))

    async def _record_unretained(self, backend: Backend, engine_id: str | None,
                                 usage: DecodeUsage | None) -> None:
        """The decode served the turn but retains nothing of it (over the budget, too short
        to fill a block, or its control endpoint did not say). The record still names it and
        the turn's messages, as a stock router's would: its plain prefix cache may hold the
        conversation, so a short next turn continues there (``_placement.continuation``)."""
        await self._record(backend, engine_id, served_tokens(usage, self.prefill_tokens),
                           self.ctx.services.config.retention_ttl, retained=False)

    async def remember_affinity(self, backend: Backend, usage: DecodeUsage | None) -> None:
        """Stock P/D (``kv_reuse`` off): nothing is retained, but the conversation's next turn
        goes to the same prefill and decode (session affinity). The record keeps what the
        router knows of the turn (the tokens the decode's usage counted, its messages) for
        stock conditional disaggregation (``_placement.conditional_decode``)."""
        services, key = self.ctx.services, self.ctx.conversation
        placement = self._placement_for(backend, backend.engine_id,
                                        served_tokens(usage, self.prefill_tokens),
                                        services.config.retention_ttl, readable=None,
                                        block_size=0, retained=False)
        try:
            await services.store.put(key, placement)
        except StoreError as exc:
            self.ctx.state_error("put", exc)

    def _placement_for(self, backend: Backend, engine_id: str | None, num_tokens: int,
                       expires_in: float, *, readable: int | None,
                       block_size: int, retained: bool = True,
                       read_id: str | None = None) -> Placement:
        """This turn's record: where it is retained, and which prefill holds its prompt (the
        one that computed this turn's prefill leg, else the one recorded before)."""
        prefill, prefill_tokens = recorded_prefill(
            self.old, None if self.prefill is None else self.prefill.url, self.prefill_tokens)
        now = self.ctx.services.clock()
        return Placement(decode=backend.url, engine_id=engine_id, num_tokens=num_tokens,
                         expires_at=now + expires_in, turn=self.ctx.request_id,
                         version=self.version,
                         readable_tokens=readable, block_size=block_size, prefill=prefill,
                         prefill_tokens=prefill_tokens,
                         history=None if self.transcript is None else self.transcript.history(),
                         retained=retained, read_id=read_id)

    async def _record(self, backend: Backend, engine_id: str | None, num_tokens: int,
                      expires_in: float, *, readable: int | None = None,
                      block_size: int = 0, retained: bool = True,
                      read_id: str | None = None) -> None:
        services, key = self.ctx.services, self.ctx.conversation
        old_engine = backend.engine_id
        # The decode itself just named its engine: fresher than the last health check, which
        # may not have seen a restart yet (the next pin would call this handle stale).
        if engine_id is not None and services.decodes.engine_seen(backend, engine_id) \
                and old_engine is not None:
            event(log, logging.WARNING, "decode_restarted", backend=backend.url,
                  old_engine_id=old_engine, engine_id=engine_id)
        placement = self._placement_for(backend, engine_id, num_tokens, expires_in,
                                        readable=readable, block_size=block_size,
                                        retained=retained, read_id=read_id)
        try:
            evicted = await services.store.put(key, placement)
        except StoreError as exc:
            services.metrics.capture("failed")
            self.ctx.state_error("put", exc)
            return
        if evicted == SUPERSEDED:
            services.metrics.capture("superseded")
            self._superseded(backend)
            return
        services.metrics.capture("recorded")
        if evicted:
            services.metrics.evictions.inc(evicted)
        moved = moved_from(self.old, backend.url)
        if moved is not None:
            self._release_on(moved)

    def _superseded(self, backend: Backend) -> None:
        """A concurrent turn of this conversation (on this router or another) recorded a
        newer retention: this one is not kept. Freed on its decode unless the newer one is
        on the same decode (which then holds only the newer one, under the same key)."""
        services, key = self.ctx.services, self.ctx.conversation

        async def free() -> None:
            try:
                newest = await services.store.get(key)
            except StoreError as exc:
                self.ctx.state_error("get", exc)
                return
            if newest is not None and newest.decode != backend.url:
                self._release_on(backend.url)

        services.spawn(free())

    def _release_on(self, decode_url: str) -> None:
        """The conversation moved: free its previous retention on the old decode."""
        services, key = self.ctx.services, self.ctx.conversation
        old = services.decodes.by_url(decode_url)
        if old is None or old.control_url is None or not old.healthy:
            return
        control_url = old.control_url

        async def release() -> None:
            try:
                await services.control.release(control_url, key)
            except ControlError as exc:
                self.ctx.control_failed(old, "release", exc)

        services.spawn(release())
