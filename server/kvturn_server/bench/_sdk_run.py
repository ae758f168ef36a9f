"""``kvturn bench sdk``: rounds of ``_sdk``'s measurement, each in a fresh process; the table,
the JSON and the command line."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import openai

import kvturn
from kvturn_server.bench._sdk import (
    TARGET_US,
    TURNS,
    ModeResult,
    RoundResult,
    Spread,
    aggregate,
    measure_round,
    round_from_json,
)

# A round of 3000 calls a mode takes about 80 s on the dev host.
DEFAULT_ROUNDS = 3


def _round_in_child(calls: int) -> RoundResult:
    """One round in a fresh interpreter: its own memory layout, nothing left from the last."""
    done = subprocess.run([sys.executable, "-m", "kvturn_server.bench._sdk", str(calls)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"a bench sdk round failed (exit {done.returncode}):\n"
                           f"{done.stderr.strip()[-2000:]}")
    return round_from_json(json.loads(done.stdout))


def run_sdk_bench(calls: int, json_path: Path, say: Callable[[str], None] = print, *,
                  rounds: int = DEFAULT_ROUNDS) -> dict[str, Any]:
    """Measure ``calls`` turns per mode in each of ``rounds`` rounds (one round runs in this
    process, more each in their own), print a table, write ``json_path``; return the data."""
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    # Both clients run the same openai code, so a busy machine inflates the difference too;
    # the load is recorded next to the numbers.
    load_before = os.getloadavg()
    measured = []
    for number in range(1, rounds + 1):
        if rounds > 1:
            say(f"round {number}/{rounds}: {calls} calls per mode ...")
            measured.append(_round_in_child(calls))
        else:
            measured.append(measure_round(calls))
    results, spreads = aggregate(measured)
    worst = max(r.overhead_us for r in results)
    data: dict[str, Any] = {
        "calls_per_mode": calls, "rounds": rounds, "turns_per_conversation": TURNS,
        "target_us": TARGET_US, "python": platform.python_version(),
        "openai": openai.__version__, "kvturn": kvturn.__version__,
        "machine": {"cpus": os.cpu_count(), "load_average_before": list(load_before),
                    "load_average_after": list(os.getloadavg())},
        "modes": [asdict(r) for r in results],
        "spread": [asdict(s) for s in spreads],
        "max_overhead_us": worst, "within_target": worst <= TARGET_US}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    say(_table(results, spreads))
    say(f"max overhead {worst:.1f} us per call (median of {rounds} round(s); target <= "
        f"{TARGET_US:.0f} us); wrote {json_path}")
    return data


def _table(results: list[ModeResult], spreads: list[Spread]) -> str:
    header = (f"{'client':<7} {'stream':<7} {'openai us':>10} {'kvturn us':>10} "
              f"{'overhead us':>12} {'rounds':>14} {'p25..p75':>14} {'%':>6} {'own us':>8} "
              f"{'bytecodes':>10}")
    rows = [f"{r.mode:<7} {'yes' if r.stream else 'no':<7} {r.plain_us:>10.1f} "
            f"{r.kvturn_us:>10.1f} {r.overhead_us:>12.1f} "
            f"{f'{min(s.rounds_us):.1f}..{max(s.rounds_us):.1f}':>14} "
            f"{f'{s.overhead_p25_us:.1f}..{s.overhead_p75_us:.1f}':>14} "
            f"{r.overhead_pct:>6.2f} {r.own_us:>8.1f} {r.extra_bytecodes:>+10d}"
            for r, s in zip(results, spreads, strict=True)]
    return "\n".join([header, *rows])


def _cmd_sdk_bench(args: argparse.Namespace) -> int:
    run_sdk_bench(args.calls, args.json, rounds=args.rounds)
    return 0


def add_sdk_bench_parser(subparsers: Any) -> None:
    """Register ``sdk`` on the ``kvturn bench`` subparsers (``func`` runs it, returns 0)."""
    sdk = subparsers.add_parser(
        "sdk", help="per-call overhead of the kvturn SDK vs the plain openai client",
        description="Times chat turns through a scoped kvturn client and through the plain "
                    "openai client over the same in-process mock transport (sync and async, "
                    "streaming and not) and reports the per-call overhead (the median over "
                    "rounds, each in a fresh process, of the median of paired differences; "
                    "each round's value; the quartiles of all pairs; target <= "
                    f"{TARGET_US:.0f} us), as a share of openai's call, and the extra bytecode "
                    "instructions a kvturn call executes (a count that does not drift with "
                    "the host's speed). No servers, no network.")
    sdk.add_argument("--calls", type=int, default=3000,
                     help="measured calls per client, mode and round (default: %(default)s)")
    sdk.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                     help="rounds, each in a fresh process; 1 runs in this one "
                          "(default: %(default)s)")
    sdk.add_argument("--json", type=Path, default=Path(".kvturn/bench/sdk.json"),
                     help="where to write the results (default: %(default)s)")
    sdk.set_defaults(func=_cmd_sdk_bench)
