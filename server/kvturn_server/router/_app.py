"""The router's HTTP app: which endpoint serves which path, and ``serve``.

Endpoints (docs/http-api.md, section A): ``POST /v1/chat/completions``, ``POST
/v1/completions``, ``POST /v1/messages`` (``_turn.py``), ``POST /v1/responses``
(``_responses.py``), ``POST /v1/messages/count_tokens`` and ``GET /v1/models``
(``_endpoints.py``), ``GET /health``, ``GET /ready``, ``GET /metrics`` (here),
``POST /kvturn/v1/conversations/{id}/keepalive`` and ``DELETE /kvturn/v1/conversations/{id}``
(``_conversations.py``). What they share (pools, clients, stores) is the ``Router``
(``_wiring.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx2
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvturn.wire import CONVERSATIONS_PREFIX
from kvturn_server.router import _json
from kvturn_server.router._config import RouterConfig, RouterConfigError
from kvturn_server.router._conversations import conversation_endpoint
from kvturn_server.router._endpoints import (
    TURN_PATHS,
    count_tokens,
    failure_response,
    models,
    turn_endpoint,
)
from kvturn_server.router._errors import error_response
from kvturn_server.router._log import event, setup_logging
from kvturn_server.router._protocol import h11_protocol, httptools_protocol
from kvturn_server.router._state import ConversationStore, StoreError
from kvturn_server.router._wiring import Router

log = logging.getLogger("kvturn.router")


async def health(router: Router, request: Request) -> Response:
    prefill = len(router.prefills.healthy)
    decode = len(router.decodes.healthy)
    body = {"status": "ok" if prefill and decode else "degraded",
            "prefill": {"healthy": prefill, "total": len(router.prefills.members)},
            "decode": {"healthy": decode, "total": len(router.decodes.members)},
            "state": router.store.kind}
    return Response(_json.dumps(body), media_type="application/json")


async def ready(router: Router, request: Request) -> Response:
    """Readiness (for a load balancer's probe): 200 with at least one healthy prefill and
    decode, 503 otherwise and while draining; the body says why."""
    why = router.not_ready_reason()
    body: dict[str, Any] = {
        "status": "ready" if why is None else "not_ready",
        "prefill": {"healthy": len(router.prefills.healthy),
                    "total": len(router.prefills.members)},
        "decode": {"healthy": len(router.decodes.healthy),
                   "total": len(router.decodes.members)},
        "draining": router.draining}
    if why is not None:
        body["why"] = why
    return Response(_json.dumps(body), status_code=200 if why is None else 503,
                    media_type="application/json")


async def metrics(router: Router, request: Request) -> Response:
    try:
        router.metrics.conversations.set(await router.store.size())
    except StoreError:
        router.metrics.state_errors.inc()
    return Response(generate_latest(router.metrics.registry),
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

    def bound(endpoint: Callable[[Router, Request], Awaitable[Response]]
              ) -> Callable[[Request], Awaitable[Response]]:
        async def serve_with_router(request: Request) -> Response:
            return await endpoint(router, request)
        return serve_with_router

    # The turn paths reach Starlette only with odd paths or methods (``RouterApp``).
    completions = bound(turn_endpoint)
    app = Starlette(
        exception_handlers={HTTPException: http_error},
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/messages", completions, methods=["POST"]),
            Route("/v1/responses", completions, methods=["POST"]),
            Route("/v1/messages/count_tokens", bound(count_tokens), methods=["POST"]),
            Route("/v1/models", bound(models), methods=["GET"]),
            Route("/health", bound(health), methods=["GET"]),
            Route("/ready", bound(ready), methods=["GET"]),
            Route("/metrics", bound(metrics), methods=["GET"]),
            Route(CONVERSATIONS_PREFIX + "{rest:path}", bound(conversation_endpoint),
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
