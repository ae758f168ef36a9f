"""The router's HTTP app: OpenAI-compatible endpoints over prefill and decode legs."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx2
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvturn_server.router._backend import Backend, BackendError
from kvturn_server.router._config import RouterConfig
from kvturn_server.router._errors import error_response
from kvturn_server.router._legs import client_body, decode_body, prefill_body

log = logging.getLogger("kvturn.router")


class Router:
    """Turns each request into a prefill leg and a decode leg."""

    def __init__(self, config: RouterConfig, client: httpx2.AsyncClient | None = None) -> None:
        self.config = config
        self.client = client or httpx2.AsyncClient(
            limits=httpx2.Limits(max_connections=1000, max_keepalive_connections=100))
        self.prefills = [Backend(url, self.client) for url in config.prefill]
        self.decodes = [Backend(url, self.client) for url in config.decode]
        self._next_prefill = itertools.cycle(self.prefills)
        self._next_decode = itertools.cycle(self.decodes)
        self.prefill_timeout = httpx2.Timeout(config.prefill_timeout,
                                              connect=config.connect_timeout)
        self.decode_timeout = httpx2.Timeout(config.decode_timeout,
                                             connect=config.connect_timeout)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def completion(self, request: Request) -> Response:
        path = request.url.path
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error_response(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        body = client_body(body)
        started = time.perf_counter()

        params, early = await self._prefill(path, body, request_id)
        if early is not None:
            return early
        prefill_ms = (time.perf_counter() - started) * 1000
        leg = decode_body(body, params)
        decode = next(self._next_decode)
        headers = {"x-request-id": request_id}
        if body.get("stream"):
            log.info("request_id=%s path=%s prefill_ms=%.1f streaming from %s", request_id,
                     path, prefill_ms, decode.base_url)
            return await self._stream(decode, path, leg, headers, prefill_ms)
        try:
            status, payload = await decode.post_json(path, leg, self.decode_timeout)
        except BackendError as exc:
            log.warning("decode failed request_id=%s: %s", request_id, exc)
            return error_response(502, f"decode backend failed: {exc}", type_="server_error",
                                  retry_after=1)
        log.info("request_id=%s path=%s prefill_ms=%.1f total_ms=%.1f status=%d", request_id,
                 path, prefill_ms, (time.perf_counter() - started) * 1000, status)
        return JSONResponse(payload, status_code=status, headers=headers)

    async def _prefill(self, path: str, body: dict[str, Any],
                       request_id: str) -> tuple[dict[str, Any] | None, Response | None]:
        """Run the prefill leg: (transfer params or None, or an error to return as is)."""
        prefill = next(self._next_prefill)
        try:
            status, payload = await prefill.post_json(path, prefill_body(body),
                                                      self.prefill_timeout)
        except BackendError as exc:
            log.warning("prefill failed, decode will compute the prompt request_id=%s: %s",
                        request_id, exc)
            return None, None
        if 400 <= status < 500:
            # The request itself is wrong (unknown model, bad parameter): the decode would
            # refuse it the same way, so the client gets the error now.
            return None, JSONResponse(payload, status_code=status)
        params = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
        if status != 200 or not isinstance(params, dict):
            log.warning("prefill answered %d without transfer params request_id=%s; decode "
                        "will compute the prompt", status, request_id)
            return None, None
        return params, None

    async def _stream(self, decode: Backend, path: str, leg: dict[str, Any],
                      headers: dict[str, str], prefill_ms: float) -> Response:
        try:
            resp = await decode.open_stream(path, leg, self.decode_timeout)
        except BackendError as exc:
            return error_response(502, f"decode backend failed: {exc}", type_="server_error",
                                  retry_after=1)
        if resp.status_code != 200:
            raw = await resp.aread()
            await resp.aclose()
            return Response(raw, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))
        headers["x-kvturn-prefill-ms"] = f"{prefill_ms:.1f}"
        return StreamingResponse(_relay(resp), status_code=200, headers=headers,
                                 media_type=resp.headers.get("content-type", "text/event-stream"),
                                 background=BackgroundTask(resp.aclose))

    async def models(self, request: Request) -> Response:
        decode = next(self._next_decode)
        try:
            status, payload = await decode.get("/v1/models", self.decode_timeout)
        except BackendError as exc:
            return error_response(502, f"decode backend failed: {exc}", type_="server_error",
                                  retry_after=1)
        return JSONResponse(payload, status_code=status)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})


async def _relay(resp: httpx2.Response) -> AsyncIterator[bytes]:
    """Pass the decode's SSE bytes through unchanged, chunk by chunk (no buffering)."""
    async for chunk in resp.aiter_raw():
        yield chunk


def create_app(config: RouterConfig, client: httpx2.AsyncClient | None = None) -> Starlette:
    """The router as an ASGI app; ``client`` lets tests inject a mock transport."""
    router = Router(config, client)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await router.aclose()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", router.completion, methods=["POST"]),
            Route("/v1/completions", router.completion, methods=["POST"]),
            Route("/v1/models", router.models, methods=["GET"]),
            Route("/health", router.health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.router = router
    return app


def serve(config: RouterConfig) -> None:
    """Run the router until interrupted (``kvturn router``)."""
    import uvicorn

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # One line per backend call is noise at INFO; the router logs each request itself.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="warning")
