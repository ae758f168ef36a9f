"""``kvturn bench reuse``'s command line: its parser and the settings it builds."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvturn_server._cli_common import (
    add_device_args,
    add_output_args,
    number_list,
    plot_path,
    settings_or_exit,
)
from kvturn_server.bench._reuse import ReuseBenchSettings, bench_config, run_reuse_bench
from kvturn_server.local import SIZES

_ints = number_list(int)


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

    def checked() -> ReuseBenchSettings:
        settings = settings_from_args(args)
        settings.check(bench_config(settings.state_dir, {}, size=settings.size).max_model_len)
        return settings

    settings = settings_or_exit("bench reuse", checked)
    ports = {name: free_port() for name in (
        "prefill_port", "decode_port", "prefill_control_port", "decode_control_port",
        "prefill_side_channel_port", "decode_side_channel_port")}
    run_reuse_bench(settings, args.json, plot_path(args.json, args.plot), ports)
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
    add_output_args(p)
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
    add_device_args(p, instances="both instances", example="--gpu-memory-utilization=0.4")
    p.set_defaults(func=cmd_bench_reuse)
    return p

