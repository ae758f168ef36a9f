"""``kvturn bench reuse``: next-turn TTFT recomputed vs reused from the decode vs local cache hit.

For each prompt size a conversation turn runs on prefill + decode; then the next turn (previous
prompt + 32 generated tokens + 64 new tokens) is measured three ways:

(a) recompute: the prefill (prefix cache off) computes the whole prompt;
(b) reuse: the prefill reads the decode's retained, content-verified blocks over NIXL and
    computes only the rest;
(c) local hit: a plain instance whose prefix cache already holds the previous turn (the KV is
    already in place: the best any reuse can do).

TTFT for (a) and (b) is the prefill leg plus the decode leg up to its first token, as a router
would see it; (c) is one request to the plain instance. Medians over ``runs`` fresh
conversations per size.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvturn_server._plot import pyplot, save
from kvturn_server.local._direct import (
    NULL_PARAMS,
    DirectConversation,
    control,
    retention_path,
)
from kvturn_server.local._http import post_json
from kvturn_server.local._metrics import prompt_sources
from kvturn_server.local._stack import Stack, StackConfig

GENERATED = 32
NEW_TOKENS = 64


@dataclass(frozen=True)
class SizeResult:
    """One prompt size: median TTFTs and the prefill's token sources on the reuse turn."""

    tokens: int
    ttft_recompute_ms: float
    ttft_reuse_ms: float
    ttft_local_hit_ms: float
    reused_tokens: float
    computed_tokens: float

    @property
    def speedup(self) -> float:
        return self.ttft_recompute_ms / self.ttft_reuse_ms

    @property
    def reuse_over_local(self) -> float:
        return self.ttft_reuse_ms / self.ttft_local_hit_ms


def bench_config(state_dir: Path, ports: dict[str, Any]) -> StackConfig:
    """The stack the benchmark needs: bench model, 32k context, decode->prefill reuse on."""
    cfg = StackConfig(
        state_dir=state_dir, model_size="bench", served_model_name="kvturn-bench",
        max_model_len=32768, kv_cache_gib=2, decoder_kv_blocks_ttl=60,
        prefill_prefix_caching=False, with_reference=True, with_router=False,
        kv_read_timeout=30)
    return replace(cfg, **ports)


class _Runner:
    def __init__(self, cfg: StackConfig, seed: int) -> None:
        self.cfg = cfg
        self.rng = random.Random(seed)

    def _body(self, prompt: list[int], max_tokens: int,
              params: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.cfg.served_model_name, "prompt": prompt,
                                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                "return_token_ids": True}
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    def _post(self, base_url: str, body: dict[str, Any]) -> dict[str, Any]:
        return post_json(f"{base_url}/v1/completions", body, timeout=600)

    def _ttft(self, prompt: list[int], prefill_params: dict[str, Any],
              started: float | None = None) -> float:
        started = time.perf_counter() if started is None else started
        prefilled = self._post(self.cfg.prefill_url, self._body(prompt, 1, prefill_params))
        self._post(self.cfg.decode_url, self._body(prompt, 1, prefilled["kv_transfer_params"]))
        return (time.perf_counter() - started) * 1000

    def run(self, tokens: int) -> tuple[float, float, float, float, float]:
        cfg = self.cfg
        conv = DirectConversation(cfg.prefill_url, cfg.decode_url, cfg.decode_control_url,
                                  cfg.served_model_name, key=f"bench/{self.rng.random()}")
        first = [self.rng.randrange(10, 1600) for _ in range(tokens)]
        history = first + conv.turn(first, GENERATED).token_ids
        nxt = history + [self.rng.randrange(10, 1600) for _ in range(NEW_TOKENS)]

        recompute = self._ttft(nxt, dict(NULL_PARAMS))
        before = prompt_sources(cfg.prefill_url)
        # The pin is part of a router's turn too: it is inside the measured time.
        started = time.perf_counter()
        status, pinned = control(cfg.decode_control_url, "POST",
                                 retention_path(conv.key, "pin"), {"ttl": 60})
        if status != 200:
            raise RuntimeError(f"the benchmark's retention is gone: {pinned}")
        reuse = self._ttft(nxt, {**pinned["params"], "do_remote_decode": True,
                                 "do_remote_prefill": False}, started)
        control(cfg.decode_control_url, "DELETE", f"/kvturn/v1/pins/{pinned['pin_id']}")
        sources = prompt_sources(cfg.prefill_url) - before
        conv.release()

        self._post(cfg.reference_url, self._body(history, 1))
        started = time.perf_counter()
        self._post(cfg.reference_url, self._body(nxt, 1))
        local = (time.perf_counter() - started) * 1000
        return recompute, reuse, local, sources.transferred, sources.computed


def run_reuse_bench(cfg: StackConfig, sizes: Sequence[int], runs: int,
                    say: Callable[[str], None] = print, seed: int = 0) -> list[SizeResult]:
    """Start the benchmark stack, measure every size, stop the stack."""
    from kvturn_server.cli import ProgressLine

    say("starting the benchmark stack (bench model; prefill, decode, plain instance)")
    with Stack(cfg, die_with_parent=True) as stack:
        stack.start(progress=ProgressLine())
        runner = _Runner(cfg, seed)
        runner.run(min(sizes))  # warm-up: NIXL handshakes, first-request costs
        results: list[SizeResult] = []
        for tokens in sizes:
            samples = [runner.run(tokens) for _ in range(runs)]
            columns = list(zip(*samples, strict=True))
            result = SizeResult(tokens, *(statistics.median(c) for c in columns))
            results.append(result)
            say(f"{tokens:6d} tokens: recompute {result.ttft_recompute_ms:7.0f} ms | reuse "
                f"{result.ttft_reuse_ms:6.0f} ms | local hit {result.ttft_local_hit_ms:6.0f} ms"
                f" | recompute/reuse {result.speedup:5.1f}x | reuse/local "
                f"{result.reuse_over_local:4.2f} | reused {result.reused_tokens:.0f}, computed "
                f"{result.computed_tokens:.0f} tokens")
    return results


def write_json(results: Sequence[SizeResult], path: Path, runs: int) -> None:
    data = {"runs_per_size": runs, "sizes": [asdict(r) for r in results]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_plot(results: Sequence[SizeResult], path: Path) -> bool:
    """A PNG of TTFT per size; False when matplotlib (extra ``[bench]``) is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    tokens = [r.tokens for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(tokens, [r.ttft_recompute_ms for r in results], "o-", label="recompute")
    ax.plot(tokens, [r.ttft_reuse_ms for r in results], "o-",
            label="kvturn reuse (decode -> prefill)")
    ax.plot(tokens, [r.ttft_local_hit_ms for r in results], "o-", label="local prefix-cache hit")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("previous-turn tokens")
    ax.set_ylabel("next-turn TTFT (ms)")
    ax.set_title("kvturn bench reuse (CPU, bench model)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save(plt, fig, path)
    return True
