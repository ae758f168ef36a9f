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

import argparse
import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

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
    summarize,
    table,
    write_json,
    write_plot,
)
from kvturn_server.local._direct import DirectConversation, control, retention_path
from kvturn_server.local._http import post_json
from kvturn_server.local._metrics import PromptSources, Samples, scrape, sources, total
from kvturn_server.local._model import SIZES
from kvturn_server.local._progress import ProgressLine
from kvturn_server.local._stack import Stack, StackConfig


@dataclass(frozen=True)
class Snapshot:
    """Both instances at one moment: idle or not, and their prompt-token counters."""

    idle: bool
    prefill: PromptSources
    decode: PromptSources


@dataclass(frozen=True)
class TurnReply:
    """What a P/D turn reports back: the decode's block size, the prefill's reuse report and
    the milliseconds each step took (``pin``, ``prefill``, ``unpin``, ``decode``; a step that
    did not happen is absent)."""

    block_size: int
    reuse: dict[str, Any]
    steps_ms: dict[str, float] = field(default_factory=dict)


class Backend(Protocol):
    """The five things the benchmark does to the stack (tests swap in a fake)."""

    def turn(self, prompt: Sequence[int], key: str, *, read_retention: bool) -> TurnReply:
        """A router's turn: pin ``key``'s retention if reading, prefill leg, unpin, decode leg
        (first token), retained under ``key``."""

    def hold(self, prompt: Sequence[int], key: str) -> None:
        """The decode computes what it lacks of ``prompt`` and retains it under ``key``."""

    def warm(self, prompt: Sequence[int]) -> None:
        """The prefill computes what it lacks of ``prompt`` into its prefix cache."""

    def release(self, key: str) -> None: ...

    def snapshot(self) -> Snapshot: ...


def _running(samples: Samples) -> float:
    return (total(samples, "vllm:num_requests_running")
            + total(samples, "vllm:num_requests_waiting"))


class StackBackend:
    """:class:`Backend` over a started stack's prefill and decode (completions API)."""

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg

    def _conversation(self, key: str, reuse: bool) -> DirectConversation:
        cfg = self.cfg
        return DirectConversation(cfg.prefill_url, cfg.decode_url, cfg.decode_control_url,
                                  cfg.served_model_name, key=key, reuse=reuse)

    def turn(self, prompt: Sequence[int], key: str, *, read_retention: bool) -> TurnReply:
        leg = self._conversation(key, read_retention).turn(list(prompt), 1)
        if read_retention and leg.pin is None:
            raise RuntimeError(f"the benchmark's retention {key!r} could not be pinned "
                               f"({leg.gone}); its mode would measure a recompute")
        return TurnReply(_retained_block_size(leg.decode, key), leg.reuse,
                         {step: s * 1000 for step, s in leg.steps.items()})

    def hold(self, prompt: Sequence[int], key: str) -> None:
        conv = self._conversation(key, False)
        reply = post_json(f"{self.cfg.decode_url}/v1/completions",
                          conv.body(list(prompt), 1, {"kvturn": {"conversation": key}}),
                          timeout=conv.timeout)
        _retained_block_size(reply, key)

    def warm(self, prompt: Sequence[int]) -> None:
        conv = self._conversation("", False)
        post_json(f"{self.cfg.prefill_url}/v1/completions", conv.body(list(prompt), 1, None),
                  timeout=conv.timeout)

    def release(self, key: str) -> None:
        control(self.cfg.decode_control_url, "DELETE", retention_path(key))

    def snapshot(self) -> Snapshot:
        p, d = scrape(self.cfg.prefill_url), scrape(self.cfg.decode_url)
        return Snapshot(_running(p) + _running(d) == 0, sources(p), sources(d))


def _retained_block_size(reply: dict[str, Any], key: str) -> int:
    info = (reply.get("kv_transfer_params") or {}).get("kvturn") or {}
    if not info.get("retained"):
        raise RuntimeError(f"the decode did not retain {key!r} (retention off or over budget?); "
                           "the benchmark's modes need it")
    return int(info["block_size"])


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
        samples.loadavg["start"] = list(_loadavg())
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
        samples.loadavg["end"] = list(_loadavg())
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


def _loadavg() -> tuple[float, ...]:
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        return ()


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
    write_json(config, rows, json_path)
    device = "GPU" if settings.gpu else "CPU"
    if write_plot(rows, plot_path, f"kvturn bench reuse ({device}, {settings.size} model)"):
        say(f"wrote {json_path} and {plot_path}")
    else:
        say(f"wrote {json_path}; no plot: matplotlib is not installed (extra [bench])")
    return rows


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"comma-separated integers expected, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("at least one value is needed")
    return values


def settings_from_args(args: argparse.Namespace) -> ReuseBenchSettings:
    sizes = tuple(sorted(set(args.sizes)))
    generated_sizes: tuple[int, ...] | None
    if args.generated_sizes is None:
        generated_sizes = (sizes[0],)
    elif args.generated_sizes.strip() == "all":
        generated_sizes = None
    else:
        generated_sizes = _ints(args.generated_sizes)
    return ReuseBenchSettings(
        sizes=sizes, generated=tuple(sorted(set(args.generated))),
        generated_sizes=generated_sizes, runs=args.runs, warmup_runs=args.warmup_runs,
        settle_s=args.settle, seed=args.seed, state_dir=args.state_dir,
        decode_steps_while_pinned=args.decode_steps_while_pinned, size=args.size,
        gpu=args.gpu, vllm_args=tuple(args.vllm_arg or ()))


def cmd_bench_reuse(args: argparse.Namespace) -> int:
    from kvturn_server.local import free_port

    try:
        settings = settings_from_args(args)
        settings.check(bench_config(settings.state_dir, {}, size=settings.size).max_model_len)
    except (ValueError, argparse.ArgumentTypeError) as error:
        raise SystemExit(f"kvturn bench reuse: {error}") from None
    ports = {name: free_port() for name in (
        "prefill_port", "decode_port", "prefill_control_port", "decode_control_port",
        "prefill_side_channel_port", "decode_side_channel_port")}
    run_reuse_bench(settings, args.json, args.plot or args.json.with_suffix(".png"), ports)
    return 0


def add_reuse_bench_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``reuse`` to ``kvturn bench``'s subcommands (sets ``func``)."""
    d = ReuseBenchSettings()
    p: argparse.ArgumentParser = bench_subparsers.add_parser(
        "reuse", help="next-turn TTFT: recompute, reuse from the decode, the floor (KV already "
                      "in the prefill), vLLM's default prefix cache, and kvturn on top of it",
        description="On the bench model, prefix cache on everywhere: the next turn's TTFT "
                    "(a) recomputed, (b) reading the history from the decode into a cold "
                    "prefill, (c) the floor: the prefill already holds the history, (d) stock "
                    "P/D: the prefill holds the previous prompt and computes the generated "
                    "tokens, (e) kvturn on stock: the prefill holds the previous prompt and "
                    "reads the generated tokens from the decode. p50 and p10/p90 over --runs "
                    "runs in rotated order after equal idle time; a mode below the floor "
                    "beyond the spread is flagged as a measurement error. The default run "
                    "takes about 20 minutes on a 2-core machine; 16384 in --sizes adds about "
                    "10 minutes, --generated-sizes all about 9 per size.")
    p.add_argument("--json", type=Path, required=True, help="where to write the results")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG path (default: the JSON path with .png)")
    p.add_argument("--sizes", type=_ints, default=d.sizes, metavar="N,N,...",
                   help="previous-turn prompt sizes in tokens (default: 2048,4096,8192; the "
                        "stack fits up to 30000)")
    p.add_argument("--generated", type=_ints, default=d.generated, metavar="N,N,...",
                   help="tokens the previous turn generated (default: 0,512,2048)")
    p.add_argument("--generated-sizes", default=None, metavar="N,N,...|all",
                   help="sizes measured at every --generated count; the other sizes only at "
                        "the smallest count (default: the smallest size; 'all': every size)")
    p.add_argument("--runs", type=int, default=d.runs,
                   help="runs per row, each a fresh conversation per mode (default: "
                        "%(default)s)")
    p.add_argument("--warmup-runs", type=int, default=d.warmup_runs,
                   help="unrecorded runs before the first row (default: %(default)s)")
    p.add_argument("--settle", type=float, default=d.settle_s,
                   help="seconds both instances stay idle before every timed request; keep "
                        "it above vLLM's 1 s busy loop after a step (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the prompts' token ids (default: %(default)s)")
    p.add_argument("--state-dir", type=Path, default=d.state_dir,
                   help="model, logs and state of the benchmark stack (default: %(default)s)")
    p.add_argument("--decode-steps-while-pinned", action="store_true",
                   help="run the decode without NIXL's progress thread, so that its engine "
                        "steps while a pin is held (the behaviour before the thread was the "
                        "default; for before/after comparisons)")
    p.add_argument("--size", choices=sorted(SIZES), default=d.size,
                   help="locally built model to serve (default: %(default)s; 8b: a real 8B "
                        "model's shape with random weights, for GPUs)")
    p.add_argument("--gpu", action="store_true",
                   help="run on a GPU: KV in its memory (vLLM's default) instead of the CPU "
                        "build's host buffer")
    p.add_argument("--vllm-arg", action="append", default=None, metavar="FLAG",
                   help="another vllm serve flag for both instances, as one argument "
                        "(repeatable), e.g. --vllm-arg=--gpu-memory-utilization=0.4")
    p.set_defaults(func=cmd_bench_reuse)
    return p

