"""``kvturn bench agent``'s command line: its parser and the settings it builds."""

from __future__ import annotations

import argparse
from typing import Any

from kvturn_server._cli_common import comma_choices, int_range, settings_or_exit
from kvturn_server.bench._cli import add_agents_args, add_host_tier_arg
from kvturn_server.bench.agent._modes import MODE_TABLE, MODES
from kvturn_server.bench.agent._run import run_agent_bench
from kvturn_server.bench.agent._workload import (
    PROFILE_TEXT,
    PROFILES,
    AgentBenchSettings,
)


def settings_from_args(args: argparse.Namespace) -> AgentBenchSettings:
    return AgentBenchSettings(
        agents=args.agents, turns=args.turns, time_scale=args.time_scale, seed=args.seed,
        json_path=args.json, plot_path=args.plot, size=args.size, state_dir=args.state_dir,
        modes=args.modes, stagger_s=args.stagger, system_tokens=args.system_tokens,
        message_tokens=args.message_tokens, max_tokens=args.max_tokens, profile=args.profile,
        long_reply_tokens=args.long_reply_tokens, repeats=args.repeats,
        gap_cap_s=args.max_gap if args.max_gap > 0 else None,
        retention_ttl_s=args.retention_ttl, prefill_prefix_cache=args.prefill_prefix_cache,
        kv_cache_gib=args.kv_cache_gib, decode_blocks=args.decode_blocks,
        router_args=tuple(args.router_arg or ()), host_tier_multiple=args.host_tier)


def cmd_bench_agent(args: argparse.Namespace) -> int:
    from kvturn_server.local import SIZES

    def checked() -> AgentBenchSettings:
        settings = settings_from_args(args)
        settings.check_fits(SIZES[settings.size].max_positions)
        return settings

    run_agent_bench(settings_or_exit("bench agent", checked))
    return 0


def add_agent_bench_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``agent`` to ``kvturn bench``'s subcommands (sets ``func``)."""

    d = AgentBenchSettings()
    modes = "; ".join(
        f"'{m.name}'" + ("" if m.label == m.name else f" ({m.label})") + f": {m.stands_for} "
        f"(router {' '.join(m.router_args) or 'with its defaults'}; client {m.client}; "
        f"{m.profile} instances)" for m in MODE_TABLE)
    p: argparse.ArgumentParser = bench_subparsers.add_parser(
        "agent", help="concurrent tool-using agents: TTFT, inter-token latency, prompt tokens "
                      "computed and retained memory, kvturn against stock P/D and stock "
                      "conditional disaggregation",
        description="Start 1 prefill + 1 decode (prefix caching on both, as vLLM ships it) "
                    "per instance profile the modes use (plain: the kvturn connector alone; "
                    "offload: beside vLLM's CPU KV offloading, a host tier of --host-tier "
                    "times each instance's device KV; both pairs stay up side by side, one "
                    "busy at a time), then run N concurrent agents of M turns each (growing "
                    "conversations, tool gaps drawn from a log-normal fitted to production "
                    "agent traces, scaled by --time-scale) in each mode, each run through a "
                    "router of its own started with the mode's flags on its profile's "
                    "instances. Modes: " + modes + ". --repeats "
                    "times, the order of the modes rotated each repeat (off,stock-cond,on / "
                    "stock-cond,on,off / ...), the same scripts in every run with new words. "
                    "Prints the configuration (prefix cache, instances, decode KV blocks, "
                    "reply profile, host CPU and AMX), then per mode the medians over the "
                    "repeats and their spread of TTFT p50/p90/p99 and turns 2+ p50, "
                    "inter-token latency p50/p99 (and time per output token), prompt tokens "
                    "computed by the prefill, by the decode and their sum, turns per second, "
                    "the decode's retained memory, the routers' per-turn reports, and the "
                    "later turns run on the decode alone: how many found their history in "
                    "its cache and what they computed (vLLM's per-request cached tokens); "
                    "then kvturn ('on') against every stock mode that ran: the ratios of "
                    "every repeat, pooled ratios with bootstrap intervals and whether kvturn "
                    "was never slower, headlined against the strongest stock mode (lowest "
                    "pooled TTFT p50 of turns 2+); the same for kvturn-offload. Prompt tokens "
                    "the offload instances loaded from their host tier are counted from "
                    "vLLM's metrics (host). Writes every turn and sample as JSON and a "
                    "PNG plot. The default run (3 modes, 3 repeats) takes about 10 minutes on "
                    "a 2-core machine; --profile long several times that. The three standard "
                    "scenarios: the defaults (a roomy decode, 64-token replies), --max-tokens "
                    "256, and --decode-blocks 320 --agents 16 (a decode short of KV); add "
                    "--modes off,stock-cond,stock-cond-offload,on,kvturn-offload for the host "
                    "tier.")
    add_agents_args(p, d, seeded="the gaps and the generated text",
                    state="model, logs and state of the benchmark stack")
    p.add_argument("--turns", type=int, default=d.turns,
                   help="turns per agent (default: %(default)s)")
    p.add_argument("--modes", type=comma_choices(MODES, "modes"), default=d.modes,
                   metavar="MODE,...",
                   help=f"which modes to run, of {', '.join(MODES)}, in this order in the "
                        f"first repeat; later repeats rotate it (default: {','.join(d.modes)})")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="how many times to run the modes, order rotated each time; the table "
                        "reports medians and min-max over them (default: %(default)s)")
    p.add_argument("--system-tokens", type=int, default=d.system_tokens,
                   help="system prompt length (default: %(default)s)")
    p.add_argument("--message-tokens", type=int_range, default=d.message_tokens,
                   metavar="MIN,MAX",
                   help="size of each turn's new user/tool message (default: 100,300)")
    p.add_argument("--profile", choices=PROFILES, default=d.profile,
                   help="reply profile: " + "; ".join(f"{k}: {v}" for k, v in
                                                      PROFILE_TEXT.items())
                        + " (default: %(default)s). The local models never end a reply "
                          "early (their LM head only picks words), so replies are as long as "
                          "asked. Six long turns may not fit the tiny model's 8k context: "
                          "add --turns 5")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="every reply's length in the tool profile (default: %(default)s)")
    p.add_argument("--long-reply-tokens", type=int_range, default=d.long_reply_tokens,
                   metavar="MIN,MAX",
                   help="the range each reply's length is drawn from in the long profile "
                        "(default: 300,1000)")
    p.add_argument("--max-gap", type=float, default=d.gap_cap_s,
                   help="cap on a tool gap in trace seconds, before scaling; 0: none "
                        "(default: %(default)s, the traces' p99)")
    p.add_argument("--prefill-prefix-cache", action=argparse.BooleanOptionalAction,
                   default=d.prefill_prefix_cache,
                   help="the prefill's own prefix cache: on by default, as vLLM ships it and "
                        "users run it; --no-prefill-prefix-cache stands for a prefill pool "
                        "where a conversation's next turn does not find its prefix locally")
    p.add_argument("--kv-cache-gib", type=float, default=d.kv_cache_gib,
                   help="KV cache per vLLM instance in GiB (default: %(default)s)")
    p.add_argument("--decode-blocks", type=int, default=None, metavar="N",
                   help="the decode's KV blocks (vLLM --num-gpu-blocks-override; 128 tokens "
                        "each on CPU): a decode short of KV for the active conversations, "
                        "e.g. 320 with --agents 16 (default: what --kv-cache-gib gives)")
    add_host_tier_arg(p, d.host_tier_multiple)
    p.add_argument("--router-arg", action="append", default=None, metavar="ARG",
                   help="one more `kvturn router` argument for every mode's router (and the "
                        "warm-up's), after the mode's own flags (repeatable), e.g. "
                        "--router-arg=--log-level=debug")
    p.set_defaults(func=cmd_bench_agent)
    return p

