"""The router process (``python -m kvturn_server.router``) on SIGTERM: /ready goes 503 at
once, requests are still served for ``--drain-grace`` seconds, then in-flight streams finish
(up to ``--drain-timeout``) and the process exits. Backends are a small fake served by
uvicorn in this process over real sockets; the router is a real process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from kvturn_server.local import free_port
from kvturn_server.router import PooledTransport
from kvturn_server.router._backend import BackendClient, BackendError

ROOT = Path(__file__).resolve().parents[3]
CHUNKS = [b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
          b'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}\n\n',
          b"data: [DONE]\n\n"]


class FakeBackends:
    """One ASGI app for a prefill and a decode (told apart by port); the decode's streams
    send their first chunk, then wait for ``gate``."""

    def __init__(self, prefill_port: int) -> None:
        self.prefill_port = prefill_port
        self.gate = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/health":
            await self._json(send, {})
        elif scope["server"][1] == self.prefill_port:
            await self._json(send, {"choices": [], "usage": {"prompt_tokens": 3},
                                    "kv_transfer_params": {"remote_block_ids": [1]}})
        else:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": CHUNKS[0], "more_body": True})
            await self.gate.wait()
            for chunk in CHUNKS[1:]:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    @staticmethod
    async def _json(send: Any, body: dict[str, Any]) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


@pytest.fixture
async def backends() -> AsyncIterator[tuple[FakeBackends, int, int]]:
    prefill, decode = free_port(), free_port()
    app = FakeBackends(prefill)
    servers = [uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                             log_level="warning", lifespan="off"))
               for port in (prefill, decode)]
    tasks = [asyncio.ensure_future(s.serve()) for s in servers]
    async with asyncio.timeout(10):
        while not all(s.started for s in servers):
            await asyncio.sleep(0.01)
    yield app, prefill, decode
    app.gate.set()
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks)


def _start_router(prefill: int, decode: int, *args: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(ROOT / p) for p in ("server", "sdk", "integrations"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvturn_server.router", "--port", str(port),
         "--prefill", f"http://127.0.0.1:{prefill}", "--decode", f"http://127.0.0.1:{decode}",
         "--health-interval", "0.2", *args],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, port


async def _ready(client: BackendClient, port: int) -> tuple[int, dict[str, Any]] | None:
    try:
        reply = await client.call("GET", f"http://127.0.0.1:{port}/ready", timeout=2)
    except BackendError:
        return None
    return reply.status, reply.json()


async def _until_ready(client: BackendClient, proc: subprocess.Popen[bytes], port: int) -> None:
    async with asyncio.timeout(30):
        while (answer := await _ready(client, port)) is None or answer[0] != 200:
            assert proc.poll() is None, "the router exited at start-up"
            await asyncio.sleep(0.05)


async def _exit_code(proc: subprocess.Popen[bytes], timeout: float) -> int:
    async with asyncio.timeout(timeout):
        while proc.poll() is None:
            await asyncio.sleep(0.02)
    assert proc.returncode is not None
    return proc.returncode


def _chat(stream: bool) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "stream": stream}).encode()


async def test_sigterm_drains_ready_goes_503_requests_served_in_grace_streams_finish(
        backends: tuple[FakeBackends, int, int]) -> None:
    fakes, prefill, decode = backends
    proc, port = _start_router(prefill, decode, "--drain-grace", "1.5",
                               "--drain-timeout", "20")
    client = BackendClient(PooledTransport())
    fresh = BackendClient(PooledTransport(max_idle_per_origin=0))
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        await _until_ready(client, proc, port)
        stream = await client.open_stream(url, _chat(True), timeout=20)
        assert await stream.next_chunk() == CHUNKS[0]

        proc.send_signal(signal.SIGTERM)
        answer = None
        async with asyncio.timeout(5):
            while answer is None or answer[0] != 503:
                answer = await _ready(fresh, port)
        assert answer[1]["draining"] is True and "draining" in answer[1]["why"]
        # In the grace period a new request (a new connection, too) is still served.
        served = time.monotonic()
        reply = await fresh.open_stream(url, _chat(True), timeout=5)
        assert reply.status == 200 and await reply.next_chunk() == CHUNKS[0]
        await reply.aclose()
        # Then the listener closes, while the first stream is still in flight.
        async with asyncio.timeout(10):
            while await _ready(fresh, port) is not None:
                await asyncio.sleep(0.02)
        assert time.monotonic() - served >= 1.0  # the grace (1.5 s from the signal)
        assert proc.poll() is None

        fakes.gate.set()
        rest = await stream.read_all()
        assert CHUNKS[0] + rest == b"".join(CHUNKS)
        assert await _exit_code(proc, 15) == 0
    finally:
        await client.aclose()
        await fresh.aclose()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_in_flight_streams_get_at_most_the_drain_timeout(
        backends: tuple[FakeBackends, int, int]) -> None:
    _, prefill, decode = backends
    proc, port = _start_router(prefill, decode, "--drain-timeout", "1")
    client = BackendClient(PooledTransport())
    try:
        await _until_ready(client, proc, port)
        stream = await client.open_stream(f"http://127.0.0.1:{port}/v1/chat/completions",
                                          _chat(True), timeout=20)
        assert await stream.next_chunk() == CHUNKS[0]
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # no grace: shutdown starts at once
        await _exit_code(proc, 15)
        # uvicorn's bound (1 s), then the router's own shutdown (background calls: none).
        assert time.monotonic() - signalled < 8
        with pytest.raises(BackendError):
            await stream.read_all()  # cut off: the gate never opened
    finally:
        await client.aclose()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
