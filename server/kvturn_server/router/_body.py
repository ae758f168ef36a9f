"""Reading a completion request's body: size-capped as it arrives, with a deadline.

A body is read chunk by chunk and refused (413) the moment it passes ``max_bytes``, whether
the client declared its length or sent it chunked, so a hostile upload costs at most
``max_bytes`` of memory; a body not complete within ``timeout`` seconds is refused (408) and
its connection closed, so a client that never finishes cannot hold one. Errors about the
transport (size, time, content type, encoding, JSON shape) are OpenAI-shaped and carry
``Connection: close`` where the rest of the body was not read.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import ClientDisconnect, Request

from kvturn_server.router import _json
from kvturn_server.router._errors import ApiError

# Media types read as JSON: what vLLM's FastAPI front end reads as JSON (no content type at
# all, application/json, application/*+json); anything else it refuses too.
_JSON_SUBTYPE = "json"


class BodyError(ApiError):
    """An ApiError about the body's transport; ``close`` when the connection must not be
    reused (part of the body is still unread)."""

    def __init__(self, status: int, message: str, *, code: str, close: bool = False) -> None:
        super().__init__(status, message, code=code)
        self.close = close


def _check_content_type(value: str | None) -> None:
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    main, _, sub = media.partition("/")
    if main == "application" and (sub == _JSON_SUBTYPE or sub.endswith("+" + _JSON_SUBTYPE)):
        return
    raise BodyError(415, f"request body must be application/json, got content type "
                         f"{value[:80]!r}", code="unsupported_media_type", close=True)


async def _read_capped(request: Request, max_bytes: int) -> bytearray:
    data = bytearray()
    async for chunk in request.stream():
        if len(data) + len(chunk) > max_bytes:
            raise BodyError(413, f"request body is larger than {max_bytes} bytes",
                            code="body_too_large", close=True)
        data += chunk
    return data


async def read_json_body(request: Request, max_bytes: int, timeout: float) -> dict[str, Any]:
    """The request body as a JSON object, or a BodyError (400 / 408 / 413 / 415)."""
    headers = request.headers
    _check_content_type(headers.get("content-type"))
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise BodyError(413, f"request body is larger than {max_bytes} bytes",
                        code="body_too_large", close=True)
    try:
        async with asyncio.timeout(timeout):
            raw = await _read_capped(request, max_bytes)
    except TimeoutError as exc:
        raise BodyError(408, f"request body not received within {timeout:g} s",
                        code="body_timeout", close=True) from exc
    except ClientDisconnect as exc:
        # Nobody reads the answer; it only has to be well-formed.
        raise BodyError(400, "the client closed the connection before sending the whole "
                             "body", code="client_disconnected", close=True) from exc
    if not raw:
        raise BodyError(400, "request body is empty; send a JSON object", code="invalid_json")
    return parse_json_object(raw)


# orjson writes at most this many levels of nesting back out (it reads up to 1024): a body
# nested deeper would parse and then fail when the router builds a leg from it.
MAX_DEPTH = 254


def parse_json_object(raw: bytes | bytearray) -> dict[str, Any]:
    """``raw`` as a JSON object the router can forward, or a BodyError (400)."""
    try:
        body = _json.loads(raw)
    except (ValueError, RecursionError) as exc:
        try:
            bytes(raw).decode("utf-8")
        except UnicodeDecodeError as bad:
            raise BodyError(400, f"request body is not valid UTF-8 (byte {bad.start})",
                            code="invalid_json") from exc
        raise BodyError(400, f"request body is not valid JSON: {exc}",
                        code="invalid_json") from exc
    if not isinstance(body, dict):
        raise BodyError(400, f"request body must be a JSON object, got "
                             f"{type(body).__name__}", code="invalid_json")
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:  # only then can it be that deep
        try:
            _json.dumps(body)
        except (TypeError, ValueError, RecursionError) as exc:
            raise BodyError(400, f"request body is nested deeper than {MAX_DEPTH} levels",
                            code="invalid_json") from exc
    return body
