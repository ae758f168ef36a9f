"""The router served by uvicorn over real sockets: graceful shutdown, the bench's numbers."""

from __future__ import annotations

import asyncio
import json

import uvicorn

from kvturn_server.bench._router import RouterBenchSettings, run_router_bench
from kvturn_server.local import free_port
from kvturn_server.router import PooledTransport, RouterConfig, create_app
from kvturn_server.router._backend import BackendClient, BackendError
from tests.fakes.backends import DEFAULT_SSE, Cluster, wait_for
from tests.fakes.router_harness import TEST_SETTINGS


async def test_shutdown_drains_in_flight_streams() -> None:
    cluster = Cluster()
    decode = cluster.decodes[0]
    decode.gate = asyncio.Event()
    config = RouterConfig(prefill=cluster.prefill_urls, decode=cluster.decode_urls,
                          **{**TEST_SETTINGS, "decode_timeout": 10.0, "drain_timeout": 10.0})
    app = create_app(config, cluster.transport())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", timeout_graceful_shutdown=10))
    serving = asyncio.ensure_future(server.serve())
    await wait_for(lambda: server.started or serving.done())
    client = BackendClient(PooledTransport())
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = json.dumps({"model": "m", "messages": [], "stream": True,
                       "conversation_id": "c"}).encode()
    stream = await client.open_stream(url, body, timeout=10)
    first = await stream.next_chunk()
    assert first == DEFAULT_SSE[0]

    server.should_exit = True  # what SIGTERM does
    other = BackendClient(PooledTransport())

    async def refused() -> bool:
        try:
            await other.call("GET", f"http://127.0.0.1:{port}/health", timeout=1)
        except BackendError as exc:
            return exc.kind == "connect"
        return False

    async with asyncio.timeout(5):
        while not await refused():
            await asyncio.sleep(0.01)
    assert not serving.done()  # still draining the stream

    decode.gate.set()
    rest = await stream.read_all()
    assert first + rest == b"".join(DEFAULT_SSE)
    async with asyncio.timeout(10):
        await serving
    # The lifespan shutdown ran after the drain: the turn was captured, the router closed.
    assert not app.state.router.started
    assert "-/c" in decode.retentions
    await client.aclose()
    await other.aclose()


def test_the_router_bench_measures_real_turns() -> None:
    results = run_router_bench(RouterBenchSettings(requests=30, warmup=5, concurrency=4,
                                                   duration=0.3, stream_chunks=4))
    latency = results["latency_ms"]
    assert set(latency) == {"non_stream", "stream_ttft", "stream_total"}
    for summary in latency.values():
        assert summary["samples"] == 30
        assert summary["router_p50_ms"] > 0 and summary["direct_p50_ms"] > 0
    for mode in ("non_stream", "stream"):
        assert results["throughput"][mode]["router_rps"] > 0
    # Every router request was a reuse turn: pinned, and streams captured by describe.
    counters = results["router_counters"]
    assert counters["pins"] >= 60 and counters["stream_captures"] >= 30
    assert set(results["targets"]) == {"added_p50_ms", "added_p99_ms", "met"}
