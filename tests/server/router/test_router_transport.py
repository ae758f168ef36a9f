"""The pooled HTTP/1.1 transport against real sockets (a scripted asyncio server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx2
import pytest

from kvturn_server.router._backend import BackendClient, BackendError
from kvturn_server.router._transport import PooledTransport
from tests.fakes.backends import wait_for

Handler = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


class Server:
    """Answers each request with ``handler(path, reader, writer)``; it returns whether to
    keep the connection open."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                path = head.split(b" ")[1]
                if not await self.handler(path, reader, writer):
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def _reply(writer: asyncio.StreamWriter, body: bytes, extra: bytes = b"") -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n%s\r\n"
                 % (len(body), extra) + body)


@pytest.fixture
async def transport() -> AsyncIterator[PooledTransport]:
    t = PooledTransport(connect_timeout=1.0)
    yield t
    await t.aclose()


async def _get(t: PooledTransport, url: str, body: bytes = b"") -> httpx2.Response:
    request = httpx2.Request("POST" if body else "GET", url, content=body or None)
    response = await t.handle_async_request(request)
    await response.aread()
    return response


async def test_requests_reuse_one_keep_alive_connection(transport: PooledTransport) -> None:
    async def handler(path: bytes, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        _reply(w, b"echo " + path)
        return True

    async with Server(handler) as server:
        for i in range(3):
            resp = await _get(transport, f"{server.url}/p{i}?q=1", b'{"a": 1}')
            assert resp.status_code == 200 and resp.content == f"echo /p{i}?q=1".encode()
        assert server.connections == 1
        head = server.requests[0].split(b"\r\n\r\n")[0].lower()
        assert b"content-length: 8" in head and b"host: 127.0.0.1:" in head


async def test_chunked_bodies_arrive_as_they_are_sent(transport: PooledTransport) -> None:
    release = asyncio.Event()

    async def handler(path: bytes, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await w.drain()
        await release.wait()
        w.write(b"6;ext=1\r\nsecond\r\n0\r\nx-trailer: 1\r\n\r\n")
        return True

    async with Server(handler) as server:
        response = await transport.handle_async_request(httpx2.Request("GET", server.url))
        chunks = response.aiter_raw()
        assert await anext(chunks) == b"first"
        release.set()
        assert await anext(chunks) == b"second"
        assert await anext(chunks, None) is None
        release.clear()
        release.set()
        resp = await _get(transport, server.url)
        assert resp.content == b"firstsecond"
        assert server.connections == 1


async def test_bodies_delimited_by_close(transport: PooledTransport) -> None:
    async def handler(path: bytes, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
        return False

    async with Server(handler) as server:
        assert (await _get(transport, server.url)).content == b"until the end"
        assert (await _get(transport, server.url)).content == b"until the end"
        assert server.connections == 2


async def test_a_connection_the_server_closed_while_idle_is_replaced(
        transport: PooledTransport) -> None:
    async def handler(path: bytes, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        _reply(w, b"ok")
        await w.drain()
        return path != b"/close-after"

    async with Server(handler) as server:
        # The server closes after answering, without saying so: the pooled connection is dead.
        await _get(transport, server.url + "/close-after")
        resp = await _get(transport, server.url + "/next")
        assert resp.content == b"ok"
        assert server.connections == 2


async def test_a_request_on_a_dead_pooled_connection_is_sent_again(
        transport: PooledTransport, monkeypatch: pytest.MonkeyPatch) -> None:
    async def handler(path: bytes, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        _reply(w, b"ok")
        await w.drain()
        return path != b"/close-after"

    # The close is not noticed before reuse (it races with the next request in real life).
    monkeypatch.setattr("kvturn_server.router._transport._Connection.usable",
                        lambda self, now, idle: True)
    async with Server(handler) as server:
        await _get(transport, server.url + "/close-after")
        [conn] = next(iter(transport._idle.values()))
        await wait_for(conn.reader.at_eof)  # the close has reached this side of the socket
        resp = await _get(transport, server.url + "/next", b"{}")
        assert resp.content == b"ok"
        assert server.connections == 2


async def test_a_stream_closed_early_gives_up_its_connection(
        transport: PooledTransport) -> None:
    async def handler(path: bytes, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        if path == b"/long":
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
            await w.drain()
            await asyncio.Event().wait()
        _reply(w, b"short")
        return True

    async with Server(handler) as server:
        response = await transport.handle_async_request(
            httpx2.Request("GET", server.url + "/long"))
        assert await anext(response.aiter_raw()) == b"abc"
        await response.aclose()
        assert (await _get(transport, server.url + "/short")).content == b"short"
        assert server.connections == 2


async def test_refused_and_garbled(transport: PooledTransport) -> None:
    with pytest.raises(httpx2.ConnectError):
        await _get(transport, "http://127.0.0.1:1/")

    async def garbage(path: bytes, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 abc nonsense\r\n\r\n")
        return True

    async with Server(garbage) as server:
        with pytest.raises(httpx2.RemoteProtocolError):
            await _get(transport, server.url)

    async def dies(path: bytes, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        return False

    async with Server(dies) as server:
        response = await transport.handle_async_request(httpx2.Request("GET", server.url))
        with pytest.raises(httpx2.ReadError):
            await response.aread()


async def test_the_backend_client_bounds_every_call(transport: PooledTransport) -> None:
    async def slow(path: bytes, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        if path == b"/silent-mid-stream":
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
            await w.drain()
        await asyncio.Event().wait()
        return False

    client = BackendClient(transport, connect_timeout=1.0)
    async with Server(slow) as server:
        with pytest.raises(BackendError) as exc:
            await client.call("GET", server.url + "/x", timeout=0.1)
        assert exc.value.kind == "timeout"
        stream = await client.open_stream(server.url + "/silent-mid-stream", b"{}",
                                          timeout=0.1)
        assert await stream.next_chunk() == b"a"
        with pytest.raises(BackendError) as exc:
            await stream.next_chunk()
        assert exc.value.kind == "timeout"
        await stream.aclose()
    with pytest.raises(BackendError) as exc:
        await client.call("GET", "http://127.0.0.1:1/", timeout=0.5)
    assert exc.value.kind == "connect"
