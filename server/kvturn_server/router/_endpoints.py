"""The turn endpoints by path: which API a request speaks and how its errors look.

``/v1/chat/completions`` and ``/v1/completions`` answer OpenAI-shaped errors,
``/v1/messages`` Anthropic-shaped ones (the router's own errors are reshaped; vLLM's Messages
errors already are), ``/v1/responses`` first expands its stored state (``_responses.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from kvturn_server.router import _json
from kvturn_server.router._apis import anthropic_errors
from kvturn_server.router._backend import BackendError
from kvturn_server.router._body import read_json_body
from kvturn_server.router._errors import ApiError, error_response
from kvturn_server.router._legs import client_body
from kvturn_server.router._responses import responses_endpoint
from kvturn_server.router._turn import completion

if TYPE_CHECKING:
    from kvturn_server.router._app import Router

TURN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages",
                        "/v1/responses"})


async def turn_endpoint(router: Router, request: Request) -> Response:
    """Serve one turn on any of ``TURN_PATHS``."""
    path = request.scope["path"]
    if path == "/v1/responses":
        return await responses_endpoint(router, request)
    response = await completion(router, request)
    return anthropic_errors(response) if path == "/v1/messages" else response


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
    data = _json.dumps(body)
    exclude = None
    for _ in range(2):
        backend = router.prefills.pick(exclude=exclude)
        if backend is None:
            break
        try:
            reply = await router.client.call("POST", backend.url + "/v1/messages/count_tokens",
                                             data, timeout=router.config.prefill_timeout)
        except BackendError as exc:
            router.prefills.leg_failed(backend, f"count_tokens: {exc}")
            exclude = backend
            continue
        return Response(reply.body, status_code=reply.status, media_type=reply.content_type)
    return anthropic_errors(error_response(
        503, "no prefill backend answered", type_="server_error", code="backend_unavailable",
        retry_after=router.config.retry_after))
