"""``POST /kvturn/v1/conversations/{id}/keepalive`` and ``DELETE /kvturn/v1/conversations/{id}``.

Both find the decode holding the conversation (same tenant scoping as completions) and forward
to its control endpoint. ``{id}`` is percent-encoded; ids may contain ``/``, so the id is
everything between the prefix and the ``/keepalive`` suffix of the raw path.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING
from urllib.parse import unquote

from starlette.requests import Request
from starlette.responses import Response

from kvturn.wire import (
    BODY_CONVERSATION_ID,
    CONVERSATIONS_PREFIX,
    HEADER_REQUEST_ID,
    KEEPALIVE,
    GoneReason,
    KeepaliveBody,
    ReleaseBody,
    ReuseReason,
    gone_reason,
)
from kvturn_server.router import _json
from kvturn_server.router._control import ControlError, Gone
from kvturn_server.router._errors import ApiError
from kvturn_server.router._identity import conversation_key, credential_of, validate_id
from kvturn_server.router._log import event
from kvturn_server.router._plan import lost_record
from kvturn_server.router._services import control_call_failed
from kvturn_server.router._state import Placement, StoreError
from kvturn_server.router._turn import request_id_of

if TYPE_CHECKING:
    from kvturn_server.router._wiring import Router

log = logging.getLogger("kvturn.router")

_KEEPALIVE = "/" + KEEPALIVE


def _ok(data: KeepaliveBody | ReleaseBody, request_id: str) -> Response:
    return Response(_json.dumps(data), status_code=200, media_type="application/json",
                    headers={HEADER_REQUEST_ID: request_id})


async def conversation_endpoint(router: Router, request: Request) -> Response:
    request_id = request_id_of(request.headers.get(HEADER_REQUEST_ID))
    raw = request.scope.get("raw_path") or request.scope["path"].encode()
    path = raw.split(b"?", 1)[0].decode("latin-1")
    rest = path[len(CONVERSATIONS_PREFIX):]
    method = request.method
    endpoint = "keepalive" if method == "POST" else "release"
    try:
        if method == "POST":
            if not rest.endswith(_KEEPALIVE):
                raise ApiError(404, f"no route POST {path}", type_="not_found_error",
                               code="no_route")
            rest = rest[:-len(_KEEPALIVE)]
        conversation_id = validate_id(unquote(rest), BODY_CONVERSATION_ID)
        key = conversation_key(conversation_id, credential_of(request.headers))
        handler = _keepalive if method == "POST" else _release
        response = await handler(router, conversation_id, key, request_id)
    except ApiError as exc:
        router.metrics.request(endpoint, "invalid" if exc.status == 400 else
                               "backend_error" if exc.status >= 500 else "client_error")
        return exc.response({HEADER_REQUEST_ID: request_id})
    router.metrics.request(endpoint, "ok")
    return response


def _unavailable(router: Router, what: str) -> ApiError:
    return ApiError(503, what, type_="server_error", code="backend_unavailable",
                    retry_after=router.config.retry_after)


def _no_retention(code: GoneReason | ReuseReason, why: str) -> ApiError:
    """The keepalive's ``404``: ``code`` is a known Gone reason, or ``stale``."""
    return ApiError(404, f"no live retention for this conversation: {why}",
                    type_="not_found_error", param=BODY_CONVERSATION_ID, code=code)


async def _placement(router: Router, key: str) -> Placement | None:
    try:
        return await router.store.get(key)
    except StoreError as exc:
        router.metrics.state_errors.inc()
        raise _unavailable(router, "the router's state store is unavailable") from exc


async def _forget(router: Router, key: str, placement: Placement, why: str | None) -> None:
    if why is not None:
        router.metrics.stale(why)
    try:
        await router.store.delete(key, turn=placement.turn)
    except StoreError:
        router.metrics.state_errors.inc()


async def _unretained(router: Router, key: str, placement: Placement, why: str) -> None:
    router.metrics.stale(why)
    try:
        await router.store.put(key, placement)
    except StoreError:
        router.metrics.state_errors.inc()


async def _keepalive(router: Router, conversation_id: str, key: str,
                     request_id: str) -> Response:
    placement = await _placement(router, key)
    if placement is not None and placement.lost is not None:
        # The decode said so (a keepalive, or its lost log, which the router follows): why,
        # whichever of the two reached the router first.
        raise _no_retention(gone_reason(placement.lost), "its decode dropped it")
    if placement is None or not placement.retained:
        raise _no_retention(GoneReason.NO_RETENTION, "the router knows none")
    decode = router.decodes.by_url(placement.decode)
    if decode is None or decode.control_url is None:
        await _forget(router, key, placement, "unknown_decode")
        raise _no_retention(ReuseReason.STALE, "its decode is no longer configured")
    if decode.engine_id is not None and placement.engine_id is not None \
            and decode.engine_id != placement.engine_id:
        await _forget(router, key, placement, "engine_changed")
        raise _no_retention(ReuseReason.STALE, "its decode restarted")
    if not decode.control_trusted:
        # Its engine core may still answer (it outlives a killed API server), but nothing it
        # keeps can serve a turn: no lease is renewed on the word of a server that is gone.
        event(log, logging.WARNING, "keepalive_refused", request_id=request_id,
              conversation=key, backend=decode.url, why=decode.distrust_reason())
        raise _unavailable(router, "the decode holding this conversation is not answering")
    try:
        result = await router.control.keepalive(decode.control_url, key)
    except ControlError as exc:
        control_call_failed(router.services, decode, "keepalive", exc, request_id=request_id,
                            conversation=key)
        raise _unavailable(router, "the decode holding this conversation did not answer") \
            from exc
    router.decodes.control_answered(decode, None if isinstance(result, Gone)
                                    else result.engine_id)
    if isinstance(result, Gone):
        kept = lost_record(placement, result.code)
        if kept is not None:
            await _unretained(router, key, kept, result.code)
        else:
            await _forget(router, key, placement, result.code)
        raise _no_retention(result.code, result.code.replace("_", " "))
    if placement.engine_id is not None and result.engine_id is not None \
            and result.engine_id != placement.engine_id:
        await _forget(router, key, placement, "engine_changed")
        raise _no_retention(ReuseReason.STALE, "its decode restarted")
    renewed = replace(placement, engine_id=result.engine_id or placement.engine_id,
                      num_tokens=result.num_tokens or placement.num_tokens,
                      expires_at=router.clock() + result.expires_in)
    try:
        await router.store.put(key, renewed)
    except StoreError:
        router.metrics.state_errors.inc()
    return _ok(KeepaliveBody(conversation_id=conversation_id, retained=True,
                             expires_in=result.expires_in,
                             hold_remaining=result.hold_remaining,
                             num_tokens=result.num_tokens), request_id)


async def _release(router: Router, conversation_id: str, key: str,
                   request_id: str) -> Response:
    placement = await _placement(router, key)
    released = False
    if placement is not None:
        decode = router.decodes.by_url(placement.decode)
        if decode is not None and decode.control_url is not None:
            try:
                result = await router.control.release(decode.control_url, key)
            except ControlError as exc:
                control_call_failed(router.services, decode, "release", exc,
                                    request_id=request_id, conversation=key)
                raise _unavailable(router, "the decode holding this conversation did not "
                                           "answer; retry to release it") from exc
            router.decodes.control_answered(decode)
            released = result is True
        await _forget(router, key, placement, None)
    return _ok(ReleaseBody(conversation_id=conversation_id, released=released), request_id)

