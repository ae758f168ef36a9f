"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Transient errors (the client may retry: backend trouble, overload) carry ``Retry-After`` and
``x-should-retry: true``, which stock OpenAI clients honour; permanent ones carry
``x-should-retry: false`` so no client retries a request that cannot succeed.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import Response

from kvturn_server.router import _json


class ApiError(Exception):
    """An error the router answers with, raised anywhere below the HTTP layer."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def response(self, headers: Mapping[str, str] | None = None) -> Response:
        return error_response(self.status, self.message, type_=self.type, param=self.param,
                              code=self.code, retry_after=self.retry_after, headers=headers)


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> bytes:
    return _json.dumps({"error": {"message": message, "type": type_, "param": param,
                                  "code": code}})


def retry_headers(retry_after: float | None) -> dict[str, str]:
    """``Retry-After`` (whole seconds, at least 1) and ``x-should-retry``."""
    if retry_after is None:
        return {"x-should-retry": "false"}
    return {"Retry-After": str(max(1, round(retry_after))), "x-should-retry": "true"}


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   retry_after: float | None = None,
                   headers: Mapping[str, str] | None = None) -> Response:
    """An error response in the shape every OpenAI client expects.

    ``retry_after`` set marks it transient (retry after that many seconds); unset, permanent.
    """
    all_headers = dict(headers or {})
    all_headers.update(retry_headers(retry_after))
    return Response(error_body(message, type_=type_, param=param, code=code),
                    status_code=status, headers=all_headers, media_type="application/json")
