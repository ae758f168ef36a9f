"""Shared fixtures of the server tests: a real redis-server, and routers over scripted fakes."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest

from kvturn_server.local import free_port
from kvturn_server.router import Router, RouterConfig, create_app
from kvturn_server.router._state import ConversationStore
from tests.fakes.backends import Cluster, ManualClock


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server on a free loopback port, no persistence; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (the Redis state-store tests need it): run "
                    "scripts/bootstrap.sh, or `apt-get install -y redis-server`")
    port = free_port()
    workdir: Path = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no",
         "--loglevel", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read().decode() if proc.stdout else ""
                pytest.fail(f"redis-server exited at start-up (code {proc.returncode}): {out}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("redis-server did not answer PING within 10 s")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """The Redis URL, emptied after the test."""
    yield redis_server
    import redis

    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    client.close()


TEST_SETTINGS: dict[str, Any] = {
    "prefill_timeout": 0.2, "decode_timeout": 0.2, "control_timeout": 0.2,
    "connect_timeout": 0.2, "health_timeout": 0.2, "health_interval": 3600.0,
    "capture_retry_delay": 0.0, "eject_after": 2, "readmit_after": 2,
    # Most router tests are about the prefill path (pin, prefill leg, decode leg); turns the
    # decode continues itself are tested where they ask for it (test_router_placement.py).
    "decode_continue_tokens": 0,
}


@dataclass
class Harness:
    """A router over a fake cluster, with an HTTP client that talks to it in-process."""

    cluster: Cluster
    router: Router
    app: Any
    client: httpx2.AsyncClient
    clock: ManualClock

    async def chat(self, conversation: str | None = None, *, stream: bool = False,
                   headers: dict[str, str] | None = None, **body: Any) -> httpx2.Response:
        payload: dict[str, Any] = {"model": "m", "messages": [{"role": "user",
                                                              "content": "hi"}],
                                   "stream": stream, **body}
        if conversation is not None:
            payload["conversation_id"] = conversation
        resp = await self.client.post("/v1/chat/completions", json=payload,
                                      headers=headers or {})
        await self.router.wait_idle()
        return resp


MakeHarness = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def make_harness() -> AsyncIterator[MakeHarness]:
    made: list[Harness] = []

    async def make(cluster: Cluster | None = None, *, store: ConversationStore | None = None,
                   clock: ManualClock | None = None, health_checks: bool = False,
                   **settings: Any) -> Harness:
        cluster = cluster or Cluster()
        clock = clock or ManualClock()
        config = RouterConfig(**{"prefill": cluster.prefill_urls,
                                 "decode": cluster.decode_urls, **TEST_SETTINGS, **settings})
        app = create_app(config, cluster.transport(), store=store, clock=clock)
        router: Router = app.state.router
        await router.start(health_checks=health_checks)
        client = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                    base_url="http://router")
        harness = Harness(cluster, router, app, client, clock)
        made.append(harness)
        return harness

    yield make
    for h in made:
        await h.client.aclose()
        if h.router.started:
            await h.router.aclose()
    await asyncio.sleep(0)
