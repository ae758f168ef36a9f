"""Policies compared on one trace, the budget x lease sweep, and what is printed and plotted."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TextIO

from kvturn_server import _plot
from kvturn_server.sim._config import Policy, SimSettings, standard_policies
from kvturn_server.sim._engine import simulate
from kvturn_server.sim._metrics import GAP_BUCKETS, Recorder
from kvturn_server.sim._workload import Conversation


def compare(base: SimSettings, conversations: list[Conversation], policies: Sequence[Policy],
            *, progress: TextIO | None = None) -> tuple[dict[str, Any], dict[str, Recorder]]:
    """Run every policy on the same conversations: (the JSON's ``policies``, the recorders)."""
    out: dict[str, Any] = {}
    recorders: dict[str, Recorder] = {}
    for policy in policies:
        started = time.monotonic()
        recorder = simulate(replace(base, policy=policy), conversations, progress=progress)
        summary = recorder.summary()
        summary["wall_s"] = round(time.monotonic() - started, 1)
        out[policy.name] = summary
        recorders[policy.name] = recorder
        if progress is not None:
            print(f"[simulate] {policy.name}: {recorder.turns:,} turns in "
                  f"{summary['wall_s']:.0f} s wall", file=progress, flush=True)
    return out, recorders


def sweep(base: SimSettings, conversations: list[Conversation], budgets: Sequence[float],
          ttls: Sequence[float], *, progress: TextIO | None = None) -> list[dict[str, Any]]:
    """kvturn's lease at every retention budget x lease length: one row each."""
    rows = []
    for budget in budgets:
        for ttl in ttls:
            policy = standard_policies(budget=budget, ttl_s=ttl)["kvturn-lease"]
            s = simulate(replace(base, policy=policy), conversations).summary()
            rows.append({"budget": budget, "ttl_s": ttl, "hit_rate": s["hit_rate"],
                         "computed_tokens": s["computed_tokens"],
                         "retained_gib_mean": s["retained_gib"]["mean"],
                         "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
                         "goodput_turns_per_s": s["goodput_turns_per_s"]})
            if progress is not None:
                print(f"[simulate] sweep budget {budget:g} lease {ttl:g} s: hit rate "
                      f"{s['hit_rate']}", file=progress, flush=True)
    return rows


def table(results: dict[str, Any]) -> str:
    """The policy comparison as a Markdown table: reuse by tool gap, tokens computed, TTFT of
    all turns and of later turns, and the GiB holding KV (mean over the run, all instances):
    retained under a lease, in decodes' prefix caches, in host tiers."""
    head = ("| policy | hit rate | " + " | ".join(f"hit {name}" for name, _ in GAP_BUCKETS)
            + " | computed Mtok | recomputed Mtok | TTFT p50 / p90 / p99 s"
            " | later turns TTFT p50 / p90 / p99 s | retained / cached / host GiB"
            " | goodput turns/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, s in results.items():
        gaps = " | ".join(_pct(s["hit_rate_by_gap"][b]["hit_rate"]) for b, _ in GAP_BUCKETS)
        t, later = s["ttft_s"], s["ttft_later_s"]
        lines.append(
            f"| {name} | {_pct(s['hit_rate'])} | {gaps} | {s['computed_tokens'] / 1e6:.1f} | "
            f"{s['recomputed_tokens'] / 1e6:.1f} | "
            f"{_num(t['p50'])} / {_num(t['p90'])} / {_num(t['p99'])} | "
            f"{_num(later['p50'])} / {_num(later['p90'])} / {_num(later['p99'])} | "
            f"{s['retained_gib']['mean']:.0f} / {s['prefix_cached_gib']['mean']:.0f} / "
            f"{s['host_gib']['mean']:.0f} | {_num(s['goodput_turns_per_s'])} |")
    return "\n".join(lines)


def sweep_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| budget | lease s | hit rate | computed Mtok | retained GiB mean | TTFT p99 s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['budget']:g} | {r['ttl_s']:g} | {_pct(r['hit_rate'])} | "
                     f"{r['computed_tokens'] / 1e6:.1f} | {r['retained_gib_mean']:.0f} | "
                     f"{_num(r['ttft_p99_s'])} |")
    return "\n".join(lines)


def plot(path: Path, results: dict[str, Any], recorders: dict[str, Recorder],
         rows: list[dict[str, Any]]) -> bool:
    """Hit rate by gap, retained memory over time, TTFT CDF, the sweep; False without
    matplotlib."""
    plt = _plot.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    names = list(results)
    ax = axes[0][0]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        rates = [results[name]["hit_rate_by_gap"][b]["hit_rate"] or 0.0 for b, _ in GAP_BUCKETS]
        ax.bar([x + i * width for x in range(len(GAP_BUCKETS))], rates, width, label=name)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(GAP_BUCKETS))],
                  [b for b, _ in GAP_BUCKETS])
    ax.set_xlabel("tool gap before the turn")
    ax.set_ylabel("reuse hit rate")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    for name, recorder in recorders.items():
        ax.plot([t / 60 for t, _ in recorder.memory], [g for _, g in recorder.memory],
                label=name)
    ax.set_xlabel("simulated minutes")
    ax.set_ylabel("GiB held by retention (all decodes)")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    for name, recorder in recorders.items():
        values = sorted(recorder.ttfts)
        if values:
            step = max(1, len(values) // 2000)
            xs = values[::step]
            ax.plot(xs, [(i * step + 1) / len(values) for i in range(len(xs))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of turns")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    for ttl in sorted({r["ttl_s"] for r in rows}):
        pts = [r for r in rows if r["ttl_s"] == ttl]
        ax.plot([r["budget"] for r in pts], [r["hit_rate"] or 0.0 for r in pts], marker="o",
                label=f"lease {ttl:g} s")
    ax.set_xlabel("retention budget (fraction of decode KV)")
    ax.set_ylabel("hit rate (kvturn lease)")
    if rows:
        ax.legend(fontsize=8)
    _plot.save(plt, fig, path)
    return True


def describe(base: SimSettings) -> dict[str, Any]:
    fleet = base.fleet
    return {"fleet": {**asdict(fleet), "prefill_blocks_each": fleet.prefill_capacity,
                      "decode_blocks_each": fleet.decode_capacity},
            "cost": asdict(base.cost), "router": asdict(base.router),
            "ttft_slo_s": base.ttft_slo_s}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
