"""``kvturn bench trace``'s numbers: per run (``kvturn bench fleet``'s run summary), per mode
over the repeats (median, min-max, every repeat's), the comparison of each kvturn mode with the
strongest stock mode (``STRONGEST_RULE``, the one rule of every agent benchmark: per repeat,
and over every repeat's turns pooled with bootstrap intervals) and with every stock mode that
ran (pooled), and the results document. Statistics only from ``bench/_stats.py``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from kvturn_server.bench._fleet_agents import FleetTurn, ModeRun
from kvturn_server.bench._fleet_report import summarize as summarize_run
from kvturn_server.bench._stats import (
    STRONGEST_RULE,
    at_path,
    bootstrap_ratio,
    percentile,
    ratio,
    spread,
    strongest,
)
from kvturn_server.bench.trace._plan import MODE_TABLE, STOCK_MODES, TraceBenchSettings
from kvturn_server.bench.trace._scale import ReplayPlan
from kvturn_server.traces import summarize as summarize_traces

ORDER_RATIONALE = (
    "modes run one after the other on the same instances, each through a router of its own "
    "started for that run: every instance's prompt-token counters and the decodes' retained "
    "bytes are instance-wide, so a mode is measured by them only while it has the instances to "
    "itself; every repeat replays the same plan (sizes, gaps, starts, reply lengths) with other "
    "words, so no KV cached in one run serves another; repeat r starts with the r-th mode, so "
    "the order rotates; before each run the decodes' retentions drain and the machine settles")
TURNS_NOTE = (
    "turn = the request's position in its conversation, 1-based (turn 1: a conversation's first "
    "request, nothing to reuse); later = turns 2+; computed = prompt tokens computed "
    "(vllm:prompt_tokens_by_source_total, source local_compute) summed over every instance; "
    "moved = prompt tokens the prefills read from a decode (kvturn:reused_tokens_total); "
    "transferred = prompt tokens the decodes received from a prefill (source "
    "external_kv_transfer; on the offload instances it counts host-tier loads too); host = "
    "prompt tokens vLLM's CPU offloading loaded from a host tier, every instance "
    "(vllm:prompt_tokens_cached_by_source_total, source host)")

# Per mode over the repeats: name -> path in a run summary.
METRICS: dict[str, tuple[str, ...]] = {
    "ttft_p50_ms": ("ttft_ms", "p50"), "ttft_p90_ms": ("ttft_ms", "p90"),
    "ttft_p99_ms": ("ttft_ms", "p99"),
    "ttft_later_p50_ms": ("ttft_ms_turn2plus", "p50"),
    "ttft_later_p90_ms": ("ttft_ms_turn2plus", "p90"),
    "ttft_later_p99_ms": ("ttft_ms_turn2plus", "p99"),
    "itl_p50_ms": ("itl_ms", "p50"), "itl_p99_ms": ("itl_ms", "p99"),
    "computed_tokens": ("computed_tokens", "total"),
    "moved_tokens": ("reused_tokens", "prefill_metric"),
    "transferred_tokens": ("transferred_total",),
    "host_tokens": ("host_tokens", "total"),
    "retained_mib_max": ("retained_mib", "max"), "retained_mib_mean": ("retained_mib", "mean"),
    "turns_per_s": ("turns_per_s",), "errors": ("errors",),
}
HIGHER_IS_BETTER = frozenset({"turns_per_s"})
# What the comparison states per repeat (the rest are reported, not compared).
COMPARED = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_later_p50_ms",
            "ttft_later_p90_ms", "ttft_later_p99_ms", "itl_p50_ms", "itl_p99_ms",
            "computed_tokens", "turns_per_s")
POOLED_NOTE = (
    "every repeat's turns of a mode pooled; ratio = the stock mode's / the kvturn mode's (above "
    "1: kvturn is faster), with a 95 % percentile-bootstrap interval (2,000 rounds, seeded; "
    "repeats resampled, then the turns of each: the spread between repeats counts); "
    "pooled: against the strongest stock mode, by_stock_mode: against each")
# What ``by_stock_mode`` states against every stock mode, pooled: with intervals (the issues'
# targets are on later turns), and without.
EVERY_STOCK_INTERVALS = (("ttft_later_p50", "ttft_later", 0.5), ("ttft_later_p90", "ttft_later",
                                                                 0.9))
EVERY_STOCK_RATIOS = (("ttft_all_p50", "ttft_all", 0.5), ("ttft_later_p99", "ttft_later", 0.99),
                      ("itl_p99", "itl", 0.99))


def run_summary(run: ModeRun) -> dict[str, Any]:
    """One run's numbers: the fleet bench's run summary, and the tokens the decodes received
    from prefills in all."""
    out = summarize_run(run)
    got = [v for v in out["transferred_tokens"].values() if v is not None]
    out["transferred_total"] = sum(got) if got else None
    return out


def aggregate(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per mode (in the mode table's order): every metric's spread over the repeats."""
    out: dict[str, Any] = {}
    for mode in (m.name for m in MODE_TABLE):
        mine = sorted((s for s in summaries if s["mode"] == mode), key=lambda s: s["repeat"])
        if mine:
            out[mode] = {"repeats": len(mine), "turns_ok": sum(s["turns_ok"] for s in mine),
                         "errors_total": sum(s["errors"] for s in mine),
                         **{name: spread([at_path(s, path) for s in mine])
                            for name, path in METRICS.items()}}
    return out


def _better(name: str, stock: float | None, mine: float | None) -> float | None:
    """Above 1: ``mine`` is better than the stock mode's value."""
    return ratio(mine, stock) if name in HIGHER_IS_BETTER else ratio(stock, mine)


def _ttfts(runs: Sequence[ModeRun], mode: str, later: bool) -> list[float]:
    return [r.ttft_ms for run in runs if run.mode == mode for r in run.records
            if r.ok and r.ttft_ms is not None and (r.turn > 1 or not later)]


def _samples(runs: Sequence[ModeRun],
             modes: Sequence[str]) -> dict[str, dict[str, list[list[float]]]]:
    """Per scope (TTFT of all turns, of later turns, ITL gaps) and mode, each repeat's values
    (every mode the same repeats, in order: the intervals resample repeats, then values)."""
    repeats = sorted({run.repeat for run in runs})

    def by_repeat(mode: str, values: Callable[[ModeRun], list[float]]) -> list[list[float]]:
        return [[v for run in runs if run.mode == mode and run.repeat == repeat
                 for v in values(run)] for repeat in repeats]

    return {"ttft_all": {m: by_repeat(m, lambda run: _ttfts([run], run.mode, False))
                         for m in modes},
            "ttft_later": {m: by_repeat(m, lambda run: _ttfts([run], run.mode, True))
                           for m in modes},
            "itl": {m: by_repeat(m, lambda run: list(run.itl_ms)) for m in modes}}


def _flat(by_repeat: Sequence[Sequence[float]]) -> list[float]:
    return [v for values in by_repeat for v in values]


def _interval(samples: dict[str, list[list[float]]], base: str, mode: str,
              q: float) -> dict[str, Any] | None:
    theirs, mine = percentile(_flat(samples[base]), q), percentile(_flat(samples[mode]), q)
    if theirs is None or mine is None:
        return None
    low, high = bootstrap_ratio(samples[base], samples[mode], q)
    return {"stock": base, "stock_ms": theirs, "ms": mine, "ratio": ratio(theirs, mine),
            "low": low, "high": high}


def pooled(runs: Sequence[ModeRun], mode: str, base: str) -> dict[str, Any]:
    """``mode`` against the stock mode ``base``, every repeat's turns pooled: TTFT of all turns
    and of later turns at p50/p90/p99, ITL over every gap at p50/p99, with intervals."""
    samples = _samples(runs, (base, mode))
    out: dict[str, Any] = {"note": POOLED_NOTE}
    for scope, by_mode in samples.items():
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            if scope == "itl" and name == "p90":
                continue
            out[f"{scope}_{name}"] = _interval(by_mode, base, mode, q)
    return out


def every_stock(runs: Sequence[ModeRun], mode: str, stock: Sequence[str]) -> dict[str, Any]:
    """``mode`` against each stock mode, pooled: later-turn TTFT p50 and p90 with intervals,
    TTFT p50 of all turns, later p99 and ITL p99 as ratios."""
    samples = _samples(runs, (*stock, mode))
    out: dict[str, Any] = {}
    for base in stock:
        entry: dict[str, Any] = {
            key: _interval(samples[scope], base, mode, q)
            for key, scope, q in EVERY_STOCK_INTERVALS}
        entry.update({key: ratio(percentile(_flat(samples[scope][base]), q),
                                 percentile(_flat(samples[scope][mode]), q))
                      for key, scope, q in EVERY_STOCK_RATIOS})
        out[base] = entry
    return out


def compare(modes: dict[str, Any], summaries: Sequence[dict[str, Any]],
            runs: Sequence[ModeRun]) -> dict[str, Any] | None:
    """Each kvturn mode against the strongest stock mode (``STRONGEST_RULE``): from the
    medians over repeats, per repeat (that repeat's run of the strongest) with its spread, and
    pooled with intervals; and against every stock mode that ran, pooled."""
    stock = [m for m in STOCK_MODES if m in modes]
    mine = [m.name for m in MODE_TABLE if m.kvturn and m.name in modes]
    if not stock or not mine:
        return None
    base, later_p50 = strongest({m: _ttfts(runs, m, True) for m in stock})
    base = base or stock[0]
    out: dict[str, Any] = {
        "stock_modes": stock, "strongest_stock": base, "strongest_by": STRONGEST_RULE,
        "stock_ttft_later_p50_ms": later_p50, "direction": (
            "strongest stock / kvturn for latencies and tokens (above 1: kvturn is better), "
            "kvturn / strongest stock for turns per second")}
    repeats = sorted({s["repeat"] for s in summaries})
    for k in mine:
        cmp: dict[str, Any] = {}
        for name in COMPARED:
            per_repeat = []
            for repeat in repeats:
                here = {s["mode"]: at_path(s, METRICS[name]) for s in summaries
                        if s["repeat"] == repeat}
                value = _better(name, here.get(base), here.get(k))
                if value is not None:
                    per_repeat.append(value)
            cmp[name] = {"ratio": _better(name, modes[base][name]["median"],
                                          modes[k][name]["median"]),
                         "per_repeat": spread(per_repeat)}
        cmp["pooled"] = pooled(runs, k, base)
        cmp["by_stock_mode"] = every_stock(runs, k, stock)
        out[k] = cmp
    return out


def plan_check(runs: Sequence[ModeRun], plan: ReplayPlan) -> dict[str, Any]:
    """Per mode, the turns whose prompt (vLLM's own count, ``usage``) differs from the plan's:
    the replay sends the sizes it states only where there are none."""
    out: dict[str, Any] = {}
    for run in runs:
        entry = out.setdefault(run.mode, {"turns": 0, "off_plan": 0, "max_abs_diff": 0})
        for r in run.records:
            if not r.ok or r.prompt_tokens is None:
                continue
            planned = plan.conversations[r.agent].requests[r.turn - 1].planned_tokens
            entry["turns"] += 1
            if r.prompt_tokens != planned:
                entry["off_plan"] += 1
                entry["max_abs_diff"] = max(entry["max_abs_diff"], abs(r.prompt_tokens - planned))
    return out


def _turn(record: FleetTurn, plan: ReplayPlan) -> dict[str, Any]:
    conversation = plan.conversations[record.agent]
    request = conversation.requests[record.turn - 1]
    return {**asdict(record), "conversation": conversation.cid,
            "trace_request": request.trace.index, "target_tokens": request.target_tokens,
            "planned_tokens": request.planned_tokens, "cut": request.cut is not None}


def describe_plan(plan: ReplayPlan) -> dict[str, Any]:
    """What the replay sends, per conversation, and the traces' own summary."""
    from kvturn_server.bench._stats import quantile

    traces = summarize_traces([c.trace for c in plan.conversations])
    return {
        "scaling": plan.scaling.describe(),
        "requests": plan.requests,
        "left_out": plan.left_out,
        "trace_summary": traces.describe(quantile),
        "conversations": [{
            "agent": agent, "cid": c.cid, "source": c.trace.source, "parent": c.trace.parent,
            "start_s": round(c.start_s, 3), "requests": len(c.requests),
            "system_words": c.system_words,
            "target_tokens": [r.target_tokens for r in c.requests],
            "planned_tokens": [r.planned_tokens for r in c.requests],
            "reply_tokens": [r.reply_tokens for r in c.requests],
            "gaps_s": [round(r.gap_s, 3) for r in c.requests[1:]],
            "cuts": [None if r.cut is None else asdict(r.cut) for r in c.requests]}
            for agent, c in enumerate(plan.conversations)],
    }


def build_results(settings: TraceBenchSettings, plan: ReplayPlan, runs: Sequence[ModeRun],
                  kv: dict[str, Any], machine: dict[str, Any],
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document: settings and factors, the mode table, the KV sizing, the plan, per
    run and per mode numbers, the comparison, every turn and sample."""
    summaries = [run_summary(r) for r in runs]
    modes = aggregate(summaries)
    return {
        "benchmark": "trace",
        "seed": settings.seed,
        "settings": settings.describe(),
        "mode_table": [m.describe(settings.router_args(m.name)) for m in MODE_TABLE
                       if m.name in settings.modes],
        "order_rationale": ORDER_RATIONALE,
        "turns_note": TURNS_NOTE,
        "machine": machine,
        "kv": kv,
        "plan": describe_plan(plan),
        **(extra or {}),
        "modes": modes,
        "comparison": compare(modes, summaries, runs),
        "plan_check": plan_check(runs, plan),
        "runs": summaries,
        "agents": [{"mode": r.mode, "repeat": r.repeat, **asdict(a)} for r in runs
                   for a in r.agents],
        "turns": [_turn(t, plan) for r in runs for t in r.records],
        "samples": [{"mode": r.mode, "repeat": r.repeat, "t_s": s.t_s,
                     "retained_bytes": s.retained_bytes} for r in runs for s in r.samples],
    }
