"""OpenAI-shaped error responses."""

from __future__ import annotations

from starlette.responses import JSONResponse


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   retry_after: float | None = None) -> JSONResponse:
    """An error body in the shape the OpenAI API (and so every OpenAI client) expects."""
    headers: dict[str, str] = {}
    if retry_after is not None:
        headers["Retry-After"] = f"{max(retry_after, 0):.0f}"
        headers["x-should-retry"] = "true"
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}},
        status_code=status, headers=headers)
