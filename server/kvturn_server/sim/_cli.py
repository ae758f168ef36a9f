"""``kvturn simulate``: the fleet simulator's command line."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvturn_server._cli_common import add_output_args, int_range, number_list, plot_path, write_json
from kvturn_server._defaults import RETENTION_BUDGET, RETENTION_TTL
from kvturn_server._settings import add_alias
from kvturn_server.sim._config import (
    HOST_GIB,
    PROFILES,
    FleetSpec,
    RouterSpec,
    SimSettings,
    standard_policies,
)
from kvturn_server.sim._report import compare, describe, plot, sweep, sweep_table, table
from kvturn_server.sim._traces import load_conversations, replicate
from kvturn_server.sim._workload import WorkloadSpec, synthetic

_floats = number_list(float, empty=True)


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``simulate`` to ``kvturn``'s subcommands (sets ``func``)."""
    w, f = WorkloadSpec(), FleetSpec()
    names = ", ".join(standard_policies())
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate", help="simulate a fleet of prefills and decodes serving many agents, "
                         "running kvturn's own retention, reuse and placement code",
        description="A discrete-event simulation of N prefills and M decodes serving agent "
                    "conversations (drawn from production tool-gap quantiles, or read from "
                    "--trace). The decodes run the connector's own retention table, the "
                    "prefills its verified-reuse and cost decision, the router its turn planner "
                    "(route, pin, reuse value), the stock baselines' included. Compares "
                    "policies on the same conversations (" + names
                    + "), sweeps kvturn's lease over --sweep-budgets x --sweep-ttls, prints "
                    "Markdown tables and writes JSON and a PNG. See docs/simulate.md.")
    g = p.add_argument_group("workload")
    g.add_argument("--conversations", type=int, default=w.conversations,
                   help="synthetic conversations (default: %(default)s)")
    g.add_argument("--window", type=float, default=w.window_s,
                   help="seconds over which conversations start, uniformly (default: "
                        "%(default)s)")
    g.add_argument("--turns", type=int_range, default=w.turns, metavar="MIN,MAX",
                   help="turns per conversation (default: %(default)s)")
    g.add_argument("--system-tokens", type=int, default=w.system_tokens,
                   help="system prompt tokens (default: %(default)s)")
    g.add_argument("--own-system", action="store_true",
                   help="every conversation has its own system prompt (default: one shared "
                        "system prompt, as one agent product sends)")
    g.add_argument("--message-tokens", type=int_range, default=w.message_tokens, metavar="MIN,MAX",
                   help="tokens of each turn's new message (default: %(default)s)")
    g.add_argument("--reply-tokens", type=int_range, default=w.reply_tokens, metavar="MIN,MAX",
                   help="tokens of each reply (default: %(default)s)")
    g.add_argument("--gap-p50", type=float, default=w.gap_p50_s,
                   help="tool gap median, seconds (default: %(default)s)")
    g.add_argument("--gap-p90", type=float, default=w.gap_p90_s,
                   help="tool gap p90, seconds (default: %(default)s)")
    g.add_argument("--gap-cap", type=float, default=w.gap_cap_s,
                   help="longest tool gap, seconds: the traces' p99 (default: %(default)s)")
    g.add_argument("--trace", type=Path, action="append", default=None, metavar="PATH",
                   help="replay conversations from this file or directory instead, at full "
                        "scale (repeatable): agent traces (the shared Claude Code JSON, "
                        "kvturn's request JSONL; subagents as conversations of their own, the "
                        "trace's prompts, blocks, replies and gaps), kvturn's conversation "
                        "JSONL, or vLLM benchmarks/multi_turn / ShareGPT JSON (docs/simulate.md)")
    g.add_argument("--trace-copies", type=int, default=1, metavar="K",
                   help="replay K copies of the traces, each its own users (no shared "
                        "blocks), copy k starting k x --trace-shift later: a realistic load "
                        "from a few sessions (default: %(default)s)")
    g.add_argument("--trace-shift", type=float, default=60.0, metavar="SECONDS",
                   help="start of each copy after the one before (default: %(default)s)")
    g.add_argument("--seed", type=int, default=w.seed, help="default: %(default)s")
    g = p.add_argument_group("fleet")
    g.add_argument("--prefills", type=int, default=f.prefills, help="default: %(default)s")
    g.add_argument("--decodes", type=int, default=f.decodes, help="default: %(default)s")
    g.add_argument("--memory-gib", type=float, default=None,
                   help="accelerator memory per instance, GiB (default: the profile's: "
                        f"{f.memory_gib:g} for one H200)")
    g.add_argument("--memory-utilization", type=float, default=f.memory_utilization,
                   help="vLLM's gpu_memory_utilization (default: %(default)s)")
    g.add_argument("--weights-gib", type=float, default=f.weights_gib,
                   help="model weights per instance (default: %(default)s, Qwen3-32B bf16)")
    g.add_argument("--kv-bytes-per-token", type=int, default=f.kv_bytes_per_token,
                   help="layers x KV heads x head size x 2 x dtype bytes (default: "
                        "%(default)s, Qwen3-32B bf16)")
    g.add_argument("--block-size", type=int, default=f.block_size,
                   help="tokens per KV block (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=f.max_num_seqs,
                   help="requests one decode runs at once (default: %(default)s)")
    g.add_argument("--profile", choices=sorted(PROFILES), default=SimSettings().cost.name,
                   help="the cost model's numbers: a roofline of Qwen3-32B on one H200 or two "
                        "H100s (tensor parallel), or this machine's fit (docs/simulate.md; "
                        "default: %(default)s)")
    g = p.add_argument_group("policies and outputs")
    g.add_argument("--policies", default=",".join(standard_policies()), metavar="NAME,...",
                   help=f"which to compare, of {names} (default: all)")
    # The names of the same settings elsewhere: the connector's retention_budget (kvturn up
    # --retention-budget), the router's and kvturn up's --retention-ttl, kvturn up's
    # --kv-offload-gib. The former names still work, with a warning.
    g.add_argument("--retention-budget", type=float, default=RETENTION_BUDGET,
                   help="retention budget of kvturn-lease, kvturn-host and lru-budget, a "
                        "fraction of each decode's KV (default: %(default)s; formerly "
                        "--budget, still read)")
    add_alias(g, "--budget", "--retention-budget", "retention_budget", float)
    g.add_argument("--kv-offload-gib", type=float, default=HOST_GIB, metavar="GIB",
                   help="the host KV tier of the offload policies and kvturn-host on every "
                        "instance, GiB (vLLM's CPU offloading, read back over PCIe; default: "
                        "%(default)s; formerly --host-gib, still read)")
    add_alias(g, "--host-gib", "--kv-offload-gib", "kv_offload_gib", float)
    g.add_argument("--retention-ttl", type=float, default=RETENTION_TTL, metavar="SECONDS",
                   help="the lease of kvturn-lease and kvturn-host (the connector's "
                        "decoder_kv_blocks_ttl); clients renew every eighth of it (default: "
                        "%(default)s; formerly --lease-ttl, still read)")
    add_alias(g, "--lease-ttl", "--retention-ttl", "retention_ttl", float)
    router = RouterSpec()
    g.add_argument("--decode-continue-tokens", type=int, default=router.decode_continue_tokens,
                   metavar="N", help="the router's decode_continue_tokens for the policies "
                                     "that retain (kvturn's and the other lease policies; "
                                     "default: the router's, %(default)s)")
    g.add_argument("--decode-continue-budget", type=int, default=router.decode_continue_budget,
                   metavar="N", help="the router's decode_continue_budget for the policies "
                                     "that retain (default: the router's, %(default)s)")
    g.add_argument("--decode-continue-host-tokens", type=int,
                   default=router.decode_continue_host_tokens, metavar="N",
                   help="the router's decode_continue_host_tokens for the policies that retain: "
                        "a longer turn whose retention its decode keeps in the host tier alone "
                        "(kvturn-host) continues there when it lacks at most N tokens, else a "
                        "prefill recomputes it; 0: never (default: the router's, %(default)s)")
    g.add_argument("--sweep-budgets", type=_floats, default=(0.1, 0.25, 0.5, 1.0),
                   metavar="B,...", help="budgets of the sweep; empty: no sweep "
                                         "(default: 0.1,0.25,0.5,1)")
    ttls = (60.0, RETENTION_TTL, 1800.0)
    g.add_argument("--sweep-ttls", type=_floats, default=ttls, metavar="S,...",
                   help="lease lengths of the sweep (default: "
                        f"{','.join(f'{t:g}' for t in ttls)})")
    g.add_argument("--sweep-conversations", type=int, default=5000,
                   help="the sweep runs the first this many conversations by start time (the "
                        "same arrival rate, a shorter window) to stay quick (default: "
                        "%(default)s)")
    g.add_argument("--ttft-slo", type=float, default=2.0,
                   help="TTFT a turn must meet to count in goodput, seconds (default: "
                        "%(default)s)")
    add_output_args(g, json_default=Path("simulate.json"))
    g.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_simulate)
    return p


def cmd_simulate(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        workload = WorkloadSpec(
            conversations=args.conversations, window_s=args.window, turns=args.turns,
            system_tokens=args.system_tokens, shared_system=not args.own_system,
            message_tokens=args.message_tokens, reply_tokens=args.reply_tokens,
            gap_p50_s=args.gap_p50, gap_p90_s=args.gap_p90, gap_cap_s=args.gap_cap,
            seed=args.seed)
        profile = PROFILES[args.profile]
        memory = args.memory_gib if args.memory_gib is not None else (
            profile.memory_gib or FleetSpec().memory_gib)
        fleet = FleetSpec(prefills=args.prefills, decodes=args.decodes,
                          memory_gib=memory,
                          memory_utilization=args.memory_utilization,
                          weights_gib=args.weights_gib,
                          kv_bytes_per_token=args.kv_bytes_per_token,
                          block_size=args.block_size, max_num_seqs=args.max_num_seqs)
        if min(args.decode_continue_tokens, args.decode_continue_budget,
               args.decode_continue_host_tokens) < 0:
            raise ValueError("--decode-continue-tokens, --decode-continue-budget and "
                             "--decode-continue-host-tokens must be 0 or more")
        known = standard_policies(budget=args.retention_budget, ttl_s=args.retention_ttl,
                                  host_gib=args.kv_offload_gib)
        wanted = [n for n in args.policies.split(",") if n]
        unknown = [n for n in wanted if n not in known]
        if unknown or not wanted:
            raise ValueError(f"unknown policies {unknown}; choose from {', '.join(known)}")
        conversations = replicate(
            load_conversations(args.trace, block_size=fleet.block_size, window_s=args.window,
                               gaps=workload.gaps, seed=args.seed),
            args.trace_copies, args.trace_shift) if args.trace else synthetic(workload)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"kvturn simulate: {exc}\n")
        return 2
    base = SimSettings(fleet=fleet, cost=profile, ttft_slo_s=args.ttft_slo,
                       router=RouterSpec(
                           decode_continue_tokens=args.decode_continue_tokens,
                           decode_continue_budget=args.decode_continue_budget,
                           decode_continue_host_tokens=args.decode_continue_host_tokens))
    progress = None if args.quiet else sys.stderr
    turns = sum(c.turns for c in conversations)
    if progress is not None:
        print(f"[simulate] {len(conversations):,} conversations, {turns:,} turns; "
              f"{fleet.prefills} prefills + {fleet.decodes} decodes, "
              f"{fleet.decode_capacity:,} blocks of {fleet.block_size} tokens each",
              file=progress, flush=True)
    results, recorders = compare(base, conversations, [known[n] for n in wanted],
                                 progress=progress)
    rows = sweep(replace(base), conversations[:args.sweep_conversations], args.sweep_budgets,
                 args.sweep_ttls, progress=progress) if args.sweep_budgets else []
    wall = round(time.monotonic() - started, 1)
    data = {"benchmark": "kvturn simulate", "config": {
        **describe(base), "workload": None if args.trace else {
            **workload.__dict__, "gaps": workload.gaps.describe()},
        "trace": None if not args.trace else [str(p) for p in args.trace],
        "trace_copies": args.trace_copies if args.trace else None,
        "trace_shift_s": args.trace_shift if args.trace else None,
        "conversations": len(conversations), "turns": turns,
        "sweep_conversations": min(args.sweep_conversations, len(conversations))},
        "policies": results, "sweep": rows, "wall_s": wall}
    write_json(data, args.json, indent=1)
    plot_file = plot_path(args.json, args.plot)
    plotted = plot(plot_file, results, recorders, rows)
    out = sys.stdout
    out.write(table(results) + "\n")
    if rows:
        out.write("\n" + sweep_table(rows) + "\n")
    runs = f"{len(wanted)} polic{'y' if len(wanted) == 1 else 'ies'}" + (
        f" + {len(rows)} sweep runs" if rows else "")
    out.write(f"\n{len(conversations):,} conversations, {turns:,} turns, {runs} in {wall:.0f} s; "
              f"JSON {args.json}{f', plot {plot_file}' if plotted else ''}\n")
    return 0
