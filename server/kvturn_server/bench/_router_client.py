"""``kvturn bench router``'s client: one keep-alive HTTP/1.1 connection per simulated client,
prebuilt requests, so that the client itself costs as little as possible."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from kvturn_server.bench._router_fakes import API_BODIES, dumps, loads


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def request(self, path: str, body: bytes) -> bytes:
        return (f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
                ).encode() + body

    async def send(self, raw: bytes, *, first_byte: list[float] | None = None) -> bytes:
        """Send a prebuilt request, return the whole body; ``first_byte`` gets the time the
        first body byte arrived."""
        assert self.reader is not None and self.writer is not None
        reader = self.reader
        self.writer.write(raw)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        if status != 200:
            raise RuntimeError(f"bench request answered {status}: {head[:200]!r}")
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            parts: list[bytes] = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                data = await reader.readexactly(size + 2)
                if first_byte is not None and not parts:
                    first_byte.append(time.perf_counter())
                parts.append(data[:-2])
            return b"".join(parts)
        start = lower.index(b"content-length:") + 15
        length = int(lower[start:lower.index(b"\r\n", start)])
        body = await reader.readexactly(length)
        if first_byte is not None:
            first_byte.append(time.perf_counter())
        return body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@dataclass
class Endpoints:
    router: int
    prefill: int
    decode: int


class TurnClient:
    """Issues one turn either through the router or directly to the two legs."""

    def __init__(self, ports: Endpoints, conversations: int, index: int,
                 api: str = "chat") -> None:
        self.router = Connection("127.0.0.1", ports.router)
        self.prefill = Connection("127.0.0.1", ports.prefill)
        self.decode = Connection("127.0.0.1", ports.decode)
        self.conversations = conversations
        self.index = index
        self.turn = 0
        self.path, base, limit = API_BODIES[api]
        self._router_requests = {
            stream: [self.router.request(self.path, dumps(
                {**base, "stream": stream, "conversation_id": f"bench-{index}-{c}"}))
                for c in range(conversations)] for stream in (False, True)}
        # What the router's prefill leg is, as a client calling the legs itself would send it.
        prefill = {**base, "stream": False, limit: 1,
                   "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                          "remote_engine_id": None, "remote_block_ids": None,
                                          "remote_host": None, "remote_port": None}}
        if api == "chat":
            prefill["n"] = 1
        if api == "responses":
            prefill["store"] = False
        self._prefill_request = self.prefill.request(self.path, dumps(prefill))
        self._base = base

    async def open(self) -> None:
        for conn in (self.router, self.prefill, self.decode):
            await conn.open()

    def close(self) -> None:
        for conn in (self.router, self.prefill, self.decode):
            conn.close()

    async def via_router(self, stream: bool) -> tuple[float, float]:
        """(seconds to first byte, seconds to the end)."""
        raw = self._router_requests[stream][self.turn % self.conversations]
        self.turn += 1
        first: list[float] = []
        t0 = time.perf_counter()
        await self.router.send(raw, first_byte=first)
        return first[0] - t0, time.perf_counter() - t0

    async def direct(self, stream: bool) -> tuple[float, float]:
        """The same turn as a client calling the legs itself would run it."""
        first: list[float] = []
        t0 = time.perf_counter()
        reply = loads(await self.prefill.send(self._prefill_request))
        params = reply["kv_transfer_params"]
        params.pop("kvturn", None)
        body = dumps({**self._base, "stream": stream, "kv_transfer_params": params})
        await self.decode.send(self.decode.request(self.path, body),
                               first_byte=first)
        return first[0] - t0, time.perf_counter() - t0
