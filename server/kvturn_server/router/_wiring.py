"""The router's wiring: the collaborators one router process holds, built from its config.

``Router`` owns the pools, the backend and control clients, the conversation and response
stores, metrics, tracing, health checks and discovery, and the background calls (unpins,
releases) that outlive a request. It serves nothing itself: ``_app.py`` routes HTTP requests
to the endpoints, which are given the router (or, for a turn, its ``TurnServices``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import httpx2

from kvturn_server.router._backend import BackendClient
from kvturn_server.router._config import DNS_PREFIX, RouterConfig
from kvturn_server.router._control import ControlClient
from kvturn_server.router._discovery import Discovery, targets
from kvturn_server.router._log import event
from kvturn_server.router._lost import LOST_WAIT, LostFollower
from kvturn_server.router._metrics import RouterMetrics
from kvturn_server.router._pool import Backend, HealthChecker, Pool
from kvturn_server.router._services import TurnServices
from kvturn_server.router._state import ConversationStore, MemoryStore, StoreError
from kvturn_server.router._state_responses import ResponseStore, open_response_store
from kvturn_server.router._tracing import Tracing, make_tracing
from kvturn_server.router._transport import PooledTransport

log = logging.getLogger("kvturn.router")


async def open_store(url: str, *, max_entries: int, remember_expired: float,
                     prefix: str = "kvturn:", timeout: float = 2.0,
                     clock: Callable[[], float] = time.time) -> ConversationStore:
    """``memory`` or a Redis URL -> a ready store (Redis is pinged: a wrong URL fails here)."""
    if url == "memory":
        return MemoryStore(max_entries=max_entries, remember_expired=remember_expired,
                           clock=clock)
    from kvturn_server.router._state_redis import RedisStore

    store = RedisStore(url, max_entries=max_entries, remember_expired=remember_expired,
                       prefix=prefix, timeout=timeout, clock=clock)
    await store.ping()
    return store


class Router:
    """Everything one router process holds. ``start`` before serving, ``aclose`` after.

    Args:
        config: the settings.
        transport: the httpx2 transport for every backend call (default: the pooled one, or
            httpx2's own with ``http_client = "httpx"``); tests pass a ``MockTransport``.
        store: the conversation store (default: opened from ``config.state`` at start).
        clock: wall-clock seconds for leases and the store (tests inject a fake).
    """

    def __init__(self, config: RouterConfig, *, transport: httpx2.AsyncBaseTransport | None = None,
                 store: ConversationStore | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
        if transport is None:
            if config.http_client == "pooled":
                transport = PooledTransport(connect_timeout=config.connect_timeout)
            else:
                transport = httpx2.AsyncHTTPTransport(limits=httpx2.Limits(
                    max_connections=None, max_keepalive_connections=512))
        self.client = BackendClient(transport, connect_timeout=config.connect_timeout,
                                    api_key=config.backend_api_key)
        self.control = ControlClient(self.client, timeout=config.control_timeout,
                                     secret=config.control_secret)
        found = targets(config.prefill, config.decode)
        self.prefills = Pool("prefill", [Backend("prefill", url) for url in config.prefill
                                         if not url.startswith(DNS_PREFIX)],
                             eject_after=config.eject_after, readmit_after=config.readmit_after,
                             discovered=any(t.role == "prefill" for t in found))
        self.decodes = Pool("decode", [Backend("decode", d.url, d.control)
                                       for d in config.decode if not d.discovered],
                            eject_after=config.eject_after, readmit_after=config.readmit_after,
                            discovered=any(t.role == "decode" for t in found))
        # dns+ backends (``_discovery.py``): resolved at start, then every interval.
        self.discovery = Discovery(found, {"prefill": self.prefills, "decode": self.decodes},
                                   interval=config.discovery_interval,
                                   timeout=config.connect_timeout,
                                   on_change=self._members_changed)
        self.metrics = RouterMetrics([self.prefills, self.decodes])
        # The decodes' lost logs (``_lost.py``): records of evicted retentions marked lost.
        self.lost = LostFollower(self.decodes, self.control, lambda: self.store, self.metrics,
                                 wait=LOST_WAIT) \
            if config.kv_reuse and config.follow_evictions else None
        self.health = HealthChecker(self.client, self.control, [self.prefills, self.decodes],
                                    interval=config.health_interval,
                                    timeout=config.health_timeout,
                                    on_engine_change=self._engine_changed, also=self._purge)
        self.tracing: Tracing = make_tracing(config.otel)
        self._store = store
        self._services: TurnServices | None = None
        self._responses: ResponseStore | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.started = False
        # Set on SIGTERM (``_drain.py``): /ready answers 503, requests are still served.
        self.draining = False

    @property
    def store(self) -> ConversationStore:
        if self._store is None:
            raise RuntimeError("Router.start() was not called")
        return self._store

    @property
    def services(self) -> TurnServices:
        """What each turn is given (``_services.py``)."""
        if self._services is None:
            self._services = TurnServices(
                config=self.config, client=self.client, control=self.control,
                prefills=self.prefills, decodes=self.decodes, store=self.store,
                metrics=self.metrics, tracing=self.tracing, clock=self.clock,
                sleep=self.sleep, spawn=self.spawn, check_control=self.health.check_control)
        return self._services

    @property
    def responses(self) -> ResponseStore:
        """Stored Responses (``_responses.py``), in the same memory or Redis as ``store``."""
        if self._responses is None:
            c = self.config
            self._responses = open_response_store(
                c.state, max_entries=c.max_responses, max_bytes=c.responses_max_bytes,
                prefix=c.state_prefix, timeout=c.control_timeout, clock=self.clock)
        return self._responses

    async def start(self, *, health_checks: bool = True) -> None:
        """Open the store and start health checks (tests may drive checks themselves)."""
        if self.started:
            return
        c = self.config
        if self._store is None:
            self._store = await open_store(c.state, max_entries=c.max_conversations,
                                           remember_expired=c.remember_expired,
                                           prefix=c.state_prefix, timeout=c.control_timeout,
                                           clock=self.clock)
        if self.discovery.targets:
            await self.discovery.refresh()
            self.discovery.start()
        if health_checks:
            self.health.start()
            if self.lost is not None:
                self.lost.start()
        self.started = True
        event(log, logging.INFO, "router_started", prefill=len(c.prefill),
              decode=len(c.decode), state=self.store.kind)

    async def aclose(self) -> None:
        """Stop health checks, let background calls (unpins, releases) finish, close."""
        await self.discovery.stop()
        await self.health.stop()
        if self.lost is not None:
            await self.lost.stop()
        with contextlib.suppress(TimeoutError):
            await self.wait_idle(self.config.drain_timeout)
        for task in list(self._tasks):
            task.cancel()
        await self.client.aclose()
        self.tracing.shutdown()
        if self._store is not None:
            await self._store.aclose()
        if self._responses is not None:
            await self._responses.aclose()
            self._responses = None
        self._services = None
        self.started = False

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` off the request path; shutdown waits for it."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    async def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no background call is pending (tests use this instead of sleeping)."""
        async with asyncio.timeout(timeout):
            while self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _members_changed(self) -> None:
        self.health.poke()  # check the newcomers now rather than an interval from now

    def _engine_changed(self, backend: Backend, old: str | None, new: str) -> None:
        if old is not None:
            # Handles to the old engine's retentions are now stale; each is dropped (and
            # counted) when its conversation next comes by.
            event(log, logging.WARNING, "decode_restarted", backend=backend.url,
                  old_engine_id=old, engine_id=new)

    async def _purge(self) -> None:
        try:
            await self.store.purge()
            self.metrics.conversations.set(await self.store.size())
        except StoreError as exc:
            self.metrics.state_errors.inc()
            event(log, logging.WARNING, "state_store_failed", op="purge", error=str(exc))

    def begin_drain(self, why: str) -> None:
        """Leave the load balancers' rotation: /ready answers 503 from now on."""
        if not self.draining:
            self.draining = True
            event(log, logging.INFO, "router_draining", why=why,
                  grace_s=self.config.drain_grace, drain_timeout_s=self.config.drain_timeout)

    def not_ready_reason(self) -> str | None:
        """Why this router should get no traffic now, or None when it should."""
        if self.draining:
            return "draining: the router is shutting down"
        if not self.started:
            return "starting"
        if self.health.running and self.health.rounds == 0:
            return "the first health checks of the backends have not finished"
        for pool in (self.prefills, self.decodes):
            if not pool.healthy:
                return (f"no healthy {pool.role} backend ({len(pool.members)} known, all "
                        f"ejected)" if pool.members else f"no {pool.role} backend known yet")
        return None
