"""Following what the decodes drop on their own, so that the records say so.

A retention evicted (over the budget, or live requests needed its blocks) or expired leaves
its decode without the router being asked. The router's record would still send the
conversation's next turn to continue on that decode, which would recompute the whole history
there, in the middle of its other requests' decoding. Each decode's connector logs such drops
(``GET /kvturn/v1/lost``, docs/http-api.md C); the router follows every decode's log with a
long poll (one request per burst of drops, or per ``wait`` seconds when there is none) and
marks a record lost when the retention it names is the one dropped (its read id): the next
turn then takes a prefill, whose cache may still hold the prompt, and the record keeps the
conversation's affinity (``_placement.continuation``). A newer retention under the same key
has another read id and is left alone. Everything here is a hint: a missed entry (the router
fell behind the decode's log, or was down) costs one turn on a decode that holds nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvturn.wire import GoneReason
from kvturn_server.router._control import ControlClient, ControlError
from kvturn_server.router._log import event
from kvturn_server.router._metrics import RouterMetrics
from kvturn_server.router._plan import marked_lost
from kvturn_server.router._pool import Backend, Pool, cancel_and_wait
from kvturn_server.router._state import ConversationStore, StoreError

log = logging.getLogger("kvturn.router")

LOST_WAIT = 10.0
"""Seconds one long poll of a decode's lost log waits for an entry (at most the connector's
30): a follower makes a request per burst of drops, or one per this when there is none."""


class LostFollower:
    """One long-poll loop per decode with a control endpoint; started and stopped with the
    router. Decodes that join or leave the pool (DNS discovery) are picked up every ``wait``
    seconds."""

    def __init__(self, decodes: Pool, control: ControlClient,
                 store: Callable[[], ConversationStore], metrics: RouterMetrics, *,
                 wait: float, retry: float = 1.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.decodes = decodes
        self.control = control
        self.store = store
        self.metrics = metrics
        self.wait = wait
        self.retry = retry
        self.sleep = sleep
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name="kvturn-lost")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for task in self._loops.values():
            await cancel_and_wait(task)
        self._loops.clear()

    async def _supervise(self) -> None:
        while True:
            members = {b.url: b for b in self.decodes.members if b.control_url is not None}
            for url in list(self._loops):
                if url not in members:
                    await cancel_and_wait(self._loops.pop(url))
            for url, backend in members.items():
                if url not in self._loops or self._loops[url].done():
                    self._loops[url] = asyncio.create_task(self.follow(backend),
                                                           name=f"kvturn-lost:{url}")
            await self.sleep(self.wait)

    async def follow(self, backend: Backend) -> None:
        """Follow one decode's log for good: each entry is marked on the record it names.
        A new engine (a restart) starts over at its log's end: its predecessor's retentions
        are stale for the router already (``engine_id``)."""
        cursor, engine = 0, None
        while True:
            assert backend.control_url is not None
            try:
                got = await self.control.lost(backend.control_url, cursor,
                                              self.wait if engine is not None else 0.0)
            except ControlError as exc:
                if exc.kind not in ("timeout", "connect"):
                    event(log, logging.DEBUG, "lost_follow_failed", backend=backend.url,
                          kind=exc.kind, error=str(exc))
                await self.sleep(self.retry)
                continue
            if got.engine_id != engine:
                # The first answer of an engine: start at its log's end (nothing this router
                # recorded of it can be older than the router's own start, and a restarted
                # engine's records are stale anyway).
                cursor, engine = got.seq, got.engine_id
                continue
            cursor = got.seq
            if got.truncated:
                self.metrics.lost_entries("missed")
            for key, reason, read_id in got.lost:
                await self._mark(backend, key, reason, read_id)

    async def _mark(self, backend: Backend, key: str, reason: GoneReason,
                    read_id: str) -> None:
        store = self.store()
        try:
            marked = marked_lost(await store.get(key), decode=backend.url, read_id=read_id,
                                 reason=reason)
            if marked is None:
                self.metrics.lost_entries("unmatched")
                return
            await store.put(key, marked)
        except StoreError:
            self.metrics.state_errors.inc()
            return
        self.metrics.lost_entries(reason)

