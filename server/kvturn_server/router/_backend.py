"""The router's one seam to vLLM: a small client per backend over an httpx2 transport."""

from __future__ import annotations

from typing import Any

import httpx2


class BackendError(Exception):
    """A backend could not be reached or answered with something unusable."""


class Backend:
    """One vLLM instance. Tests swap the transport of ``client``, never this code."""

    def __init__(self, base_url: str, client: httpx2.AsyncClient) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = client

    def __repr__(self) -> str:
        return f"Backend({self.base_url!r})"

    async def post_json(self, path: str, body: dict[str, Any],
                        timeout: httpx2.Timeout) -> tuple[int, Any]:
        """POST ``body``; return (status, parsed JSON). Transport faults raise BackendError."""
        try:
            resp = await self.client.post(self.base_url + path, json=body, timeout=timeout)
        except httpx2.HTTPError as exc:
            raise BackendError(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        try:
            return resp.status_code, resp.json()
        except ValueError as exc:
            raise BackendError(f"{self.base_url}{path}: status {resp.status_code} with a "
                               "body that is not JSON") from exc

    async def open_stream(self, path: str, body: dict[str, Any],
                          timeout: httpx2.Timeout) -> httpx2.Response:
        """POST ``body`` and return the response with its body unread (caller closes it)."""
        request = self.client.build_request("POST", self.base_url + path, json=body,
                                            timeout=timeout)
        try:
            return await self.client.send(request, stream=True)
        except httpx2.HTTPError as exc:
            raise BackendError(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from exc

    async def get(self, path: str, timeout: httpx2.Timeout) -> tuple[int, Any]:
        try:
            resp = await self.client.get(self.base_url + path, timeout=timeout)
            return resp.status_code, resp.json()
        except (httpx2.HTTPError, ValueError) as exc:
            raise BackendError(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
