"""The router: wiring (pools, backend client, control client, state, metrics) and its HTTP app.

Endpoints (docs/http-api.md, section A): ``POST /v1/chat/completions``, ``POST
/v1/completions``, ``POST /v1/messages`` (``_turn.py``), ``POST /v1/responses``
(``_responses.py``), ``GET /v1/models``, ``GET /health``, ``GET /ready``, ``GET /metrics``,
``POST /kvturn/v1/conversations/{id}/keepalive`` and ``DELETE /kvturn/v1/conversations/{id}``
(``_conversations.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import httpx2
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvturn_server.router import _json
from kvturn_server.router._backend import BackendClient, BackendError
from kvturn_server.router._config import DNS_PREFIX, RouterConfig, RouterConfigError
from kvturn_server.router._control import ControlClient
from kvturn_server.router._conversations import conversation_endpoint
from kvturn_server.router._discovery import Discovery, targets
from kvturn_server.router._endpoints import (
    TURN_PATHS,
    count_tokens,
    failure_response,
    turn_endpoint,
)
from kvturn_server.router._errors import error_response
from kvturn_server.router._log import event, setup_logging
from kvturn_server.router._metrics import RouterMetrics
from kvturn_server.router._pool import Backend, HealthChecker, Pool
from kvturn_server.router._protocol import h11_protocol, httptools_protocol
from kvturn_server.router._state import ConversationStore, StoreError, open_store
from kvturn_server.router._state_responses import ResponseStore, open_response_store
from kvturn_server.router._tracing import Tracing, make_tracing
from kvturn_server.router._transport import PooledTransport

log = logging.getLogger("kvturn.router")


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
        self.health = HealthChecker(self.client, self.control, [self.prefills, self.decodes],
                                    interval=config.health_interval,
                                    timeout=config.health_timeout,
                                    on_engine_change=self._engine_changed, also=self._purge)
        self.tracing: Tracing = make_tracing(config.otel)
        self._store = store
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
        self.started = True
        event(log, logging.INFO, "router_started", prefill=len(c.prefill),
              decode=len(c.decode), state=self.store.kind)

    async def aclose(self) -> None:
        """Stop health checks, let background calls (unpins, releases) finish, close."""
        await self.discovery.stop()
        await self.health.stop()
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

    # Endpoints other than completions and conversations.

    async def models(self, request: Request) -> Response:
        exclude: Backend | None = None
        for _ in range(2):
            decode = self.decodes.pick(exclude=exclude)
            if decode is None:
                break
            try:
                reply = await self.client.call("GET", decode.url + "/v1/models",
                                               timeout=self.config.decode_timeout)
            except BackendError as exc:
                self.decodes.leg_failed(decode, f"models: {exc}")
                exclude = decode
                continue
            return Response(reply.body, status_code=reply.status,
                            media_type=reply.content_type)
        return error_response(503, "no decode backend answered", type_="server_error",
                              code="backend_unavailable", retry_after=self.config.retry_after)

    async def health_endpoint(self, request: Request) -> Response:
        prefill = len(self.prefills.healthy)
        decode = len(self.decodes.healthy)
        body = {"status": "ok" if prefill and decode else "degraded",
                "prefill": {"healthy": prefill, "total": len(self.prefills.members)},
                "decode": {"healthy": decode, "total": len(self.decodes.members)},
                "state": self.store.kind}
        return Response(_json.dumps(body), media_type="application/json")

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

    async def ready_endpoint(self, request: Request) -> Response:
        """Readiness (for a load balancer's probe): 200 with at least one healthy prefill and
        decode, 503 otherwise and while draining; the body says why."""
        why = self.not_ready_reason()
        body: dict[str, Any] = {
            "status": "ready" if why is None else "not_ready",
            "prefill": {"healthy": len(self.prefills.healthy),
                        "total": len(self.prefills.members)},
            "decode": {"healthy": len(self.decodes.healthy),
                       "total": len(self.decodes.members)},
            "draining": self.draining}
        if why is not None:
            body["why"] = why
        return Response(_json.dumps(body), status_code=200 if why is None else 503,
                        media_type="application/json")

    async def metrics_endpoint(self, request: Request) -> Response:
        try:
            self.metrics.conversations.set(await self.store.size())
        except StoreError:
            self.metrics.state_errors.inc()
        return Response(generate_latest(self.metrics.registry),
                        headers={"content-type": CONTENT_TYPE_LATEST})


class RouterApp:
    """The router's ASGI app: completions go straight to the turn code, everything else
    (and the lifespan) through a Starlette app.

    Completions bypass Starlette's middleware because a stream sends one ASGI message per
    token and each middleware layer wraps every one of them; the router answers its own
    errors anyway. ``state.router`` is the ``Router``.
    """

    _HOT = TURN_PATHS

    def __init__(self, router: Router, app: Starlette) -> None:
        self.router = router
        self.app = app
        self.state = app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self._HOT:
            try:
                response = await turn_endpoint(self.router, Request(scope, receive))
            except Exception:  # a bug must still give the client an API-shaped answer
                log.exception("completion request failed")
                response = failure_response(self.router, scope["path"])
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(config: RouterConfig, transport: httpx2.AsyncBaseTransport | None = None, *,
               store: ConversationStore | None = None,
               clock: Callable[[], float] = time.time) -> RouterApp:
    """The router as an ASGI app (``app.state.router``); its lifespan starts and stops it."""
    router = Router(config, transport=transport, store=store, clock=clock)

    async def conversations(request: Request) -> Response:
        return await conversation_endpoint(router, request)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.aclose()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(exc.status_code, f"{exc.detail}: {request.method} "
                                               f"{request.url.path}",
                              type_="not_found_error" if exc.status_code == 404
                              else "invalid_request_error", code="no_route")

    async def completions(request: Request) -> Response:  # reached only by odd paths/methods
        return await turn_endpoint(router, request)

    async def messages_count_tokens(request: Request) -> Response:
        return await count_tokens(router, request)

    app = Starlette(
        exception_handlers={HTTPException: http_error},
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/messages", completions, methods=["POST"]),
            Route("/v1/responses", completions, methods=["POST"]),
            Route("/v1/messages/count_tokens", messages_count_tokens, methods=["POST"]),
            Route("/v1/models", router.models, methods=["GET"]),
            Route("/health", router.health_endpoint, methods=["GET"]),
            Route("/ready", router.ready_endpoint, methods=["GET"]),
            Route("/metrics", router.metrics_endpoint, methods=["GET"]),
            Route("/kvturn/v1/conversations/{rest:path}", conversations,
                  methods=["POST", "DELETE"]),
        ],
        lifespan=lifespan,
    )
    app.state.router = router
    return RouterApp(router, app)


def _uvicorn_options() -> dict[str, Any]:
    options: dict[str, Any] = {"http": h11_protocol()}
    with contextlib.suppress(ImportError):
        import uvloop  # noqa: F401

        options["loop"] = "uvloop"
    with contextlib.suppress(ImportError):
        import httptools  # noqa: F401

        options["http"] = httptools_protocol()
    return options


def _check_state(config: RouterConfig) -> None:
    """Fail at start, in one line, when the Redis state store cannot be reached."""
    if config.state == "memory":
        return
    try:
        import redis
    except ImportError as exc:
        raise RouterConfigError(
            "--state redis://... needs the redis package (pip install 'kvturn[redis]')") from exc
    client = redis.Redis.from_url(config.state, socket_timeout=config.control_timeout,
                                  socket_connect_timeout=config.control_timeout)
    try:
        client.ping()
    except redis.RedisError as exc:
        shown = config.summary()["state"]
        raise RouterConfigError(f"cannot reach the Redis state store at {shown}: {exc}") \
            from exc
    finally:
        client.close()


def serve(config: RouterConfig) -> None:
    """Run the router until SIGINT/SIGTERM (``kvturn router``): SIGTERM drains
    (``_drain.py``: ``drain_grace`` seconds of service while /ready answers 503, then
    in-flight requests and streams get ``drain_timeout`` seconds to finish). RouterConfigError
    (one line) when it cannot start: an unreachable Redis state store."""
    import uvicorn

    from kvturn_server.router._drain import DrainingServer

    _check_state(config)
    setup_logging(config.log_level, config.log_format)
    event(log, logging.INFO, "router_config", **config.summary())
    app = create_app(config)
    server_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level="warning", access_log=False,
        proxy_headers=False, server_header=False,
        timeout_graceful_shutdown=math.ceil(config.drain_timeout), **_uvicorn_options())
    server = DrainingServer(server_config, app.router, grace=config.drain_grace)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(3)  # uvicorn's code for a server that could not start (port taken)
