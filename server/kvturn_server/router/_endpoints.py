"""The model endpoints by path: which API a request speaks and how its errors look.

``/v1/chat/completions`` and ``/v1/completions`` answer OpenAI-shaped errors,
``/v1/messages`` Anthropic-shaped ones (the router's own errors are reshaped; vLLM's Messages
errors already are), ``/v1/responses`` first expands its stored state (``_responses.py``).
``/v1/messages/count_tokens`` and ``/v1/models`` are no turn: one backend answers them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from kvturn.wire import HEADER_NO_REUSE, HEADER_REQUEST_ID
from kvturn_server.router import _json
from kvturn_server.router._apis import API_BY_PATH, CHAT, anthropic_errors
from kvturn_server.router._backend import BackendError
from kvturn_server.router._body import BodyError, read_json_body
from kvturn_server.router._errors import ApiError, error_response
from kvturn_server.router._identity import resolve_identity
from kvturn_server.router._legs import client_body
from kvturn_server.router._pool import Backend, Pool
from kvturn_server.router._responses import responses_endpoint
from kvturn_server.router._turn import Turn, request_id_of, traced

if TYPE_CHECKING:
    from kvturn_server.router._wiring import Router

TURN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages",
                        "/v1/responses"})


async def turn_endpoint(router: Router, request: Request) -> Response:
    """Serve one turn on any of ``TURN_PATHS``."""
    path = request.scope["path"]
    if path == "/v1/responses":
        return await responses_endpoint(router, request)
    response = await completion(router, request)
    return anthropic_errors(response) if path == "/v1/messages" else response


async def completion(router: Router, request: Request) -> Response:
    """``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/messages`` (whose errors
    the caller reshapes, ``_endpoints.py``)."""
    started = time.perf_counter()
    path = request.scope["path"]
    api = API_BY_PATH.get(path) or (CHAT if path.endswith("/chat/completions")
                                    else API_BY_PATH["/v1/completions"])
    headers = request.headers
    request_id = request_id_of(headers.get(HEADER_REQUEST_ID))
    try:
        body = await read_json_body(request, router.config.max_body_bytes,
                                    router.config.body_timeout)
        identity = resolve_identity(body, headers)
        # Before any leg, pin or record: what only the decode would refuse is refused here.
        api.validate(body)
    except ApiError as exc:
        router.metrics.request(api.name, "invalid")
        extra = {HEADER_REQUEST_ID: request_id}
        if isinstance(exc, BodyError) and exc.close:
            extra["connection"] = "close"  # the rest of the body is not worth reading
        return exc.response(extra)
    turn = Turn(router.services, request_id=request_id, path=path, body=client_body(body),
                identity=identity, no_reuse=HEADER_NO_REUSE in headers, started=started,
                api=api)
    traced(turn, headers)
    return await turn.run()


def failure_response(router: Router, path: str) -> Response:
    """What a turn that raised (a bug) answers, in its API's error shape."""
    response = error_response(500, "the router failed on this request", type_="server_error",
                              code="router_error", retry_after=router.config.retry_after)
    return anthropic_errors(response) if path == "/v1/messages" else response


async def count_tokens(router: Router, request: Request) -> Response:
    """``POST /v1/messages/count_tokens`` (coding agents ask it before long turns): no turn,
    no state; a prefill answers it (tokenizing is prompt-side work), another on failure."""
    try:
        body = client_body(await read_json_body(request, router.config.max_body_bytes,
                                                router.config.body_timeout))
    except ApiError as exc:
        return anthropic_errors(exc.response())
    reply = await _first_answer(router, router.prefills, "POST", "/v1/messages/count_tokens",
                                _json.dumps(body), router.config.prefill_timeout)
    if reply is not None:
        return reply
    return anthropic_errors(error_response(
        503, "no prefill backend answered", type_="server_error", code="backend_unavailable",
        retry_after=router.config.retry_after))


async def models(router: Router, request: Request) -> Response:
    """``GET /v1/models``: a decode's list (another decode's on failure)."""
    reply = await _first_answer(router, router.decodes, "GET", "/v1/models", None,
                                router.config.decode_timeout)
    if reply is not None:
        return reply
    return error_response(503, "no decode backend answered", type_="server_error",
                          code="backend_unavailable", retry_after=router.config.retry_after)


async def _first_answer(router: Router, pool: Pool, method: str, path: str,
                        data: bytes | None, timeout: float) -> Response | None:
    """``pool``'s answer to a request that holds no state, from a second backend when the
    first fails; None when neither answered."""
    exclude: Backend | None = None
    for _ in range(2):
        backend = pool.pick(exclude=exclude)
        if backend is None:
            break
        try:
            reply = await router.client.call(method, backend.url + path, data, timeout=timeout)
        except BackendError as exc:
            pool.leg_failed(backend, f"{path.rsplit('/', 1)[-1]}: {exc}")
            exclude = backend
            continue
        return Response(reply.body, status_code=reply.status, media_type=reply.content_type)
    return None
