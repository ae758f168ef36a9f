"""``kvturn bench reuse``: the next turn's TTFT when its history's KV comes from different places.

One stack: a prefill and a decode vLLM with the kvturn connector, both with vLLM's default
prefix cache on, same flags in every mode. A row is a previous turn of ``tokens`` prompt tokens
that generated ``generated`` tokens; the timed request is the next turn: that history plus a
64-token new message, run as a router runs it (pin if reading, prefill leg, unpin, decode leg up
to its first token, with the conversation key so the decode retains it). Five modes per row,
each a fresh conversation in every run:

(a) recompute: nothing cached anywhere: the prefill computes the whole prompt, the decode reads
    all of it from the prefill.
(b) reuse: the prefill holds none of the conversation (the last turn ran on another prefill,
    or it evicted it): it reads the previous prompt and the generated tokens from the decode's
    retention over NIXL and computes the new message.
(c) floor: the prefill's cache already holds every token of the history: it computes only the
    new message. Same prefill, flags and connector as (b), followed by the same decode leg, so
    (b) and (c) differ only in where the history's KV came from (and (b)'s pin and unpin, part
    of what reuse costs). Nothing can be faster: a mode below the floor beyond the spread is a
    measurement error, and the table and JSON say so.
(d) stock: vLLM's default P/D: the prefill holds the previous prompt (it computed it last turn)
    and computes the generated tokens and the new message.
(e) reuse+cache: kvturn on vLLM's default: the prefill holds the previous prompt and reads only
    the generated tokens from the decode. stock / reuse+cache is kvturn's gain over vLLM's
    default in the same prefill state; at 0 generated tokens there is nothing to read and the
    difference is the pin's cost.

How each state is made, and why:

- The decode holds the history in (b)-(e), as it does after any P/D turn (retention or prefix
  cache), so their decode legs are alike: they hit the history locally and read the new message
  from the prefill. (a) is "nothing cached": its decode reads everything.
- (c), (d) and (e) share one previous prompt per row: one P/D turn puts it in the prefill's
  cache and in a retention on the decode (held for the whole row). Their generated tokens and
  new messages are fresh per run and mode, so no timed request finds what another left; (b)'s
  and (a)'s prompts are fresh from their first token.
- The generated tokens are made on the decode: a request straight to the decode with the
  history as its prompt and the mode's conversation key, so the decode computes them and
  retains the history, and the prefill never sees them, exactly as with generated tokens.
  Decoding 2,048 tokens one by one would take minutes per conversation on CPU; the KV the decode
  then holds is the same. (b)'s whole history is made that way, so its prefill stays cold.
- (c)'s prefill is warmed with its history by one plain request to the prefill.
- All setup runs first in each run; then, before every timed request, the benchmark waits until
  both instances report no running or waiting request (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``), pauses ``settle_s``, and checks again, so each timed request
  starts after the same idle time. The pause (1.25 s) outlasts vLLM's busy loop: a worker spins
  on its shared-memory queue for 1 s after each engine step (measured: half a core per instance
  for 1.0-1.5 s after a turn, then nothing), so every timed request starts with both engines
  asleep. A shorter pause would start each one beside two spinning workers on a 2-core machine,
  and would hide what a pin costs where the decode steps while pinned
  (``nixl_progress_thread: false``); by default a pinned decode's NIXL progress thread serves
  the read and its engine sleeps.
- The five modes run in a Williams order per run (each mode in each position and right after
  each other mode equally often); unrecorded warm-up runs (NIXL handshakes both ways, first
  requests) come before the first row.
- Each timed request's prompt tokens by source (``vllm:prompt_tokens_by_source_total`` on both
  instances) are compared with the plan; a mode that did not get its planned sources is flagged.

Reported per row and mode: TTFT p50, p10/p90, min/max over ``runs`` runs; ratios of the p50s
(recompute / reuse, reuse / floor with the issue's target 1.0-1.25, reuse+cache / floor,
stock / reuse+cache, stock / reuse), per-run paired ratios, the token sources and the warnings.
"""

from __future__ import annotations

import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvturn_server._cli_common import say_written, write_json
from kvturn_server.bench._reuse_plan import (
    DECODE_HOLDS,
    MODES,
    NEW_TOKENS,
    PINNED,
    PREFILL_WARM,
    Fresh,
    Row,
    plan_rows,
    run_orders,
    run_prompts,
)
from kvturn_server.bench._reuse_report import (
    RowSamples,
    results_document,
    summarize,
    table,
    write_plot,
)
from kvturn_server.bench._reuse_stack import Backend, Snapshot, StackBackend
from kvturn_server.bench._sampling import loadavg
from kvturn_server.local import ProgressLine, Stack, StackConfig


@dataclass(frozen=True)
class ReuseBenchSettings:
    """What ``kvturn bench reuse`` measures (see the module docstring)."""

    sizes: tuple[int, ...] = (2048, 4096, 8192)
    generated: tuple[int, ...] = (0, 512, 2048)
    generated_sizes: tuple[int, ...] | None = (2048,)
    """Sizes measured at every generated count (the others only at the smallest); None: all."""
    runs: int = 20
    warmup_runs: int = 1
    settle_s: float = 1.25
    """Longer than vLLM's 1 s busy loop after an engine step (its shared-memory queue spins
    that long before it sleeps): every timed request starts with both engines asleep."""
    seed: int = 0
    state_dir: Path = Path(".kvturn/bench")
    decode_steps_while_pinned: bool = False
    """The decode without NIXL's progress thread: its engine steps while a pin is held, as
    before the thread was the decodes' default (docs/cpu-stack.md)."""
    size: str = "bench"
    """The locally built model served (``8b``: a real 8B model's shape, for GPUs)."""
    gpu: bool = False
    """Run on an accelerator: KV in its memory, not the CPU build's host buffer."""
    vllm_args: tuple[str, ...] = ()
    """More ``vllm serve`` flags for both instances."""

    def rows(self) -> list[Row]:
        return plan_rows(self.sizes, self.generated, self.generated_sizes)

    def check(self, max_model_len: int) -> None:
        """Raise ValueError with the reason when these settings cannot run."""
        if self.runs < 1 or self.warmup_runs < 0 or self.settle_s < 0:
            raise ValueError("--runs must be at least 1, --warmup-runs and --settle at least 0")
        if min(self.sizes) < 256 or min(self.generated) < 0:
            raise ValueError("--sizes must be at least 256 tokens, --generated at least 0")
        longest = max(r.prompt_tokens for r in self.rows())
        if longest >= max_model_len:
            raise ValueError(f"the longest prompt, {longest} tokens, does not fit the bench "
                             f"stack's {max_model_len}-token context")

    def describe(self) -> dict[str, Any]:
        data = asdict(self)
        data["state_dir"] = str(self.state_dir)
        data["generated_sizes"] = (list(self.generated_sizes) if self.generated_sizes
                                   is not None else "all")
        return data


def bench_config(state_dir: Path, ports: dict[str, Any], *,
                 decode_steps_while_pinned: bool = False, size: str = "bench",
                 gpu: bool = False, vllm_args: tuple[str, ...] = ()) -> StackConfig:
    """The benchmark's stack: bench model, 32k context, prefix cache on (vLLM's default) on both
    instances, a retention lease longer than any row (the shared prompt's retention is held for
    a whole row), no router and no plain instance. ``gpu``: KV in the GPU's memory (vLLM's
    default) instead of the CPU build's host buffer; ``vllm_args`` go to both instances (on one
    GPU, each its share: ``--gpu-memory-utilization=0.4``)."""
    cfg = StackConfig(
        state_dir=state_dir, model_size=size, served_model_name=f"kvturn-{size}",
        max_model_len=32768, kv_cache_gib=2, decoder_kv_blocks_ttl=3600,
        prefill_prefix_caching=True, with_reference=False, with_router=False,
        kv_read_timeout=30, kv_buffer_device=None if gpu else "cpu",
        extra_vllm_args=vllm_args,
        decode_connector_extra={"nixl_progress_thread": False} if decode_steps_while_pinned
        else {})
    return replace(cfg, **ports)


class ReuseRunner:
    """Runs the plan against a :class:`Backend`: setups, idle waits, timed turns, samples."""

    def __init__(self, backend: Backend, settings: ReuseBenchSettings, fresh: Fresh, *,
                 now: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep,
                 say: Callable[[str], None] = print,
                 poll_s: float = 0.05, idle_timeout_s: float = 300.0) -> None:
        self.backend = backend
        self.settings = settings
        self.fresh = fresh
        self.now = now
        self.sleep = sleep
        self.say = say
        self.poll_s = poll_s
        self.idle_timeout_s = idle_timeout_s
        self.nonce = "".join(random.Random(settings.seed).choices("0123456789abcdef", k=8))

    def idle(self) -> Snapshot:
        """A snapshot once both instances report no running or waiting request."""
        deadline = self.now() + self.idle_timeout_s
        while True:
            snap = self.backend.snapshot()
            if snap.idle:
                return snap
            if self.now() > deadline:
                raise RuntimeError(f"the prefill and decode did not become idle within "
                                   f"{self.idle_timeout_s:g} s; another process is using them?")
            self.sleep(self.poll_s)

    def settled(self) -> Snapshot:
        """A snapshot taken ``settle_s`` after both instances were seen idle, and still idle
        then: every timed request starts after the same idle time."""
        while True:
            self.idle()
            self.sleep(self.settings.settle_s)
            snap = self.backend.snapshot()
            if snap.idle:
                return snap

    def _key(self, row: Row, run: int | str, mode: str) -> str:
        return f"bench-reuse/{self.nonce}/{row.tokens}+{row.generated}/{run}/{mode}"

    def run_once(self, row: Row, shared_prompt: Sequence[int], run: int,
                 order: Sequence[str], record: RowSamples | None) -> dict[str, float]:
        """One run: every mode's setup, then its timed turns in ``order``; TTFTs in ms."""
        prompts = run_prompts(row, shared_prompt, self.fresh)
        keys = {m: self._key(row, run, m) for m in MODES}
        ttft: dict[str, float] = {}
        try:
            for mode in MODES:
                if mode in DECODE_HOLDS:
                    self.backend.hold(prompts[mode].history, keys[mode])
                if mode in PREFILL_WARM:
                    self.backend.warm(prompts[mode].history)
            for mode in order:
                before = self.settled()
                started = self.now()
                reply = self.backend.turn(prompts[mode].prompt, keys[mode],
                                          read_retention=mode in PINNED)
                ttft[mode] = (self.now() - started) * 1000
                # vLLM counts a request's prompt tokens in the same step that ends it, so the
                # counters are final once both instances are idle.
                after = self.idle()
                if record is not None:
                    record.modes[mode].add(ttft[mode], after.prefill - before.prefill,
                                           after.decode - before.decode, reply.steps_ms)
        finally:
            for key in keys.values():
                self.backend.release(key)
        return ttft

    def measure_row(self, row: Row, warmup_runs: int = 0) -> RowSamples:
        s = self.settings
        started = self.now()
        shared = self.fresh(row.tokens)
        shared_key = self._key(row, "shared", "prompt")
        reply = self.backend.turn(shared, shared_key, read_retention=False)
        samples = RowSamples(row, reply.block_size)
        samples.loadavg["start"] = list(loadavg())
        orders = run_orders(s.runs)
        try:
            for i in range(warmup_runs):
                self.run_once(row, shared, -1 - i, MODES, None)
            for i, order in enumerate(orders):
                ttft = self.run_once(row, shared, i, order, samples)
                samples.orders.append(tuple(order))
                self.say(f"  run {i + 1:2d}/{s.runs}: " + "  ".join(
                    f"{m} {ttft[m]:.0f}" for m in MODES) + " ms")
        finally:
            self.backend.release(shared_key)
        samples.loadavg["end"] = list(loadavg())
        samples.wall_s = self.now() - started
        self.say(f"  {samples.wall_s:.0f} s")
        return samples

    def measure(self) -> list[dict[str, Any]]:
        """Every row; the warm-up runs (NIXL handshakes both ways, first-request costs) come
        before the first row only: later rows find those paid."""
        rows = []
        for i, row in enumerate(self.settings.rows()):
            warmup = self.settings.warmup_runs if i == 0 else 0
            self.say(f"{row.tokens} tokens + {row.generated} generated + {NEW_TOKENS} new: "
                     f"{warmup} warm-up and {self.settings.runs} runs")
            rows.append(summarize(self.measure_row(row, warmup)))
        return rows


def _config(settings: ReuseBenchSettings, cfg: StackConfig,
            startup_s: float | None) -> dict[str, Any]:
    return {
        "settings": settings.describe(), "new_tokens": NEW_TOKENS,
        "stack": {"model": cfg.model_size, "max_model_len": cfg.max_model_len,
                  "kv_cache_gib": cfg.kv_cache_gib,
                  "prefill_prefix_caching": cfg.prefill_prefix_caching,
                  "decode_prefix_caching": True, "kv_read_timeout_s": cfg.kv_read_timeout,
                  "decode_while_pinned": "engine steps" if settings.decode_steps_while_pinned
                  else "NIXL progress thread",
                  "startup_s": None if startup_s is None else round(startup_s, 1)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "ttft": "pin (reading modes) + prefill leg + unpin + decode leg to its first token",
    }


def run_reuse_bench(settings: ReuseBenchSettings, json_path: Path, plot_path: Path,
                    ports: dict[str, int], say: Callable[[str], None] = print) -> list[
                        dict[str, Any]]:
    """Start the benchmark stack, measure every row, stop it; print the table, write the JSON
    and the plot."""

    cfg = bench_config(settings.state_dir, ports,
                       decode_steps_while_pinned=settings.decode_steps_while_pinned,
                       size=settings.size, gpu=settings.gpu, vllm_args=settings.vllm_args)
    settings.check(cfg.max_model_len)
    rng = random.Random(settings.seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(10, 1600) for _ in range(n)]

    say(f"starting the benchmark stack ({settings.size} model; prefill and decode, prefix "
        "cache on)")
    started = time.monotonic()
    with Stack(cfg, die_with_parent=True) as stack:
        stack.start(progress=ProgressLine())
        rows = ReuseRunner(StackBackend(cfg), settings, fresh, say=say).measure()
        startup = stack.startup_seconds
    config = _config(settings, cfg, startup)
    config["wall_s"] = round(time.monotonic() - started, 1)
    say(table(rows))
    write_json(results_document(config, rows), json_path)
    device = "GPU" if settings.gpu else "CPU"
    say_written(json_path, plot_path, write_plot(
        rows, plot_path, f"kvturn bench reuse ({device}, {settings.size} model)"), say)
    return rows
