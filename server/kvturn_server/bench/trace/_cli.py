"""``kvturn bench trace``'s command line: its parser and the settings it builds."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

from kvturn_server._cli_common import (
    add_device_args,
    add_output_args,
    comma_choices,
    settings_or_exit,
)
from kvturn_server._defaults import KEEPALIVES_PER_TTL, RETENTION_TTL
from kvturn_server.bench._cli import add_host_tier_arg
from kvturn_server.bench.trace._plan import MODE_TABLE, MODES, REAL_KV_TOKENS, TraceBenchSettings
from kvturn_server.bench.trace._run import load_plan, run_trace_bench
from kvturn_server.bench.trace._scale import Scaling


def _positive_or_none(kind: type[int] | type[float]) -> Any:
    """A number, 0 meaning none (no cap)."""
    def parse(text: str) -> int | float | None:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        return None if value == 0 else value
    return parse


def settings_from_args(args: argparse.Namespace) -> TraceBenchSettings:
    scaling = Scaling(token_divisor=args.token_divisor, time_scale=args.time_scale,
                      max_gap_s=args.max_gap, stagger_s=args.stagger,
                      max_requests=args.max_requests, conversations=args.conversations)
    return TraceBenchSettings(
        traces=tuple(args.traces), modes=args.modes, repeats=args.repeats, scaling=scaling,
        scale_thresholds=args.scale_thresholds, real_kv_tokens=args.real_kv_tokens,
        prefills=args.prefills, decodes=args.decodes, seed=args.seed, size=args.size,
        state_dir=args.state_dir, kv_cache_gib=args.kv_cache_gib,
        retention_ttl_s=args.retention_ttl, extra_router_args=tuple(args.router_arg or ()),
        gpu=args.gpu, vllm_args=tuple(args.vllm_arg or ()), warmup=args.warmup,
        host_tier_multiple=args.host_tier, json_path=args.json, plot_path=args.plot)


def cmd_bench_trace(args: argparse.Namespace) -> int:
    def checked() -> TraceBenchSettings:
        settings = settings_from_args(args)
        load_plan(settings)  # the traces read and fit the model's context
        return settings

    settings = settings_or_exit("bench trace", checked)
    # Flushed: a run takes many minutes and is often followed in a log file.
    run_trace_bench(settings, say=functools.partial(print, flush=True))
    return 0


def add_trace_bench_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``trace`` to ``kvturn bench``'s subcommands (sets ``func``)."""
    from kvturn_server.local import SIZES

    d = TraceBenchSettings()
    s = d.scaling
    modes = "; ".join(f"{m.name}: {m.stands_for} (router "
                      f"{' '.join(m.router_args) or 'with no flags'}, client {m.client}, "
                      f"{m.profile} instances{'' if m.by_default else ', on request'})"
                      for m in MODE_TABLE)
    p: argparse.ArgumentParser = bench_subparsers.add_parser(
        "trace", help="replay recorded agent traces (Claude Code) on 1 prefill + 1 decode, "
                      "every routing mode side by side",
        description="Read agent traces (the shared Claude Code JSON, or kvturn's request "
                    "JSONL: see kvturn_server.traces), scale them to this machine by stated "
                    "factors (tokens divided by --token-divisor, gaps capped at --max-gap "
                    "trace seconds and multiplied by --time-scale, the first --max-requests "
                    "requests of each conversation), keeping their structure: shared prefixes "
                    "(text from the hash ids), compaction (the prompt cut where the ids part, "
                    "then new text), subagents as conversations of their own, the real "
                    "previous reply sent back in the next prompt, and the traces' own timing. "
                    "Each instance's KV holds --real-kv-tokens scaled like the prompts (a 32B "
                    "model's 256 KiB per token on an H200: about 270k tokens, two or three "
                    "100k-token conversations), so neither the prefill nor the decode holds "
                    "every live conversation. Then replays them in every mode on the same "
                    "instances (modes on other instance profiles on instances of their own, "
                    "kept up beside: offload, vLLM's CPU KV offloading beside the kvturn "
                    "connector with a host tier of --host-tier times each instance's device "
                    "KV), each through a router of its own, --repeats times with the "
                    "order rotated and fresh words. Modes: " + modes + ". Prints the "
                    "configuration (factors, instances, KV sizing, host), per mode TTFT "
                    "p50/p90/p99 of all and of later turns, inter-token latency p50/p99, "
                    "prompt tokens computed (every instance), tokens moved from decodes, "
                    "tokens loaded from a host tier, retained memory, turns/s and errors "
                    "(median and range over repeats), and each kvturn mode against the "
                    "strongest stock mode (the lowest pooled TTFT p50 of later turns) per "
                    "repeat and pooled with 95 % bootstrap intervals, and against every stock "
                    "mode pooled; writes JSON and a PNG. With the defaults the nine shared "
                    "traces take 1.3-1.7 minutes a run on a 2-core machine: about 16 minutes "
                    "in all for three modes, about 21 for the four default ones.")
    p.add_argument("traces", nargs="+", type=Path, metavar="TRACE",
                   help="trace files (.json: the shared agent-trace format; .jsonl: kvturn's "
                        "request lines) or folders of them, e.g. ../shared/traces/claude-code")
    add_output_args(p)
    p.add_argument("--modes", type=comma_choices(MODES, "modes"), default=d.modes,
                   metavar="MODE,...",
                   help=f"which modes, of {', '.join(MODES)}, in this order for the first "
                        f"repeat; later repeats rotate it (default: {','.join(d.modes)})")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="rounds of every mode (default: %(default)s)")
    p.add_argument("--token-divisor", type=float, default=s.token_divisor,
                   help="trace tokens per replayed token: prompts, replies, shared prefixes, "
                        "the routers' thresholds and the deployment's KV are divided by it; "
                        "the default makes the traces' 100k-token contexts 4k and fits the "
                        "longest of the shared traces (198k tokens) in the tiny model's 8,192 "
                        "positions with the chat template's framing (default: %(default)s)")
    p.add_argument("--time-scale", type=float, default=s.time_scale,
                   help="factor on the traces' gaps (after --max-gap) and on the "
                        f"{RETENTION_TTL:g} s lease (default: %(default)s)")
    p.add_argument("--max-gap", type=_positive_or_none(float), default=s.max_gap_s,
                   help="cap on a gap in trace seconds, before scaling; 0: none. Above the "
                        f"{RETENTION_TTL:g} s lease, so the traces' long pauses still outlast "
                        "it (default: %(default)s)")
    p.add_argument("--max-requests", type=_positive_or_none(int), default=s.max_requests,
                   help="replay each conversation's first N requests; 0: all "
                        "(default: %(default)s)")
    p.add_argument("--conversations", type=_positive_or_none(int), default=s.conversations,
                   help="replay the first N conversations, subagents counted; 0: all "
                        "(default: all)")
    p.add_argument("--stagger", type=float, default=s.stagger_s,
                   help="seconds between two sessions' starts (the traces record none; a "
                        "subagent starts at its parent's time) (default: %(default)s)")
    p.add_argument("--real-kv-tokens", type=int, default=REAL_KV_TOKENS,
                   help="the KV one instance of the real deployment holds, in tokens; each "
                        "instance gets it divided by --token-divisor (default: %(default)s)")
    p.add_argument("--scale-thresholds", action=argparse.BooleanOptionalAction,
                   default=d.scale_thresholds,
                   help="divide the routers' token thresholds (--conditional-disagg, "
                        "--decode-continue-tokens, --decode-continue-budget, "
                        "--decode-continue-host-tokens) by "
                        "--token-divisor, so that the same follow-ups fall under them as in "
                        "the traces (default: on)")
    p.add_argument("--prefills", type=int, default=d.prefills,
                   help="prefill instances (default: %(default)s)")
    p.add_argument("--decodes", type=int, default=d.decodes,
                   help="decode instances (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the words (default: %(default)s)")
    p.add_argument("--size", choices=sorted(SIZES), default=d.size,
                   help="model (default: %(default)s)")
    p.add_argument("--state-dir", type=Path, default=d.state_dir,
                   help="model, logs and state of the instances (default: %(default)s)")
    p.add_argument("--kv-cache-gib", type=float, default=d.kv_cache_gib,
                   help="vLLM's KV buffer per instance in GiB, before the block count caps "
                        "it (default: %(default)s)")
    p.add_argument("--retention-ttl", type=float, default=None,
                   help=f"the decodes' lease in seconds (default: {RETENTION_TTL:g} x "
                        f"--time-scale); the SDK renews every 1/{KEEPALIVES_PER_TTL} of it "
                        "during a gap")
    p.add_argument("--router-arg", action="append", default=None, metavar="ARG",
                   help="one more `kvturn router` argument for every mode's router "
                        "(repeatable), e.g. --router-arg=--log-level=debug")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=d.warmup,
                   help="a warm-up conversation before the first run (default: on)")
    add_host_tier_arg(p, d.host_tier_multiple)
    add_device_args(p, instances="every instance", example="--gpu-memory-utilization=0.28")
    p.set_defaults(func=cmd_bench_trace)
    return p
