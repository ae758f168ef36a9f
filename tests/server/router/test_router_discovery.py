"""Backends from DNS (``dns+http://NAME:PORT``): addresses join and leave the pools without a
restart; in-flight requests on a leaving backend finish."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx2
import pytest

from kvturn_server.router import Router, RouterApp, RouterConfig, RouterConfigError, create_app
from kvturn_server.router._discovery import resolve
from tests.fakes.backends import DEFAULT_SSE, AsgiCall, Cluster, ManualClock, wait_for
from tests.fakes.router_harness import TEST_SETTINGS


class FakeDns:
    def __init__(self, **names: list[str]) -> None:
        self.names = names
        self.failing = False

    async def __call__(self, name: str, port: int) -> list[str]:
        if self.failing:
            raise OSError("Temporary failure in name resolution")
        return list(self.names.get(name, []))


@dataclass
class Discovered:
    router: Router
    cluster: Cluster
    dns: FakeDns
    client: httpx2.AsyncClient
    app: RouterApp


@pytest.fixture
async def discovered() -> AsyncIterator[Discovered]:
    cluster = Cluster(prefills=1, decodes=2)
    dns = FakeDns(decodes=["decode0"], prefills=["prefill0"])
    config = RouterConfig(prefill=("dns+http://prefills:8100",),
                          decode=("dns+http://decodes:8200",),
                          **{**TEST_SETTINGS, "discovery_interval": 3600.0})
    app = create_app(config, cluster.transport(), clock=ManualClock())
    router = app.router
    router.discovery.resolver = dns
    await router.start(health_checks=False)
    client = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                base_url="http://router")
    yield Discovered(router, cluster, dns, client, app)
    await client.aclose()
    await router.aclose()


def _body(conversation: str, stream: bool = False) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "stream": stream, "conversation_id": conversation}).encode()


async def test_members_join_and_leave_with_dns(discovered: Discovered) -> None:
    router, cluster, dns, client = (discovered.router, discovered.cluster, discovered.dns,
                                    discovered.client)
    assert [b.url for b in router.decodes.members] == ["http://decode0:8200"]
    assert router.decodes.members[0].control_url == "http://decode0:8201"
    assert [b.url for b in router.prefills.members] == ["http://prefill0:8100"]
    assert (await client.get("/ready")).json()["decode"] == {"healthy": 1, "total": 1}

    # A stream in flight on decode0 when it leaves.
    cluster.decodes[0].gate = asyncio.Event()
    call = AsgiCall(discovered.app, "POST", "/v1/chat/completions", _body("a", True),
                    {"content-type": "application/json"})
    first, _ = await call.next_body()
    assert first == DEFAULT_SSE[0]

    dns.names["decodes"] = ["decode0", "decode1"]
    await router.discovery.refresh()
    assert [b.url for b in router.decodes.members] == ["http://decode0:8200",
                                                       "http://decode1:8200"]
    dns.names["decodes"] = ["decode1"]
    await router.discovery.refresh()
    assert [b.url for b in router.decodes.members] == ["http://decode1:8200"]

    # New turns go to the one left, the conversation held by decode0 included.
    for conversation in ("b", "c", "a"):
        reply = await client.post("/v1/chat/completions", content=_body(conversation))
        assert reply.status_code == 200
    assert len(cluster.legs("decode1")) == 3 and len(cluster.legs("decode0")) == 1

    # The leaving decode's stream finishes.
    cluster.decodes[0].gate.set()
    rest = b""
    while True:
        chunk, more = await call.next_body()
        rest += chunk
        if not more:
            break
    assert first + rest == b"".join(DEFAULT_SSE)
    await call.done()
    await router.wait_idle()

    # A failed resolution changes nothing; an empty answer empties the pool.
    dns.failing = True
    await router.discovery.refresh()
    assert [b.url for b in router.decodes.members] == ["http://decode1:8200"]
    dns.failing = False
    dns.names["decodes"] = []
    await router.discovery.refresh()
    assert router.decodes.members == []
    reply = await client.get("/ready")
    assert reply.status_code == 503 and reply.json()["why"] == "no decode backend known yet"
    reply = await client.post("/v1/chat/completions", content=_body("d"))
    assert reply.status_code == 503


async def test_the_discovery_loop_runs_every_interval() -> None:
    cluster = Cluster(prefills=2)
    dns = FakeDns(prefills=["prefill0"])
    config = RouterConfig(prefill=("dns+http://prefills:8100",), decode=cluster.decode_urls,
                          **{**TEST_SETTINGS, "discovery_interval": 0.01})
    app = create_app(config, cluster.transport(), clock=ManualClock())
    app.router.discovery.resolver = dns
    await app.router.start(health_checks=False)
    try:
        dns.names["prefills"] = ["prefill0", "prefill1"]
        await wait_for(lambda: len(app.router.prefills.members) == 2)
    finally:
        await app.router.aclose()


async def test_real_resolution_of_localhost() -> None:
    assert "127.0.0.1" in await resolve("localhost", 8100)
    cluster = Cluster()
    config = RouterConfig(prefill=("dns+http://localhost:8100",), decode=cluster.decode_urls,
                          **{**TEST_SETTINGS, "discovery_interval": 3600.0})
    app = create_app(config, cluster.transport(), clock=ManualClock())
    await app.router.start(health_checks=False)
    try:
        assert "http://127.0.0.1:8100" in [b.url for b in app.router.prefills.members]
    finally:
        await app.router.aclose()


@pytest.mark.parametrize(("decode", "message"), [
    ("dns+http://decodes", r"a dns\+ URL needs a port"),
    ("dns+http://decodes:8200,control=dns+http://other:9201", "on the same name"),
    ("dns+http://decodes:8200,control=http://decodes:9201", "on the same name"),
    ("dns+ftp://decodes:8200", "must look like http://host:port"),
])
def test_bad_dns_entries(decode: str, message: str) -> None:
    with pytest.raises(RouterConfigError, match=message):
        RouterConfig(prefill=("http://p:1",), decode=(decode,))


def test_a_control_port_for_discovered_decodes() -> None:
    config = RouterConfig(prefill=("http://p:1",),
                          decode=("dns+http://decodes:8200,control=dns+http://decodes:9201",))
    assert config.decode[0].control == "dns+http://decodes:9201"
    assert config.decode[0].discovered
