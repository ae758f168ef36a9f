"""``kvturn bench router``: what the router adds to a turn, against fast fake backends.

Three processes on loopback: fake backends (one uvicorn serving a prefill, a decode and the
decode's control endpoint, each answering from precomputed bytes), the router (``python -m
kvturn_server.router``, as deployed), and this process as the client (raw keep-alive HTTP/1.1
with prebuilt requests, so the client itself costs as little as possible).

- **Added latency**: one request at a time, alternating between the router and the same two
  legs called directly (prefill, then decode with the prefill's transfer params). Every router
  request continues a conversation, so each one pins a retention before its prefill leg, unpins
  after it and (streaming) captures the retention after the stream: the full per-turn work.
  Reported: p50/p99 of each path and their differences; for streams both the time to the first
  byte (TTFT) and to the end.
- **Throughput**: ``--concurrency`` clients (default 64) sending back to back for
  ``--duration`` seconds, through the router and, for reference, directly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvturn_server._cli_common import add_output_args, write_json
from kvturn_server.bench._router_client import Endpoints, TurnClient
from kvturn_server.bench._router_fakes import API_NAMES, serve_fake_backends
from kvturn_server.bench._stats import quantile
from kvturn_server.local import free_port

TARGET_ADDED_P50_MS = 1.5
TARGET_ADDED_P99_MS = 5.0


def _summary(direct: list[float], router: list[float]) -> dict[str, Any]:
    """Percentiles of each path; ``added_*`` are their differences, ``paired_added_*`` the
    percentiles of the per-pair differences (steadier on a busy machine)."""
    ms = 1000.0
    d50, d99 = quantile(direct, 0.5) * ms, quantile(direct, 0.99) * ms
    r50, r99 = quantile(router, 0.5) * ms, quantile(router, 0.99) * ms
    pairs = [r - d for r, d in zip(router, direct, strict=True)]
    return {"direct_p50_ms": round(d50, 3), "direct_p99_ms": round(d99, 3),
            "router_p50_ms": round(r50, 3), "router_p99_ms": round(r99, 3),
            "added_p50_ms": round(r50 - d50, 3), "added_p99_ms": round(r99 - d99, 3),
            "paired_added_p50_ms": round(quantile(pairs, 0.5) * ms, 3),
            "paired_added_p99_ms": round(quantile(pairs, 0.99) * ms, 3),
            "samples": len(router)}


async def _latency(ports: Endpoints, requests: int, warmup: int,
                   api: str = "chat") -> dict[str, Any]:
    client = TurnClient(ports, conversations=16, index=0, api=api)
    await client.open()
    results: dict[str, Any] = {}
    try:
        for stream in (False, True):
            for _ in range(warmup):
                await client.via_router(stream)
                await client.direct(stream)
            direct: list[tuple[float, float]] = []
            router: list[tuple[float, float]] = []
            for i in range(requests):
                # Alternate the order so that neither path always follows the other.
                if i % 2:
                    router.append(await client.via_router(stream))
                    direct.append(await client.direct(stream))
                else:
                    direct.append(await client.direct(stream))
                    router.append(await client.via_router(stream))
            if stream:
                results["stream_ttft"] = _summary([d[0] for d in direct],
                                                  [r[0] for r in router])
                results["stream_total"] = _summary([d[1] for d in direct],
                                                   [r[1] for r in router])
            else:
                results["non_stream"] = _summary([d[1] for d in direct],
                                                 [r[1] for r in router])
    finally:
        client.close()
    return results


async def _throughput(ports: Endpoints, concurrency: int, duration: float, stream: bool,
                      via_router: bool) -> float:
    clients = [TurnClient(ports, conversations=4, index=i) for i in range(concurrency)]
    for c in clients:
        await c.open()
    done = 0
    stop = time.perf_counter() + duration

    async def run(client: TurnClient) -> None:
        nonlocal done
        call = client.via_router if via_router else client.direct
        while time.perf_counter() < stop:
            await call(stream)
            done += 1

    started = time.perf_counter()
    try:
        await asyncio.gather(*(run(c) for c in clients))
    finally:
        for c in clients:
            c.close()
    return done / (time.perf_counter() - started)


async def _router_counters(port: int) -> dict[str, float]:
    """What the router says it did (proof that the turns pinned and captured)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    text = (await reader.read()).decode()
    writer.close()
    wanted = {'kvturn_router_leg_seconds_count{leg="pin"}': "pins",
              'kvturn_router_leg_seconds_count{leg="capture"}': "stream_captures",
              'kvturn_router_reuse_total{outcome="hit"}': "reuse_hit",
              'kvturn_router_captures_total{outcome="recorded"}': "captures_recorded",
              "kvturn_router_conversations": "conversations"}
    counters = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            counters[wanted[name]] = float(value)
    return counters


async def _wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited at start-up (code {proc.returncode})")
        with contextlib.suppress(OSError):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            writer.close()
            if head.startswith(b"HTTP/1.1 200"):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router did not become healthy within {timeout} s")
        await asyncio.sleep(0.05)


@dataclass
class RouterBenchSettings:
    requests: int = 2000
    warmup: int = 200
    concurrency: int = 64
    duration: float = 5.0
    stream_chunks: int = 16
    router_args: tuple[str, ...] = ()
    apis: tuple[str, ...] = ("chat",)


def run_router_bench(settings: RouterBenchSettings) -> dict[str, Any]:
    """Start the fakes and the router, measure, stop them; returns the results."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    fakes = subprocess.Popen(
        [sys.executable, "-c", "from kvturn_server.bench._router_fakes import serve_fake_backends; "
         f"serve_fake_backends({int(settings.stream_chunks)})"], stdout=subprocess.PIPE, env=env)
    router: subprocess.Popen[bytes] | None = None
    try:
        assert fakes.stdout is not None
        line = fakes.stdout.readline()
        if not line:
            raise RuntimeError("the fake backends did not start")
        fake_ports = json.loads(line)
        router_port = free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "kvturn_server.router", "--port", str(router_port),
             "--prefill", f"http://127.0.0.1:{fake_ports['prefill']}",
             "--decode", f"http://127.0.0.1:{fake_ports['decode']},"
                         f"control=http://127.0.0.1:{fake_ports['control']}",
             # The prefill path is the router's full per-turn work (pin, two legs, unpin,
             # capture); a turn the decode continues alone is one leg and no control call.
             "--decode-continue-tokens", "0",
             "--log-level", "warning", *settings.router_args], env=env)
        ports = Endpoints(router_port, fake_ports["prefill"], fake_ports["decode"])
        runner: Callable[[Any], Any] = asyncio.run
        with contextlib.suppress(ImportError):
            import uvloop

            runner = uvloop.run

        async def measure() -> dict[str, Any]:
            assert router is not None
            await _wait_healthy(router_port, router, 30.0)
            latency = await _latency(ports, settings.requests, settings.warmup)
            apis = {api: await _latency(ports, settings.requests, settings.warmup, api)
                    for api in settings.apis if api != "chat"}
            throughput = {}
            for stream in (False, True):
                name = "stream" if stream else "non_stream"
                throughput[name] = {
                    "router_rps": round(await _throughput(
                        ports, settings.concurrency, settings.duration, stream, True), 1),
                    "direct_rps": round(await _throughput(
                        ports, settings.concurrency, settings.duration, stream, False), 1)}
            return {"latency_ms": latency, "throughput": throughput,
                    **({"apis": _versus_chat(latency, apis)} if apis else {}),
                    "router_counters": await _router_counters(router_port)}

        measured: dict[str, Any] = runner(measure())
    finally:
        for proc in (router, fakes):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    latency = measured["latency_ms"]
    worst50 = max(latency[k]["added_p50_ms"] for k in ("non_stream", "stream_ttft"))
    worst99 = max(latency[k]["added_p99_ms"] for k in ("non_stream", "stream_ttft"))
    return {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "settings": {"requests": settings.requests, "warmup": settings.warmup,
                     "concurrency": settings.concurrency, "duration_s": settings.duration,
                     "stream_chunks": settings.stream_chunks,
                     "router_args": list(settings.router_args), "apis": list(settings.apis),
                     "router_requests": "every request continues a conversation: pin, "
                                        "prefill, unpin, decode, capture"},
        **measured,
        "targets": {"added_p50_ms": TARGET_ADDED_P50_MS, "added_p99_ms": TARGET_ADDED_P99_MS,
                    "met": worst50 <= TARGET_ADDED_P50_MS and worst99 <= TARGET_ADDED_P99_MS},
    }


API_MARGIN = 0.2
"""The Messages and Responses paths may add at most this much more than chat's (issue 15)."""


def _versus_chat(chat: dict[str, Any], apis: dict[str, Any]) -> dict[str, Any]:
    """Each API's latency, and its paired added p50 against chat's (non-streaming and TTFT):
    ``within_margin`` when at most ``API_MARGIN`` more, or within 0.05 ms (timer noise)."""
    out: dict[str, Any] = {}
    for api, latency in apis.items():
        compare = {}
        for mode in ("non_stream", "stream_ttft"):
            mine, base = (latency[mode]["paired_added_p50_ms"],
                          chat[mode]["paired_added_p50_ms"])
            compare[mode] = {"added_p50_ms": mine, "chat_added_p50_ms": base,
                             "ratio": round(mine / base, 3) if base > 0 else None,
                             "within_margin": mine <= base * (1 + API_MARGIN) + 0.05}
        out[api] = {"latency_ms": latency, "versus_chat": compare}
    return out


def _print(results: dict[str, Any]) -> None:
    lat = results["latency_ms"]
    rows = [("non-streaming", lat["non_stream"]), ("streaming TTFT", lat["stream_ttft"]),
            ("streaming total", lat["stream_total"])]
    print(f"{'':18}{'direct p50':>11}{'router p50':>11}{'added p50':>10}"  # noqa: T201
          f"{'direct p99':>11}{'router p99':>11}{'added p99':>10}  (ms)")
    for name, r in rows:
        print(f"{name:18}{r['direct_p50_ms']:>11.3f}{r['router_p50_ms']:>11.3f}"  # noqa: T201
              f"{r['added_p50_ms']:>10.3f}{r['direct_p99_ms']:>11.3f}"
              f"{r['router_p99_ms']:>11.3f}{r['added_p99_ms']:>10.3f}")
    print("median / p99 of paired differences (ms): " + ", ".join(  # noqa: T201
        f"{name} {r['paired_added_p50_ms']:.3f} / {r['paired_added_p99_ms']:.3f}"
        for name, r in rows))
    for name, t in results["throughput"].items():
        print(f"{name} at {results['settings']['concurrency']} clients: "  # noqa: T201
              f"{t['router_rps']:.0f} req/s through the router, {t['direct_rps']:.0f} direct")
    for api, entry in results.get("apis", {}).items():
        for mode, c in entry["versus_chat"].items():
            print(f"{api} {mode}: paired added p50 {c['added_p50_ms']:.3f} ms vs chat "  # noqa: T201
                  f"{c['chat_added_p50_ms']:.3f} ms (ratio {c['ratio']}): "
                  f"{'within' if c['within_margin'] else 'NOT within'} "
                  f"{API_MARGIN:.0%}")
    targets = results["targets"]
    print(f"targets (added p50 <= {targets['added_p50_ms']} ms, p99 <= "  # noqa: T201
          f"{targets['added_p99_ms']} ms): {'met' if targets['met'] else 'NOT met'}")


def _apis_of(given: Sequence[str] | None) -> tuple[str, ...]:
    if not given:
        return ("chat",)
    if "all" in given:
        return API_NAMES
    return tuple(dict.fromkeys(["chat", *given]))


def cmd_bench_router(args: argparse.Namespace) -> int:
    settings = RouterBenchSettings(requests=args.requests, warmup=args.warmup,
                                   concurrency=args.concurrency, duration=args.duration,
                                   stream_chunks=args.stream_chunks,
                                   router_args=tuple(args.router_arg or ()),
                                   apis=_apis_of(args.api))
    results = run_router_bench(settings)
    write_json(results, args.json)
    _print(results)
    print(f"wrote {args.json}")  # noqa: T201
    return 0


def add_router_bench_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``router`` to ``kvturn bench``'s subcommands (sets ``func``)."""
    d = RouterBenchSettings()
    p: argparse.ArgumentParser = bench_subparsers.add_parser(
        "router", help="router overhead: added latency and proxied requests per second",
        description="Start fast fake backends and the router on loopback; measure the "
                    "latency the router adds to a turn (p50/p99, streaming and not) against "
                    "calling the two legs directly, and requests per second at N concurrent "
                    "clients. About a minute.")
    add_output_args(p, plot=False)
    p.add_argument("--requests", type=int, default=d.requests,
                   help="latency samples per path and mode (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="default: %(default)s")
    p.add_argument("--concurrency", type=int, default=d.concurrency,
                   help="clients for the throughput runs (default: %(default)s)")
    p.add_argument("--duration", type=float, default=d.duration,
                   help="seconds per throughput run (default: %(default)s)")
    p.add_argument("--stream-chunks", type=int, default=d.stream_chunks,
                   help="events per streamed reply (default: %(default)s)")
    p.add_argument("--router-arg", action="append", metavar="ARG",
                   help="extra flag for the router, repeatable (e.g. "
                        "--router-arg=--state=redis://127.0.0.1:6379/0, "
                        "--router-arg=--http-client=httpx)")
    p.add_argument("--api", action="append", choices=(*API_NAMES, "all"),
                   help="measure the added latency of this API's path too, beside chat's "
                        "(repeatable; all: chat, messages and responses; default: chat)")
    p.set_defaults(func=cmd_bench_router)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--serve-fakes"]:
        serve_fake_backends(int(args[1]) if len(args) > 1 else 16)
        return 0
    parser = argparse.ArgumentParser(prog="python -m kvturn_server.bench._router")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_router_bench_parser(sub)
    parsed = parser.parse_args(["router", *args])
    return int(parsed.func(parsed))


if __name__ == "__main__":
    sys.exit(main())
