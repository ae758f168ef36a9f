"""The router's one seam to its backends: every leg and control call goes through here.

``BackendClient`` sends requests over a transport and bounds every call with a timeout, so a
backend that hangs can only cost the configured seconds. The transport is the only thing that
changes between production and tests: the router's ``PooledTransport`` (lean, sent to
directly), or any ``httpx2.AsyncBaseTransport`` (``httpx2.MockTransport`` in tests, httpx2's
own pool with ``http_client = "httpx"``), adapted to the same lean calls. Faults come out as
``BackendError`` with a ``kind`` the caller decides on:

- ``connect``: nothing reached the backend (refused, unreachable, connect timeout); safe to
  send the same request elsewhere, or again.
- ``timeout``: the backend took longer than allowed; it may still be working on it.
- ``broken``: the connection failed or the reply was malformed part way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx2

from kvturn_server.router import _json
from kvturn_server.router._transport import Headers, PooledTransport, Send, UpstreamReply


class BackendError(Exception):
    """A backend could not be reached, timed out, or broke off its reply."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Reply:
    """A complete reply: status, content type, raw body."""

    __slots__ = ("body", "content_type", "status")

    def __init__(self, status: int, content_type: str, body: bytes) -> None:
        self.status = status
        self.content_type = content_type or "application/json"
        self.body = body

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not."""
        return _json.loads(self.body)


class UpstreamStream:
    """A reply whose body is read chunk by chunk, each chunk within ``timeout`` seconds.

    The per-chunk deadline is one lazily re-armed timer per stream rather than an
    ``asyncio.timeout`` per chunk: a stream of hundreds of tokens would otherwise schedule and
    cancel a timer for each of them.
    """

    def __init__(self, reply: UpstreamReply, timeout: float, url: str) -> None:
        self.status = reply.status
        self.content_type = reply.content_type
        self._reply = reply
        self._chunks = reply.chunks()
        self._timeout = timeout
        self._url = url
        self._loop = asyncio.get_running_loop()
        self._waiting_since = 0.0
        self._waiter: asyncio.Task[Any] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._expired = False
        self.closed = False

    def _check(self) -> None:
        due = self._waiting_since + self._timeout
        if self._waiter is None:
            self._watchdog = None  # not reading now; the next read re-arms
        elif self._loop.time() >= due:
            self._watchdog = None
            self._expired = True
            self._waiter.cancel()
        else:
            self._watchdog = self._loop.call_at(due, self._check)

    async def next_chunk(self) -> bytes | None:
        """The next non-empty chunk, or None at the end of the body."""
        loop = self._loop
        self._waiting_since = loop.time()
        task = self._waiter = asyncio.current_task()
        if self._watchdog is None:
            self._watchdog = loop.call_at(self._waiting_since + self._timeout, self._check)
        try:
            while True:
                chunk = await anext(self._chunks, None)
                if chunk is None or chunk:
                    return chunk
        except asyncio.CancelledError:
            if not self._expired:
                raise
            self._expired = False
            assert task is not None
            task.uncancel()
            raise BackendError("timeout", f"{self._url}: silent for over {self._timeout} s "
                                          "mid-reply") from None
        except (httpx2.HTTPError, OSError) as exc:
            raise BackendError("broken", f"{self._url}: reply broke off: "
                                         f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._waiter = None

    async def read_all(self, limit: int = 1 << 20) -> bytes:
        """The rest of the body (for error replies), at most ``limit`` bytes."""
        parts: list[bytes] = []
        size = 0
        while size < limit and (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)

    async def aclose(self) -> None:
        """Close the reply; closing before its end drops the connection, which makes vLLM
        abort the request."""
        if not self.closed:
            self.closed = True
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None
            with contextlib.suppress(httpx2.HTTPError, OSError):
                await self._reply.aclose()


class BackendClient:
    """Sends requests to backends.

    Args:
        transport: where requests go (the pooled transport, or any httpx2 transport).
        connect_timeout: seconds to open a connection.
        api_key: sent as ``Authorization: Bearer`` to every backend when set (vLLM's
            ``--api-key``); clients' own credentials are never forwarded.
    """

    def __init__(self, transport: httpx2.AsyncBaseTransport, *, connect_timeout: float = 5.0,
                 api_key: str | None = None) -> None:
        self.transport = transport
        self.connect_timeout = connect_timeout
        self._send: Send = (transport.send if isinstance(transport, PooledTransport)
                            else _HttpxAdapter(transport).send)
        self._static: Headers = [("authorization", f"Bearer {api_key}")] if api_key else []
        self._json: Headers = [*self._static, ("content-type", "application/json")]

    def _headers(self, body: bytes | None, headers: Mapping[str, str] | None) -> Headers:
        base = self._json if body is not None else self._static
        return [*base, *headers.items()] if headers else base

    async def call(self, method: str, url: str, body: bytes | None = None, *, timeout: float,
                   headers: Mapping[str, str] | None = None) -> Reply:
        """Send a request and read its whole reply within ``timeout`` seconds."""
        sent = self._headers(body, headers)
        try:
            async with asyncio.timeout(timeout):
                reply = await self._send(method, url, body or b"", sent,
                                         connect_timeout=min(self.connect_timeout, timeout))
                try:
                    data = await reply.read()
                finally:
                    await reply.aclose()
        except TimeoutError as exc:
            raise BackendError("timeout", f"{method} {url}: no complete reply within "
                                          f"{timeout} s") from exc
        except (httpx2.HTTPError, OSError) as exc:
            raise _fault(method, url, exc) from exc
        return Reply(reply.status, reply.content_type, data)

    async def open_stream(self, url: str, body: bytes, *, timeout: float,
                          headers: Mapping[str, str] | None = None) -> UpstreamStream:
        """POST ``body`` and return once the reply's head arrived (within ``timeout``); the
        caller reads the body and must close it."""
        sent = self._headers(body, headers)
        try:
            async with asyncio.timeout(timeout):
                reply = await self._send("POST", url, body, sent,
                                         connect_timeout=min(self.connect_timeout, timeout))
        except TimeoutError as exc:
            raise BackendError("timeout", f"POST {url}: no reply within {timeout} s") from exc
        except (httpx2.HTTPError, OSError) as exc:
            raise _fault("POST", url, exc) from exc
        return UpstreamStream(reply, timeout, url)

    async def aclose(self) -> None:
        await self.transport.aclose()


class _HttpxAdapter:
    """The lean calls over any httpx2 transport (tests' MockTransport, httpx2's own pool)."""

    def __init__(self, transport: httpx2.AsyncBaseTransport) -> None:
        self.transport = transport

    async def send(self, method: str, url: str, body: bytes = b"", headers: Headers = (), *,
                   connect_timeout: float | None = None) -> UpstreamReply:
        timeout = connect_timeout or 5.0
        request = httpx2.Request(method, url, content=body if body else None,
                                 headers=list(headers),
                                 extensions={"timeout": {"connect": timeout, "read": None,
                                                         "write": None, "pool": None}})
        response = await self.transport.handle_async_request(request)
        chunks: AsyncIterator[bytes] = (
            # A response built from bytes (a mock's) is already read; a transport's streams.
            _once(response.content) if response.is_stream_consumed else response.aiter_raw())
        return UpstreamReply(response.status_code, list(response.headers.raw),
                             response.headers.get("content-type", ""), chunks, response.aclose)


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _fault(method: str, url: str, exc: Exception) -> BackendError:
    if isinstance(exc, httpx2.ConnectError | httpx2.ConnectTimeout):
        kind = "connect"
    elif isinstance(exc, httpx2.TimeoutException):
        kind = "timeout"
    else:
        kind = "broken"
    return BackendError(kind, f"{method} {url}: {type(exc).__name__}: {exc}")
