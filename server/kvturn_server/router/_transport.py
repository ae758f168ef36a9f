"""A lean HTTP/1.1 keep-alive transport for the router's backend calls.

The router sits on every token's path and makes three or four backend calls per turn, so the
client side matters. httpx2's default transport (httpcore2 over h11) costs about a
millisecond per request on a small machine, and its request and response models another
~0.1 ms. This transport speaks HTTP/1.1 on asyncio streams and offers two doors:

- ``send(...)``: the lean one the backend client uses (plain values and header pairs in, an
  ``UpstreamReply`` out, no httpx2 models on the hot path; ``Send`` is its shape);
- ``handle_async_request(...)``: the standard ``httpx2.AsyncBaseTransport`` one, so it also
  works under an ``httpx2.AsyncClient``.

Scope, deliberately narrow: HTTP/1.1 (and 1.0 replies) to a known set of backends, bodies sent
whole with ``Content-Length``, replies framed by ``Content-Length``, chunked encoding or
connection close. Read timeouts are the caller's (the backend client bounds every call); this
layer bounds only connecting. A request that finds a pooled connection already closed by the
server (idle keep-alive expiry) is sent once more on a fresh connection, but only when no byte
of a reply was received.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx2

_Origin = tuple[str, str, int, bytes]  # scheme, host, port, Host header value
_READ_SIZE = 64 * 1024
_HOP_BY_HOP = frozenset({b"content-length", b"transfer-encoding", b"connection", b"host"})

Headers = Sequence[tuple[str, str]]
"""Request headers as (name, value) pairs, in order; Host and Content-Length excluded."""


class Send(Protocol):
    """The lean door: one request out, its ``UpstreamReply`` back once its head arrived.
    Transport faults raise httpx2 exceptions."""

    def __call__(self, method: str, url: str, body: bytes = b"", headers: Headers = (), *,
                 connect_timeout: float | None = None) -> Awaitable[UpstreamReply]: ...


class UpstreamReply:
    """A backend's reply: status and content type at once, the body chunk by chunk.

    ``chunks()`` yields the body as it arrives (once); ``read()`` collects it; ``aclose()``
    gives the connection back (or drops it if the body was not read to its end).
    """

    __slots__ = ("_chunks", "_close", "content_type", "headers", "status")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], content_type: str,
                 chunks: AsyncIterator[bytes], close: Callable[[], Any]) -> None:
        self.status = status
        self.headers = headers
        self.content_type = content_type
        self._chunks = chunks
        self._close = close

    def chunks(self) -> AsyncIterator[bytes]:
        return self._chunks

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self._chunks])

    async def aclose(self) -> None:
        result = self._close()
        if asyncio.iscoroutine(result):
            await result


class _Connection:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float, idle_timeout: float) -> bool:
        return (not self.writer.is_closing() and not self.reader.at_eof()
                and now - self.idle_since < idle_timeout)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class PooledTransport(httpx2.AsyncBaseTransport):
    """Keep-alive connections per origin; see the module docstring for what it supports.

    Args:
        connect_timeout: seconds to open a connection when the caller names none.
        max_idle_per_origin: idle connections kept per backend; more are closed when released.
        idle_timeout: an idle connection older than this is not reused (keep it below the
            backends' keep-alive timeout: uvicorn, and so vLLM, closes idle ones after 5 s).
    """

    def __init__(self, *, connect_timeout: float = 5.0, max_idle_per_origin: int = 512,
                 idle_timeout: float = 4.0, ssl_context: ssl.SSLContext | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.connect_timeout = connect_timeout
        self.max_idle_per_origin = max_idle_per_origin
        self.idle_timeout = idle_timeout
        self._ssl_context = ssl_context
        self._clock = clock
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._origins: dict[str, _Origin] = {}
        self._closed = False

    # The lean door.

    async def send(self, method: str, url: str, body: bytes = b"", headers: Headers = (), *,
                   connect_timeout: float | None = None) -> UpstreamReply:
        """Send one request (``Send``); Host and Content-Length are added here."""
        if self._closed:
            raise httpx2.ConnectError("transport is closed")
        origin, target = self._split(url)
        head = b"".join((method.encode(), b" ", target, b" HTTP/1.1\r\nhost: ", origin[3],
                         b"\r\n",
                         *(f"{name}: {value}\r\n".encode("latin-1") for name, value in headers),
                         b"content-length: %d\r\n\r\n" % len(body)
                         if body or method in ("POST", "PUT", "PATCH") else b"\r\n"))
        for attempt in (0, 1):
            conn, reused = await self._checkout(origin, connect_timeout or self.connect_timeout)
            try:
                if len(body) < _READ_SIZE:
                    conn.writer.write(head + body)
                else:
                    conn.writer.write(head)
                    conn.writer.write(body)
                await conn.writer.drain()
                status, headers_out, framing, keep_alive, ctype = await self._read_head(
                    conn, method)
            except (OSError, asyncio.IncompleteReadError) as exc:
                conn.close()
                nothing_back = not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial
                if reused and attempt == 0 and nothing_back:
                    continue  # the server had closed this idle connection: use a fresh one
                if isinstance(exc, asyncio.IncompleteReadError):
                    raise httpx2.RemoteProtocolError(
                        "server closed the connection without a complete response head") \
                        from exc
                raise httpx2.ReadError(f"{type(exc).__name__}: {exc}") from exc
            except (ValueError, IndexError, asyncio.LimitOverrunError) as exc:
                conn.close()
                raise httpx2.RemoteProtocolError(f"malformed response head: {exc}") from exc
            body_reader = _Body(self, origin, conn, framing, keep_alive)
            return UpstreamReply(status, headers_out, ctype, body_reader.chunks(),
                                 body_reader.discard)
        raise AssertionError("unreachable")  # pragma: no cover

    # The httpx2 door.

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        pairs = [(name.decode("latin-1"), value.decode("latin-1"))
                 for name, value in request.headers.raw if name.lower() not in _HOP_BY_HOP]
        timeout = request.extensions.get("timeout", {}).get("connect")
        try:
            reply = await self.send(request.method, str(request.url), await request.aread(),
                                    pairs, connect_timeout=timeout)
        except httpx2.HTTPError as exc:
            exc.request = request
            raise
        return httpx2.Response(reply.status, headers=reply.headers, request=request,
                               stream=_HttpxStream(reply),
                               extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    # Internals.

    def _split(self, url: str) -> tuple[_Origin, bytes]:
        start = url.find("://") + 3
        slash = url.find("/", start)
        base = url if slash < 0 else url[:slash]
        target = (url[slash:] if slash >= 0 else "/").encode()
        origin = self._origins.get(base)
        if origin is None:
            parts = urlsplit(base)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise httpx2.UnsupportedProtocol(f"cannot send to {url!r}")
            default = 443 if parts.scheme == "https" else 80
            port = parts.port or default
            host = parts.hostname
            shown = f"[{host}]" if ":" in host else host
            host_header = shown if port == default else f"{shown}:{port}"
            origin = (parts.scheme, host, port, host_header.encode("ascii"))
            if len(self._origins) < 1024:
                self._origins[base] = origin
        return origin, target

    async def _checkout(self, origin: _Origin, timeout: float) -> tuple[_Connection, bool]:
        idle = self._idle.get(origin)
        if idle:
            now = self._clock()
            while idle:
                conn = idle.pop()
                if conn.usable(now, self.idle_timeout):
                    return conn, True
                conn.close()
        scheme, host, port, _ = origin
        ssl_arg: Any = None
        if scheme == "https":
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()
            ssl_arg = self._ssl_context
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=ssl_arg, limit=_READ_SIZE)
        except TimeoutError as exc:
            raise httpx2.ConnectTimeout(
                f"connecting to {host}:{port} took over {timeout} s") from exc
        except OSError as exc:
            raise httpx2.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return _Connection(reader, writer), False

    def _release(self, origin: _Origin, conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if self._closed or len(idle) >= self.max_idle_per_origin:
            conn.close()
            return
        conn.idle_since = self._clock()
        idle.append(conn)

    @staticmethod
    async def _read_head(conn: _Connection, method: str
                         ) -> tuple[int, list[tuple[bytes, bytes]], int | str, bool, str]:
        """(status, headers, framing, keep_alive, content type): framing is a byte count,
        ``"chunked"`` or ``"close"`` (read to the end of the stream)."""
        while True:
            data = await conn.reader.readuntil(b"\r\n\r\n")
            lines = data[:-4].split(b"\r\n")
            if not lines[0].startswith(b"HTTP/1."):
                raise ValueError(f"not an HTTP/1 status line: {lines[0][:80]!r}")
            version = lines[0][:8]
            status = int(lines[0][9:12])
            if not 100 <= status < 200 or status == 101:
                break
        headers: list[tuple[bytes, bytes]] = []
        length: int | None = None
        chunked = False
        connection = b""
        ctype = ""
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ValueError(f"header line without a colon: {line[:80]!r}")
            name = name.strip()
            value = value.strip()
            headers.append((name, value))
            lower = name.lower()
            if lower == b"content-length":
                length = int(value)
            elif lower == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif lower == b"connection":
                connection = value.lower()
            elif lower == b"content-type":
                ctype = value.decode("latin-1")
        if version == b"HTTP/1.1":
            keep_alive = b"close" not in connection
        else:
            keep_alive = b"keep-alive" in connection
        framing: int | str
        if method == "HEAD" or status in (204, 304):
            framing = 0
        elif chunked:
            framing = "chunked"
        elif length is not None:
            if length < 0:
                raise ValueError(f"negative content-length {length}")
            framing = length
        else:
            framing = "close"
            keep_alive = False
        return status, headers, framing, keep_alive, ctype


class _Body:
    """A reply body; returns its connection to the pool once fully read."""

    __slots__ = ("_conn", "_framing", "_keep_alive", "_origin", "_transport")

    def __init__(self, transport: PooledTransport, origin: _Origin, conn: _Connection,
                 framing: int | str, keep_alive: bool) -> None:
        self._transport = transport
        self._origin = origin
        self._conn: _Connection | None = conn
        self._framing = framing
        self._keep_alive = keep_alive

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            raise httpx2.StreamClosed()
        reader = conn.reader
        try:
            framing = self._framing
            if framing == "chunked":
                while True:
                    line = await reader.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0], 16)
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":
                            pass  # trailers
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif framing == "close":
                while chunk := await reader.read(_READ_SIZE):
                    yield chunk
            else:
                assert isinstance(framing, int)
                remaining = framing
                while remaining:
                    chunk = await reader.read(min(remaining, _READ_SIZE))
                    if not chunk:
                        raise asyncio.IncompleteReadError(b"", remaining)
                    remaining -= len(chunk)
                    yield chunk
        except (OSError, asyncio.IncompleteReadError) as exc:
            self.discard()
            raise httpx2.ReadError(f"reading the response body failed: {exc!r}") from exc
        except (ValueError, asyncio.LimitOverrunError) as exc:
            self.discard()
            raise httpx2.RemoteProtocolError(f"malformed chunked body: {exc}") from exc
        # Fully read: the connection is ready for the next request.
        self._conn = None
        if self._keep_alive:
            self._transport._release(self._origin, conn)
        else:
            conn.close()

    def discard(self) -> None:
        """Closed before the end: what is left unread makes the connection unusable."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class _HttpxStream(httpx2.AsyncByteStream):
    def __init__(self, reply: UpstreamReply) -> None:
        self._reply = reply

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._reply.chunks():
            yield chunk

    async def aclose(self) -> None:
        await self._reply.aclose()
