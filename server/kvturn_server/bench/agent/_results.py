"""What ``kvturn bench agent`` reports in the end: the headline, each kvturn mode against the
strongest stock mode that ran with issue 25's targets, and the JSON document
(``build_results``) that holds it with every summary, comparison, record and sample.

Apart from ``_summary`` (one mode's summary per repeat, the comparisons and verdicts over the
repeats), which this module only assembles: the document's keys are decided here, the numbers
there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from kvturn_server.bench._host import host_info
from kvturn_server.bench._profiles import CPU_BLOCK_SIZE
from kvturn_server.bench._stats import STRONGEST_RULE, distribution, ratio, strongest
from kvturn_server.bench.agent._modes import (
    KVTURN_MODE,
    KVTURN_MODES,
    MODE_TABLE,
    MODES,
    MODES_BY_NAME,
    STOCK_MODES,
)
from kvturn_server.bench.agent._records import ModeRun
from kvturn_server.bench.agent._summary import (
    BASE,
    DECODE_TURNS_NOTE,
    ITL_NOTE,
    MODES_NOTE,
    POOLED_SCOPES,
    against,
    aggregate_mode,
    compare,
    legacy_comparison,
    pooled_ttft,
    summarize,
)
from kvturn_server.bench.agent._workload import (
    DECODES,
    ORDER_RATIONALE,
    PREFILLS,
    AgentBenchSettings,
    agent_shape,
    build_scripts,
    instance_profiles,
)

# The strongest stock mode, and kvturn's targets against it (issue 25's "done when").

TARGET_TURN2PLUS_TIGHT = 1.3


def strongest_stock(runs: Sequence[ModeRun]) -> tuple[str | None, dict[str, float | None]]:
    """The strongest stock mode that ran (``STRONGEST_RULE``, the one every benchmark
    headlines against) and every stock mode's pooled TTFT p50 of turns 2+ (ms)."""
    return strongest({mode: pooled_ttft(runs, mode, POOLED_SCOPES["turn2plus"])
                      for mode in STOCK_MODES if any(run.mode == mode for run in runs)})


def _target(value: float | None, target: float, at_least: bool) -> dict[str, Any]:
    met = None if value is None else (value >= target if at_least else value <= target)
    return {"value": value, "target": target, "at_least": at_least, "met": met}


def headline(runs: Sequence[ModeRun], comparisons: dict[str, Any],
             modes: dict[str, Any], mine: str = KVTURN_MODE) -> dict[str, Any] | None:
    """The kvturn mode ``mine`` (``comparisons``: its own, by stock mode) against the
    strongest stock mode: which one it is, why, and the targets: TTFT p50/p90/p99 base/on >=
    1.0 (pooled and every repeat), computed tokens never more, turns 2+ p50 base/on >= 1.3
    (the tight-decode scenario's bar), ITL p99 on/base no worse (pooled gaps)."""
    base, p50 = strongest_stock(runs)
    if base is None or comparisons.get(base) is None:
        return None
    cmp = comparisons[base]
    pooled = cmp.get("pooled") or {}

    def pooled_ratio(key: str) -> float | None:
        entry = pooled.get(key)
        return None if entry is None else entry["ratio"]

    itl = ratio(modes[mine]["itl_ms_pooled"]["p99"], modes[base]["itl_ms_pooled"]["p99"])
    v = cmp["verdict"]
    slowest = min((x for x in (pooled_ratio(f"ttft_ms_all_{q}_base_over_on")
                               for q in ("p50", "p90", "p99")) if x is not None), default=None)
    return {
        "mode": mine, "against": base, "label": MODES_BY_NAME[base].label,
        "chosen_by": STRONGEST_RULE,
        "ttft_ms_turn2plus_p50_pooled": p50,
        "targets": {
            "ttft_never_slower_pooled": _target(slowest, 1.0, True),
            "ttft_never_slower_every_repeat": {"met": v["never_slower"]},
            "computed_never_more": {"met": v["computed_never_more"]},
            "turn2plus_p50_tight": _target(pooled_ratio("ttft_ms_turn2plus_p50_base_over_on"),
                                           TARGET_TURN2PLUS_TIGHT, True),
            "itl_p99_no_worse_pooled": _target(itl, 1.0, False)},
    }


def configuration(settings: AgentBenchSettings, machine: dict[str, Any],
                  orders: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Which configuration ran, as every figure of it must say."""
    return {"prefill_prefix_cache": settings.prefill_prefix_cache,
            "decode_prefix_cache": True,
            "prefills": PREFILLS, "decodes": DECODES, "router": True,
            "routers": "one per run, started with its mode's flags",
            "decode_blocks": settings.decode_blocks,
            "instances": instance_profiles(settings),
            "model": settings.size, "agents": settings.agents, "turns": settings.turns,
            "system_tokens": settings.system_tokens,
            "message_tokens": list(settings.message_tokens),
            "reply": settings.reply_description(), "repeats": settings.repeats,
            "orders": [list(o) for o in orders],
            "cpu_model": machine.get("cpu_model"), "amx": machine.get("amx"),
            "cpus": machine.get("cpus")}


COMPARISONS_NOTE = (
    "kvturn (on) against every stock mode that ran, keys X_base_over_on / X_on_over_base "
    "(base: the stock mode); comparison is the one against off (stock P/D) with the keys "
    "X_off_over_on it has always had; headline names the strongest stock mode; "
    "comparisons_by_mode and headlines have the same for every kvturn mode that ran "
    "(kvturn-offload too), where on in a key stands for that mode")


def build_results(settings: AgentBenchSettings, runs: Sequence[ModeRun],
                  extra: dict[str, Any] | None = None,
                  machine: dict[str, Any] | None = None,
                  block_size: int = CPU_BLOCK_SIZE) -> dict[str, Any]:
    """The JSON document: configuration, the mode table, settings, seed, gaps, per-mode
    summaries over the repeats and per repeat, the comparisons and the headline, every record
    and sample (``block_size``: the decode's, which tells whether a turn found its history)."""
    planned = settings.agents * settings.turns
    machine = host_info() if machine is None else machine
    by_repeat: dict[int, list[ModeRun]] = {}
    for run in runs:
        by_repeat.setdefault(run.repeat, []).append(run)
    ran = [m for m in MODES if any(r.mode == m for r in runs)]
    stock = [m for m in STOCK_MODES if m in ran]
    kvturn = [m for m in KVTURN_MODES if m in ran]
    repeats: list[dict[str, Any]] = []
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {
        mine: {base: [] for base in stock} for mine in kvturn}
    for repeat, group in sorted(by_repeat.items()):
        summaries = {run.mode: summarize(run, planned, block_size) for run in group}
        order = [run.mode for run in group]
        for mine in kvturn:
            for base in stock:
                cmp = compare(summaries, base, BASE, mine)
                if cmp is not None:
                    rows[mine][base].append({"repeat": repeat, "order": order, **cmp})
        legacy = compare(summaries)
        repeats.append({"repeat": repeat, "order": order, "modes": summaries,
                        "comparison": None if legacy is None else {
                            "repeat": repeat, "order": order, **legacy}})
    modes_seen = [m for m in (*settings.modes, *MODES) if m in ran]
    modes = {mode: aggregate_mode([r for r in runs if r.mode == mode],
                                  [rep["modes"][mode] for rep in repeats
                                   if mode in rep["modes"]])
             for mode in dict.fromkeys(modes_seen)}
    by_mode = {mine: {base: against(runs, rows[mine][base], base, BASE, mine)
                      for base in stock if rows[mine][base]} for mine in kvturn}
    headlines = {mine: headline(runs, by_mode[mine], modes, mine) for mine in kvturn}
    comparisons = by_mode.get(KVTURN_MODE, {})
    gaps = settings.gaps
    shapes = {agent: agent_shape(settings, agent) for agent in range(settings.agents)}
    drawn = {script.agent: list(script.gaps_s) for script in build_scripts(settings, MODES[0])}
    all_gaps = [g for agent in drawn.values() for g in agent]
    return {
        "benchmark": "agent",
        "seed": settings.seed,
        "configuration": configuration(settings, machine, [rep["order"] for rep in repeats]),
        "mode_table": [m.describe(settings.router_args) for m in MODE_TABLE if m.name in ran],
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
        "block_size": block_size,
        "itl_note": ITL_NOTE,
        "decode_turns_note": DECODE_TURNS_NOTE,
        **(extra or {}),
        "modes_note": MODES_NOTE,
        "modes": modes,
        "comparisons_note": COMPARISONS_NOTE,
        "headline": headlines.get(KVTURN_MODE),
        "comparisons": comparisons,
        "headlines": headlines,
        "comparisons_by_mode": by_mode,
        "comparison": legacy_comparison(comparisons.get("off")),
        "repeats": repeats,
        "agents": [asdict(a) for run in runs for a in run.agents],
        "turns": [r.to_json() for run in runs for r in run.records],
        "samples": [asdict(s) for run in runs for s in run.samples],
    }
