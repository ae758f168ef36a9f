"""``kvturn bench router --api all``: the Messages and Responses paths measured beside chat's."""

from __future__ import annotations

from kvturn_server.bench._router import API_NAMES, RouterBenchSettings, run_router_bench


def test_the_router_bench_measures_every_api() -> None:
    results = run_router_bench(RouterBenchSettings(requests=20, warmup=3, concurrency=2,
                                                   duration=0.2, stream_chunks=4,
                                                   apis=API_NAMES))
    assert set(results["apis"]) == {"messages", "responses"}
    for entry in results["apis"].values():
        for summary in entry["latency_ms"].values():
            # Every request answered 200 (the bench client raises otherwise).
            assert summary["samples"] == 20 and summary["router_p50_ms"] > 0
        assert set(entry["versus_chat"]) == {"non_stream", "stream_ttft"}
    # Chat's 2 x 20 turns plus each API's: every one pinned a retention.
    counters = results["router_counters"]
    assert counters["pins"] >= 3 * 2 * 20
