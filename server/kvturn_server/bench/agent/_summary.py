"""What ``kvturn bench agent`` measured, summarized: each mode's summary per repeat, the
medians and spreads over the repeats, the off/on comparison with its verdict, and the JSON
document (``build_results``); the table is in ``_report``, the plot in ``_plot``.

Computed prompt tokens are counted on both instances (``vllm:prompt_tokens_by_source_total``,
source ``local_compute``): the prefill's, the decode's, and their sum, which the comparison
uses. In plain P/D the decode computes only the prompt tokens it could not read from the
prefill (none, or a last partial token); where the router lets the decode continue a turn
itself (``X-KVTurn-Route: decode``), the decode computes that turn's new tokens, and a
comparison of the prefill's count alone would flatter kvturn.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from kvturn_server.bench._host import host_info
from kvturn_server.bench._stats import (
    MIB,
    at_path,
    bootstrap_ratio,
    cdf_points,
    distribution,
    median_tree,
    percentile,
    ratio,
    spread,
    turn_summary,
)
from kvturn_server.bench.agent._records import ModeRun, TurnRecord
from kvturn_server.bench.agent._workload import (
    DECODES,
    MODES,
    ORDER_RATIONALE,
    PREFILLS,
    AgentBenchSettings,
    agent_shape,
    build_scripts,
)
from kvturn_server.local._metrics import PromptSources

# The bar for the decode's inter-token latency with kvturn on: p99 within 10 % of off.
ITL_P99_TOLERANCE = 1.10
# The ratios that must all be >= 1.0 in every repeat for "kvturn was never slower".
NEVER_SLOWER = ("ttft_ms_p50_off_over_on", "ttft_ms_p90_off_over_on",
                "ttft_ms_p99_off_over_on", "ttft_ms_turn2plus_p50_off_over_on")
DIRECTION = (
    "X_off_over_on = off / on: above 1 kvturn is faster (latencies) or computes less (tokens); "
    "X_on_over_off = on / off (turns per second: above 1 kvturn serves more; ITL p99: the "
    f"target is <= {ITL_P99_TOLERANCE:.2f}); the top-level values are medians over the "
    "repeats, spread and per_repeat give every repeat's")
MODES_NOTE = (
    "every number of a mode is the median over the repeats (counts missing from a repeat "
    "count 0 there); turns_ok_total and errors_total are sums; spread gives min, median and "
    "max of the headline figures; itl_ms_pooled pools every gap of every repeat; repeats[] "
    "has each repeat's own summaries")
ITL_NOTE = (
    "inter-token latency as the client sees it through the router: the gaps between "
    "consecutive content chunks of a streamed reply after the first, as vLLM's own serving "
    "benchmark counts them; vLLM streams one token per chunk, but after a stall the client "
    "can receive several tokens in one chunk (content_chunks below completion_tokens shows "
    "it), which hides the stall's tokens behind one long gap; tpot_ms (per turn: first to "
    "last content chunk over completion_tokens - 1) does not depend on the chunking")


# One mode of one repeat.

def _delta(after: PromptSources | None, before: PromptSources | None) -> dict[str, float] | None:
    if after is None or before is None:
        return None
    d = after - before
    return {"computed": d.computed, "local_cache": d.local_cache, "transferred": d.transferred}


def _sum(*values: float | None) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def summarize(run: ModeRun, planned_turns: int) -> dict[str, Any]:
    ok = [r for r in run.records if r.ok]
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    retained = [s.retained_bytes / MIB for s in run.samples if s.retained_bytes is not None]
    outcomes = Counter(r.reuse or "unreported" for r in ok)
    gaps = [g for r in ok for g in r.itl_gaps_ms]
    by_route: dict[str, list[float]] = {}
    for r in ok:
        if r.route is not None and r.ttft_ms is not None:
            by_route.setdefault(r.route, []).append(r.ttft_ms)
    prefill = _delta(run.prefill_after, run.prefill_before)
    decode = _delta(run.decode_after, run.decode_before)
    prefill_computed = None if prefill is None else prefill["computed"]
    decode_computed = None if decode is None else decode["computed"]
    return {
        "mode": run.mode,
        "repeat": run.repeat,
        "agents": len(run.agents),
        "turns_planned": planned_turns,
        **turn_summary(run.records, run.wall_s),
        "ttft_ms_by_route": {k: distribution(v) for k, v in sorted(by_route.items())},
        "total_ms": distribution([r.total_ms for r in ok if r.total_ms is not None]),
        "itl_ms": distribution(gaps),
        "itl_ms_turn_mean": distribution(
            [statistics.fmean(r.itl_gaps_ms) for r in ok if r.itl_gaps_ms]),
        "tpot_ms": distribution([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "prompt_tokens": {"total": sum(prompts), "mean": round(statistics.fmean(prompts), 1)
                          if prompts else None, "max": max(prompts) if prompts else None},
        "completion_tokens": sum(r.completion_tokens or 0 for r in ok),
        "completion_tokens_requested": sum(r.max_tokens or 0 for r in ok),
        "replies_short": sum(1 for r in ok if r.completion_tokens is not None
                             and r.max_tokens is not None and r.completion_tokens < r.max_tokens),
        "finish_reasons": dict(sorted(Counter(r.finish_reason or "unreported"
                                              for r in ok).items())),
        "content_chunks": sum(r.content_chunks for r in ok),
        "prefill_computed_tokens": prefill_computed,
        "decode_computed_tokens": decode_computed,
        "computed_tokens": _sum(prefill_computed, decode_computed),
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "reuse": {"outcomes": dict(sorted(outcomes.items())),
                  "reused_tokens": sum(r.reused_tokens for r in ok)},
        "routes": dict(sorted(Counter(r.route or "unreported" for r in ok).items())),
        "prefill_choices": dict(sorted(Counter(
            r.prefill_choice or "unreported" for r in ok
            if r.prefill_choice is not None or r.route in (None, "prefill")).items())),
        "retained_mib": {
            "max": round(max(retained), 3) if retained else None,
            "mean": round(statistics.fmean(retained), 3) if retained else None,
            "samples": len(retained)},
        "load_average": {"before": list(run.load_before), "after": list(run.load_after)},
    }


def compare(summaries: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """One repeat's ratios (see ``DIRECTION``); None unless both modes ran."""
    if "off" not in summaries or "on" not in summaries:
        return None
    off, on = summaries["off"], summaries["on"]
    out: dict[str, Any] = {}
    for key in ("ttft_ms", "ttft_ms_turn1", "ttft_ms_turn2plus", "itl_ms"):
        for q in ("p50", "p90", "p99"):
            out[f"{key}_{q}_off_over_on"] = ratio(off[key][q], on[key][q])
    out["itl_ms_p99_on_over_off"] = ratio(on["itl_ms"]["p99"], off["itl_ms"]["p99"])
    out["tpot_ms_p50_on_over_off"] = ratio(on["tpot_ms"]["p50"], off["tpot_ms"]["p50"])
    out["prefill_computed_off_over_on"] = ratio(off["prefill_computed_tokens"],
                                                 on["prefill_computed_tokens"])
    out["computed_off_over_on"] = ratio(off["computed_tokens"], on["computed_tokens"])
    out["turns_per_s_on_over_off"] = ratio(on["turns_per_s"], off["turns_per_s"])
    return out


# Over the repeats.

HEADLINE: dict[str, tuple[str, ...]] = {
    "ttft_ms_p50": ("ttft_ms", "p50"), "ttft_ms_p90": ("ttft_ms", "p90"),
    "ttft_ms_p99": ("ttft_ms", "p99"), "ttft_ms_turn2plus_p50": ("ttft_ms_turn2plus", "p50"),
    "itl_ms_p50": ("itl_ms", "p50"), "itl_ms_p90": ("itl_ms", "p90"),
    "itl_ms_p99": ("itl_ms", "p99"), "tpot_ms_p50": ("tpot_ms", "p50"),
    "prefill_computed_tokens": ("prefill_computed_tokens",),
    "decode_computed_tokens": ("decode_computed_tokens",),
    "computed_tokens": ("computed_tokens",), "turns_per_s": ("turns_per_s",),
    "retained_mib_max": ("retained_mib", "max"),
}


def aggregate_mode(runs: Sequence[ModeRun], summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One mode over its repeats (``MODES_NOTE``)."""
    merged = median_tree([{k: v for k, v in s.items() if k != "repeat"} for s in summaries])
    gaps = [g for run in runs for r in run.records if r.ok for g in r.itl_gaps_ms]
    return {**merged,
            "repeats": len(summaries),
            "turns_ok_total": sum(s["turns_ok"] for s in summaries),
            "errors_total": sum(s["errors"] for s in summaries),
            "itl_ms_pooled": {**distribution(gaps), "cdf_pct": cdf_points(gaps)},
            "spread": {name: spread([at_path(s, path) for s in summaries])
                       for name, path in HEADLINE.items()}}


def verdict(per_repeat: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Was kvturn never slower (every ``NEVER_SLOWER`` ratio >= 1.0 in every repeat), did it
    never compute more (prefill + decode), and did the ITL p99 stay within 10 % of off?
    None where a ratio was not measured."""
    slower = [{"ratio": key, "repeat": row["repeat"], "value": row[key]}
              for row in per_repeat for key in NEVER_SLOWER
              if row.get(key) is not None and row[key] < 1.0]
    measured = all(row.get(key) is not None for row in per_repeat for key in NEVER_SLOWER)
    computed = [row.get("computed_off_over_on") for row in per_repeat]
    prefill = [row.get("prefill_computed_off_over_on") for row in per_repeat]
    itl = [row.get("itl_ms_p99_on_over_off") for row in per_repeat]

    def every(values: Sequence[float | None], ok: Any) -> bool | None:
        return None if not values or any(v is None for v in values) else all(
            ok(v) for v in values)

    return {
        "never_slower": (not slower) if measured and per_repeat else None,
        "never_slower_checks": list(NEVER_SLOWER),
        "slower": slower,
        "computed_never_more": every(computed, lambda v: v >= 1.0),
        "prefill_computed_never_more": every(prefill, lambda v: v >= 1.0),
        "itl_p99_on_over_off_max": max((v for v in itl if v is not None), default=None),
        "itl_p99_within_10pct": every(itl, lambda v: v <= ITL_P99_TOLERANCE),
    }


POOLED_NOTE = (
    "every repeat's turns of a mode pooled (repeats x agents x turns a mode), the off/on ratio "
    "of each quantile with a 95 % percentile-bootstrap interval (2,000 rounds, seeded); "
    "turn1 = first turns: a new conversation has nothing to reuse, so they are the same work "
    "in both modes and differ only by what else the host runs meanwhile")
POOLED_SCOPES: dict[str, Callable[[TurnRecord], bool]] = {
    "all": lambda r: True, "turn1": lambda r: r.turn == 1, "turn2plus": lambda r: r.turn > 1}


def pooled_comparison(runs: Sequence[ModeRun]) -> dict[str, Any] | None:
    """The off/on TTFT ratios over every repeat's turns pooled (``POOLED_NOTE``)."""
    ttft: dict[str, dict[str, list[float]]] = {}
    for mode in ("off", "on"):
        ttft[mode] = {scope: [r.ttft_ms for run in runs if run.mode == mode
                              for r in run.records
                              if r.ok and r.ttft_ms is not None and keep(r)]
                      for scope, keep in POOLED_SCOPES.items()}
    if not ttft["off"]["all"] or not ttft["on"]["all"]:
        return None
    out: dict[str, Any] = {"note": POOLED_NOTE,
                           "turns": {m: len(ttft[m]["all"]) for m in ("off", "on")}}
    for scope in POOLED_SCOPES:
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            off, on = ttft["off"][scope], ttft["on"][scope]
            low, high = bootstrap_ratio(off, on, q)
            out[f"ttft_ms_{scope}_{name}_off_over_on"] = {
                "ratio": ratio(percentile(off, q), percentile(on, q)), "low": low,
                "high": high}
    return out


def tail_makeup(runs: Sequence[ModeRun], q: float) -> dict[int, dict[str, int]]:
    """Per repeat, the on mode's turns at or above its own TTFT quantile ``q``: how many, and
    how many of them are first turns (which kvturn cannot speed up: nothing to reuse)."""
    out: dict[int, dict[str, int]] = {}
    for run in runs:
        if run.mode != "on":
            continue
        ok = [r for r in run.records if r.ok and r.ttft_ms is not None]
        cut = percentile([r.ttft_ms for r in ok if r.ttft_ms is not None], q)
        if cut is None:
            continue
        tail = [r for r in ok if r.ttft_ms is not None and r.ttft_ms >= cut]
        out[run.repeat] = {"turns": len(tail), "first_turns": sum(r.turn == 1 for r in tail)}
    return out


def aggregate_comparison(per_repeat: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The ratios over the repeats: medians at the top (the one-run JSON's keys), their
    spread, every repeat's, and the verdict."""
    if not per_repeat:
        return None
    keys = [k for k in per_repeat[0] if k not in ("repeat", "order")]
    spreads = {k: spread([row.get(k) for row in per_repeat]) for k in keys}
    return {**{k: spreads[k]["median"] for k in keys},
            "direction": DIRECTION,
            "spread": spreads,
            "per_repeat": list(per_repeat),
            "verdict": verdict(per_repeat)}


def configuration(settings: AgentBenchSettings, machine: dict[str, Any],
                  orders: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Which configuration ran, as every figure of it must say."""
    return {"prefill_prefix_cache": settings.prefill_prefix_cache,
            "decode_prefix_cache": True,
            "prefills": PREFILLS, "decodes": DECODES, "router": True,
            "model": settings.size, "agents": settings.agents, "turns": settings.turns,
            "system_tokens": settings.system_tokens,
            "message_tokens": list(settings.message_tokens),
            "reply": settings.reply_description(), "repeats": settings.repeats,
            "orders": [list(o) for o in orders],
            "cpu_model": machine.get("cpu_model"), "amx": machine.get("amx"),
            "cpus": machine.get("cpus")}


def build_results(settings: AgentBenchSettings, runs: Sequence[ModeRun],
                  extra: dict[str, Any] | None = None,
                  machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document: configuration, settings, seed, gaps, per-mode summaries over the
    repeats and per repeat, the comparison, every record and sample."""
    planned = settings.agents * settings.turns
    machine = host_info() if machine is None else machine
    by_repeat: dict[int, list[ModeRun]] = {}
    for run in runs:
        by_repeat.setdefault(run.repeat, []).append(run)
    repeats: list[dict[str, Any]] = []
    for repeat, group in sorted(by_repeat.items()):
        summaries = {run.mode: summarize(run, planned) for run in group}
        cmp = compare(summaries)
        order = [run.mode for run in group]
        repeats.append({"repeat": repeat, "order": order, "modes": summaries,
                        "comparison": None if cmp is None else {
                            "repeat": repeat, "order": order, **cmp}})
    modes_seen = [m for m in (*settings.modes, *MODES) if any(r.mode == m for r in runs)]
    modes = {mode: aggregate_mode([r for r in runs if r.mode == mode],
                                  [rep["modes"][mode] for rep in repeats
                                   if mode in rep["modes"]])
             for mode in dict.fromkeys(modes_seen)}
    gaps = settings.gaps
    shapes = {agent: agent_shape(settings, agent) for agent in range(settings.agents)}
    drawn = {script.agent: list(script.gaps_s) for script in build_scripts(settings, MODES[0])}
    all_gaps = [g for agent in drawn.values() for g in agent]
    return {
        "benchmark": "agent",
        "seed": settings.seed,
        "configuration": configuration(settings, machine, [rep["order"] for rep in repeats]),
        "settings": settings.describe(),
        "order": [run.mode for run in runs],
        "order_rationale": ORDER_RATIONALE,
        "gaps": {**gaps.describe(),
                 "drawn_s": {str(agent): [round(g, 4) for g in values]
                             for agent, values in drawn.items()},
                 "drawn_quantiles_s": distribution(all_gaps)},
        "replies": {**settings.reply_description(),
                    "drawn_max_tokens": {str(agent): list(shape[2])
                                         for agent, shape in shapes.items()}},
        "machine": machine,
        "itl_note": ITL_NOTE,
        **(extra or {}),
        "modes_note": MODES_NOTE,
        "modes": modes,
        "comparison": _with_pooled(aggregate_comparison(
            [rep["comparison"] for rep in repeats if rep["comparison"] is not None]), runs),
        "repeats": repeats,
        "agents": [asdict(a) for run in runs for a in run.agents],
        "turns": [r.to_json() for run in runs for r in run.records],
        "samples": [asdict(s) for run in runs for s in run.samples],
    }


def _with_pooled(cmp: dict[str, Any] | None, runs: Sequence[ModeRun]) -> dict[str, Any] | None:
    if cmp is None:
        return None
    pooled = pooled_comparison(runs)
    checks = [f"ttft_ms_all_{q}_off_over_on" for q in ("p50", "p90", "p99")] + [
        "ttft_ms_turn2plus_p50_off_over_on"]
    values = [None if pooled is None else pooled[k]["ratio"] for k in checks]
    pooled_ok = None if any(v is None for v in values) else all(
        v is not None and v >= 1.0 for v in values)
    return {**cmp, "verdict": {**cmp["verdict"], "pooled_never_slower": pooled_ok},
            "pooled": pooled,
            "on_tail_makeup": {"p90": {str(k): v for k, v in tail_makeup(runs, 0.9).items()},
                               "p99": {str(k): v for k, v in tail_makeup(runs, 0.99).items()}}}


