"""``kvturn bench fleet``'s numbers: per run, per mode over the repeats (median and range), the
comparison with the strongest stock mode (the lowest TTFT p50 of turns 2+, every repeat's turns
pooled: ``STRONGEST_RULE``, the one rule of every agent benchmark) and with every stock mode,
the results document, the table and the plot."""

from __future__ import annotations

import os
import platform
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvturn_server._plot import pyplot, save
from kvturn_server.bench._fleet_agents import Counters, ModeRun, Snapshot
from kvturn_server.bench._fleet_plan import (
    KVTURN_MODES,
    MODE_TABLE,
    SIZINGS,
    STOCK_MODES,
    TIGHT,
    FleetBenchSettings,
)
from kvturn_server.bench._profiles import describe_host_tier
from kvturn_server.bench._stats import (
    MIB,
    STRONGEST_RULE,
    at_path,
    distribution,
    fmt,
    lowest,
    ratio,
    strongest,
    turn_summary,
)

# Targets of issue 12 for the fleet bench (kvturn-kv against the strongest stock mode).
TARGET_TIGHT_TTFT_P50 = 1.5

ORDER_RATIONALE = (
    "modes run one after the other on the same fleet, each through a router of its own started "
    "for that run: every instance's prompt-token counters and the decodes' retained bytes are "
    "instance-wide, so a mode is measured by them only while it has the fleet to itself. Every "
    "repeat uses the same seed (the same sizes, gaps, starts and reply lengths) with other "
    "words, so no KV cached in one run serves another; repeat r starts with the r-th mode, so "
    "the order rotates; before each run the decodes' retentions drain and the machine settles.")

# The metrics aggregated over repeats: name -> (path in a run summary).
METRICS: dict[str, tuple[str, ...]] = {
    "ttft_p50_ms": ("ttft_ms", "p50"), "ttft_p90_ms": ("ttft_ms", "p90"),
    "ttft_p99_ms": ("ttft_ms", "p99"), "ttft_turn2plus_p50_ms": ("ttft_ms_turn2plus", "p50"),
    "itl_p50_ms": ("itl_ms", "p50"), "itl_p99_ms": ("itl_ms", "p99"),
    "computed_tokens": ("computed_tokens", "total"),
    "reused_tokens": ("reused_tokens", "prefill_metric"),
    "host_tokens": ("host_tokens", "total"),
    "retained_mib_max": ("retained_mib", "max"), "turns_per_s": ("turns_per_s",),
}
# Lower is better for all but these.
HIGHER_IS_BETTER = frozenset({"turns_per_s"})


def _delta(after: Counters | None, before: Counters | None) -> dict[str, float] | None:
    if after is None or before is None:
        return None
    return {"computed": after.computed - before.computed,
            "local_cache": after.local_cache - before.local_cache,
            "transferred": after.transferred - before.transferred,
            "reused": after.reused - before.reused, "host": after.host - before.host}


def instance_deltas(before: Snapshot, after: Snapshot) -> dict[str, dict[str, float] | None]:
    return {name: _delta(after.get(name), before.get(name)) for name in sorted(after)}


def _sum(deltas: dict[str, dict[str, float] | None], key: str,
         names: Sequence[str] | None = None) -> float | None:
    picked = [d for n, d in deltas.items() if names is None or n in names]
    if not picked or any(d is None for d in picked):
        return None
    return sum(d[key] for d in picked if d is not None)


def summarize(run: ModeRun) -> dict[str, Any]:
    """One run's numbers."""
    ok = [r for r in run.records if r.ok]
    deltas = instance_deltas(run.before, run.after)
    prefills = [n for n in deltas if n.startswith("prefill")]
    totals = [s.total_retained for s in run.samples]
    retained = [t / MIB for t in totals if t is not None]
    per_decode: dict[str, float | None] = {}
    for s in run.samples:
        for name, value in s.retained_bytes.items():
            if value is not None:
                per_decode[name] = max(per_decode.get(name) or 0.0, value / MIB)
            else:
                per_decode.setdefault(name, None)
    itl = distribution(run.itl_ms)
    return {
        "scenario": run.scenario, "mode": run.mode, "repeat": run.repeat,
        "position": run.position, "router_args": list(run.router_args),
        "agents": len(run.agents), "turns_planned": run.turns_planned,
        **turn_summary(run.records, run.wall_s),
        "total_ms": distribution([r.total_ms for r in ok if r.total_ms is not None]),
        "itl_ms": {k: itl[k] for k in ("n", "p50", "p99", "max")},
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "completion_tokens": sum(r.completion_tokens or 0 for r in ok),
        "computed_tokens": {"total": _sum(deltas, "computed"),
                            "prefills": _sum(deltas, "computed", prefills)},
        "computed_by_instance": {n: None if d is None else d["computed"]
                                 for n, d in deltas.items()},
        "local_cache_tokens": {n: None if d is None else d["local_cache"]
                               for n, d in deltas.items()},
        "transferred_tokens": {n: None if d is None else d["transferred"]
                               for n, d in deltas.items()},
        "host_tokens": {"total": _sum(deltas, "host"),
                        "by_instance": {n: None if d is None else d["host"]
                                        for n, d in deltas.items()}},
        "reused_tokens": {"prefill_metric": _sum(deltas, "reused", prefills),
                          "headers": sum(r.reused_tokens for r in ok),
                          "by_prefill": {n: None if d is None else d["reused"]
                                         for n, d in deltas.items() if n in prefills}},
        "retained_mib": {"max": round(max(retained), 3) if retained else None,
                         "mean": round(statistics.fmean(retained), 3) if retained else None,
                         "max_by_decode": {n: None if v is None else round(v, 3)
                                           for n, v in sorted(per_decode.items())},
                         "samples": len(retained)},
        "reuse": dict(sorted(Counter(r.reuse or "unreported" for r in ok).items())),
        "routes": dict(sorted(Counter(r.route or "unreported" for r in ok).items())),
        "prefill_choices": dict(sorted(Counter(r.prefill_choice or "unreported"
                                               for r in ok).items())),
        "load_average": {"before": list(run.load_before), "after": list(run.load_after)},
        **run.extra,
    }


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median and range over the repeats (None values are left out and counted)."""
    got = [v for v in values if v is not None]
    return {"median": round(statistics.median(got), 3) if got else None,
            "min": round(min(got), 3) if got else None,
            "max": round(max(got), 3) if got else None,
            "values": list(values)}


def aggregate(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per mode (in the mode table's order): each metric's median and range over repeats."""
    out: dict[str, Any] = {}
    for mode in (m.name for m in MODE_TABLE):
        mine = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["repeat"])
        if not mine:
            continue
        out[mode] = {"repeats": len(mine),
                     "turns_ok": sum(r["turns_ok"] for r in mine),
                     "errors": sum(r["errors"] for r in mine),
                     **{name: spread([at_path(r, path) for r in mine])
                        for name, path in METRICS.items()}}
    return out


def turn2plus_p50(runs: Sequence[ModeRun]) -> dict[str, float | None]:
    """Every stock mode's TTFT p50 of turns 2+ (ms), every repeat's turns pooled."""
    return strongest({mode: [t.ttft_ms for r in runs if r.mode == mode for t in r.records
                             if t.ok and t.turn > 1 and t.ttft_ms is not None]
                      for mode in STOCK_MODES if any(r.mode == mode for r in runs)})[1]


# What the comparison with every stock mode states (the median over repeats of each).
EVERY_STOCK = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_turn2plus_p50_ms",
               "itl_p99_ms", "computed_tokens")


def compare(modes: dict[str, Any], runs: Sequence[dict[str, Any]], sizing: str,
            stock_turn2plus_p50: dict[str, float | None] | None = None) -> dict[str, Any] | None:
    """Each kvturn mode against the strongest stock mode (``STRONGEST_RULE``, from
    ``stock_turn2plus_p50``; without it, the lowest median over the repeats): strongest /
    kvturn for the lower-is-better metrics (above 1: kvturn is better), kvturn / strongest for
    turns per second; from the medians, and per repeat (the same mode's run of that repeat)
    for the spread."""
    stock = [m for m in STOCK_MODES if m in modes]
    if not stock:
        return None
    p50 = stock_turn2plus_p50 if stock_turn2plus_p50 is not None else {
        m: modes[m]["ttft_turn2plus_p50_ms"]["median"] for m in stock}
    strongest = lowest({m: p50.get(m) for m in stock}) or stock[0]
    out: dict[str, Any] = {"stock_modes": stock, "strongest_stock": strongest,
                           "strongest_by": STRONGEST_RULE,
                           "stock_ttft_turn2plus_p50_ms": {m: p50.get(m) for m in stock}}
    for k in (m for m in KVTURN_MODES if m in modes):
        cmp: dict[str, Any] = {"by_stock_mode": {
            base: {name: ratio(modes[base][name]["median"], modes[k][name]["median"])
                   for name in EVERY_STOCK} for base in stock}}
        for name in METRICS:
            if name in ("reused_tokens", "retained_mib_max", "host_tokens"):
                continue
            theirs, mine = modes[strongest][name]["median"], modes[k][name]["median"]
            value = ratio(mine, theirs) if name in HIGHER_IS_BETTER else ratio(theirs, mine)
            per_repeat = []
            for repeat in sorted({r["repeat"] for r in runs}):
                here = {r["mode"]: at_path(r, METRICS[name]) for r in runs
                        if r["repeat"] == repeat}
                if here.get(strongest) is None or here.get(k) is None:
                    continue
                per_repeat.append(ratio(here[k], here[strongest]) if name in HIGHER_IS_BETTER
                                  else ratio(here[strongest], here[k]))
            cmp[name] = {"ratio": value, "per_repeat": spread(per_repeat)}
        out[k] = cmp
    kv = out.get("kvturn-kv")
    if kv is not None:
        ttft, computed = kv["ttft_p50_ms"]["ratio"], kv["computed_tokens"]["ratio"]
        targets: dict[str, Any] = {
            "ttft_p50_not_worse": {"ratio": ttft, "target": 1.0,
                                   "met": None if ttft is None else ttft >= 1.0},
            "computed_not_worse": {"ratio": computed, "target": 1.0,
                                   "met": None if computed is None else computed >= 1.0}}
        if sizing == TIGHT:
            targets["ttft_p50_tight"] = {
                "ratio": ttft, "target": TARGET_TIGHT_TTFT_P50,
                "met": None if ttft is None else ttft >= TARGET_TIGHT_TTFT_P50}
        out["issue12_targets"] = targets
    return out


def scenario_result(name: str, profile: dict[str, Any], sizing: str, kv: dict[str, Any],
                    fleet: dict[str, Any], order: list[list[str]], runs: Sequence[ModeRun],
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    summaries = [summarize(r) for r in runs]
    modes = aggregate(summaries)
    return {"scenario": name, "profile": profile, "sizing": sizing,
            "sizing_means": SIZINGS[sizing], "kv": kv, "fleet": fleet, "order": order,
            **(extra or {}), "modes": modes,
            "comparison": compare(modes, summaries, sizing, turn2plus_p50(runs)),
            "runs": summaries}


def build_results(settings: FleetBenchSettings, scenarios: list[dict[str, Any]],
                  runs: Sequence[ModeRun], extra: dict[str, Any] | None = None) -> dict[
                      str, Any]:
    """The JSON document: settings, the mode table with each mode's router flags, per scenario
    the fleet, its KV sizing, the order, per-run and per-mode numbers, and every turn."""
    return {
        "benchmark": "fleet",
        "seed": settings.seed,
        "settings": settings.describe(),
        "mode_table": [m.describe(settings.router_args(m.name)) for m in MODE_TABLE
                       if m.name in settings.modes],
        "order_rationale": ORDER_RATIONALE,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        **(extra or {}),
        "scenarios": scenarios,
        "agents": [{"scenario": r.scenario, "mode": r.mode, "repeat": r.repeat, **asdict(a)}
                   for r in runs for a in r.agents],
        "turns": [asdict(t) for r in runs for t in r.records],
        "samples": [{"scenario": r.scenario, "mode": r.mode, "repeat": r.repeat,
                     "t_s": s.t_s, "retained_bytes": s.retained_bytes}
                    for r in runs for s in r.samples],
    }


# The table.

def _cell(metric: dict[str, Any], spec: str = ".0f") -> str:
    """The median, and the range when more than one repeat gave a value."""
    text = fmt(metric["median"], spec)
    if len([v for v in metric["values"] if v is not None]) > 1:
        text += f" [{fmt(metric['min'], spec)}-{fmt(metric['max'], spec)}]"
    return text


def _grid(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Columns padded to their widest cell, the first left-aligned, the others right."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            for r in [header, *rows]]


def _by_instance(s: dict[str, Any], mode: str, key: str) -> str:
    values: dict[str, list[float]] = {}
    for run in s["runs"]:
        if run["mode"] == mode:
            for name, v in run[key].items():
                if v is not None:
                    values.setdefault(name, []).append(v)
    return " ".join(f"{n} {statistics.median(v):.0f}" for n, v in sorted(values.items()))


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def describe_profiles(profiles: dict[str, Any] | None,
                      mode_table: list[dict[str, Any]]) -> list[str]:
    """A line per instance profile that ran: its modes and its host tier (none for a JSON from
    before the profiles)."""
    rows = []
    for profile, entry in (profiles or {}).items():
        modes = [m["mode"] for m in mode_table if m.get("profile", "plain") == profile]
        rows.append(f"  {profile} instances ({', '.join(modes)}): "
                    f"{describe_host_tier(entry.get('host_tier'))}")
    return rows


def describe_scenario(s: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    kv, fleet, p = s["kv"], s["fleet"], s["profile"]
    low, high = p["reply_tokens"]
    replies = f"{low}" if low == high else f"{low}-{high}"
    decode_blocks = ", ".join(f"{n} {b}" for n, b in s.get("instance_blocks", {}).items()
                              if n.startswith("decode"))
    return [
        f"scenario {s['scenario']}: {p['what']}; {SIZINGS[s['sizing']]}",
        f"  fleet: {_count(fleet['prefills'], 'prefill')} + {_count(fleet['decodes'], 'decode')}, "
        f"{fleet['model']} "
        f"model, prefix caching on everywhere, max_model_len {fleet['max_model_len']}; each "
        f"prefill {kv['prefill_blocks']} blocks x {kv['block_size']} = "
        f"{kv['prefill_capacity_tokens']} tokens ({kv['prefill_kv_mib']} MiB); decodes: "
        f"{decode_blocks or '-'} blocks, retention budget {fleet['retention_budget']:g}, lease "
        f"{fleet['decoder_kv_blocks_ttl']:g} s",
        f"  workload: {settings['agents']} agents x {p['turns']} turns, system "
        f"{p['system_tokens']} tokens, messages {p['message_tokens'][0]}-"
        f"{p['message_tokens'][1]}, replies {replies} tokens (ignore_eos), tool gaps trace "
        f"p50 2 s / p90 24 s x{settings['time_scale']:g}, seed {settings['seed']}, "
        f"{settings['repeats']} repeats, order rotated",
        f"  KV: a conversation ends at {kv['conversation_tokens']['mean']} tokens on average "
        f"(max {kv['conversation_tokens']['max']}); each prefill holds "
        f"{kv['conversations_a_prefill_holds']:g} of them, {kv['active_per_prefill']:g} active "
        f"per prefill (ratio {kv['held_over_active_per_prefill']:g}), {kv['active_conversations']}"
        f" in all (ratio {kv['held_over_all_active']:g})",
        f"  stands for: {kv['stands_for']}",
    ]


def table(results: dict[str, Any]) -> str:
    rows: list[str] = []
    for entry in results["mode_table"]:
        rows.append(f"{entry['mode']:<18} router {' '.join(entry['router_args']) or '(defaults)'}"
                    f"; client {entry['client']}; {entry.get('profile', 'plain')} instances: "
                    f"{entry['stands_for']}")
    for s in results["scenarios"]:
        rows.append("")
        rows += describe_scenario(s, results["settings"])
        rows += describe_profiles(s["fleet"].get("profiles"), results["mode_table"])
        rows.append("  latency, ms (median [min-max] over repeats):")
        rows += _grid(["mode", "turns", "err", "TTFT p50", "p90", "p99", "turns 2+ p50",
                       "ITL p50", "ITL p99", "turns/s"],
                      [[mode, str(m["turns_ok"]), str(m["errors"]), _cell(m["ttft_p50_ms"]),
                        _cell(m["ttft_p90_ms"]), _cell(m["ttft_p99_ms"]),
                        _cell(m["ttft_turn2plus_p50_ms"]), _cell(m["itl_p50_ms"], ".1f"),
                        _cell(m["itl_p99_ms"]), _cell(m["turns_per_s"], ".2f")]
                       for mode, m in s["modes"].items()])
        rows.append("  prompt tokens per run (median [min-max] over repeats): computed summed "
                    "over every instance, and per instance (median); read from decodes "
                    "(kvturn:reused_tokens_total on the prefills); loaded from a host tier "
                    "(vLLM's CPU offloading, every instance); decodes' retained MiB (max)")
        rows += _grid(["mode", "computed", "computed by instance", "read from decodes",
                       "from host", "retained MiB"],
                      [[mode, _cell(m["computed_tokens"]),
                        _by_instance(s, mode, "computed_by_instance"),
                        _cell(m["reused_tokens"]),
                        _cell(m["host_tokens"]) if "host_tokens" in m else "-",
                        _cell(m["retained_mib_max"], ".1f")]
                       for mode, m in s["modes"].items()])
        for run in s["runs"]:
            if run["routes"] != {"unreported": run["turns_ok"]} or run["prefill_choices"] != {
                    "unreported": run["turns_ok"]}:
                rows.append(f"  r{run['repeat']} {run['mode']}: routes {run['routes']}, prefill "
                            f"choices {run['prefill_choices']}, reuse {run['reuse']}")
        cmp = s.get("comparison") or {}
        # A JSON from before the strongest stock mode was named compared with the best stock
        # figure of each metric.
        theirs = cmp.get("strongest_stock", "best stock")
        if "strongest_stock" in cmp:
            p50 = ", ".join(f"{m} {fmt(v)}"
                            for m, v in cmp["stock_ttft_turn2plus_p50_ms"].items())
            rows.append(f"  strongest stock mode: {theirs}, by {cmp['strongest_by']} (ms: "
                        f"{p50})")
        for k in KVTURN_MODES:
            if k not in cmp:
                continue
            c = cmp[k]
            rows.append(
                f"  {theirs} / {k}: TTFT p50 {fmt(c['ttft_p50_ms']['ratio'], '.2f')}x "
                f"(per repeat {fmt(c['ttft_p50_ms']['per_repeat']['min'], '.2f')}-"
                f"{fmt(c['ttft_p50_ms']['per_repeat']['max'], '.2f')}), p90 "
                f"{fmt(c['ttft_p90_ms']['ratio'], '.2f')}x, p99 "
                f"{fmt(c['ttft_p99_ms']['ratio'], '.2f')}x; computed "
                f"{fmt(c['computed_tokens']['ratio'], '.2f')}x; ITL p99 "
                f"{fmt(c['itl_p99_ms']['ratio'], '.2f')}x; turns/s {k}/{theirs} "
                f"{fmt(c['turns_per_s']['ratio'], '.2f')}")
            every = c.get("by_stock_mode") or {}
            if every:
                rows.append(f"    every stock mode / {k} (medians; TTFT p50, turns 2+ p50, "
                            "computed): " + "; ".join(
                                f"{base} {fmt(r['ttft_p50_ms'], '.2f')}, "
                                f"{fmt(r['ttft_turn2plus_p50_ms'], '.2f')}, "
                                f"{fmt(r['computed_tokens'], '.2f')}"
                                for base, r in every.items()))
        for name, t in (cmp.get("issue12_targets") or {}).items():
            verdict = "-" if t["met"] is None else ("met" if t["met"] else "NOT met")
            rows.append(f"  target {name}: {fmt(t['ratio'], '.2f')}x >= {t['target']:g}: "
                        f"{verdict}")
    return "\n".join(rows)


# The plot.

COLORS = {"stock-rr": "tab:red", "stock-affinity": "tab:orange", "stock-cond": "tab:olive",
          "stock-cond-2k": "tab:brown", "stock-cond-offload": "tab:purple",
          "kvturn-ll": "tab:cyan", "kvturn-kv": "tab:blue", "kvturn-offload": "tab:pink"}


def write_plot(results: dict[str, Any], path: Path) -> bool:
    """PNG, a row per scenario: TTFT CDF (all repeats), TTFT p50/p90/p99 and ITL p50/p99 with
    their range over repeats, computed prompt tokens per instance and tokens read from the
    decodes, the decodes' retained MiB over time (first repeat); False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    scenarios = results["scenarios"]
    fig, axes = plt.subplots(len(scenarios), 5, figsize=(24, 4.6 * len(scenarios)),
                             squeeze=False)
    for row, s in zip(axes, scenarios, strict=True):
        ax_cdf, ax_ttft, ax_itl, ax_tok, ax_mem = row
        modes = list(s["modes"])
        for mode in modes:
            ttft = sorted(t["ttft_ms"] for t in results["turns"]
                          if t["scenario"] == s["scenario"] and t["mode"] == mode
                          and t["error"] is None and t["ttft_ms"] is not None)
            if ttft:
                ax_cdf.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))],
                            where="post", color=COLORS[mode], label=f"{mode}, n={len(ttft)}")
        _bars(ax_ttft, s["modes"], ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms"),
              ("p50", "p90", "p99"))
        _bars(ax_itl, s["modes"], ("itl_p50_ms", "itl_p99_ms"), ("p50", "p99"))
        instances = sorted({n for r in s["runs"] for n in r["computed_by_instance"]})
        bottoms = [0.0] * len(modes)
        for i, name in enumerate(instances):
            heights = []
            for mode in modes:
                values = [r["computed_by_instance"].get(name) for r in s["runs"]
                          if r["mode"] == mode]
                got = [v for v in values if v is not None]
                heights.append(statistics.fmean(got) if got else 0.0)
            ax_tok.bar([j - 0.15 for j in range(len(modes))], heights, width=0.5,
                       bottom=bottoms, label=f"computed: {name}",
                       color=plt.cm.Greys(0.35 + 0.5 * i / max(len(instances), 1)))
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        reused = [s["modes"][m]["reused_tokens"]["median"] or 0 for m in modes]
        ax_tok.bar([j + 0.3 for j in range(len(modes))], reused, width=0.3, color="tab:green",
                   label="read from a decode (median)")
        ax_tok.set_xticks(range(len(modes)), modes, rotation=15)
        for mode in modes:
            points = [(x["t_s"], sum(v for v in x["retained_bytes"].values() if v) / MIB)
                      for x in results["samples"] if x["scenario"] == s["scenario"]
                      and x["mode"] == mode and x["repeat"] == 0]
            if points:
                ax_mem.step(*zip(*points, strict=True), where="post", color=COLORS[mode],
                            label=mode)
        ax_cdf.set_xscale("log")
        ax_cdf.set_xlabel("TTFT (ms)")
        ax_cdf.set_ylabel("fraction of turns")
        ax_cdf.set_title(f"{s['scenario']}: TTFT distribution")
        ax_ttft.set_ylabel("TTFT (ms), median and range over repeats")
        ax_ttft.set_title("TTFT")
        ax_itl.set_ylabel("gap between content chunks (ms)")
        ax_itl.set_title("inter-token latency")
        ax_tok.set_ylabel("prompt tokens per run (mean over repeats)")
        ax_tok.set_title("computed, by instance; read from decodes")
        ax_mem.set_xlabel("seconds since the run started (repeat 0)")
        ax_mem.set_ylabel("decodes' retained MiB")
        ax_mem.set_title("retained KV over time")
        for ax in row:
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    st = results["settings"]
    fig.suptitle(f"kvturn bench fleet: {_count(st['prefills'], 'prefill')} + "
                 f"{_count(st['decodes'], 'decode')}, "
                 f"{st['size']} model, prefix caching on, {st['agents']} agents, "
                 f"{st['repeats']} repeats, tool gaps x{st['time_scale']:g}")
    save(plt, fig, path)
    return True


def _bars(ax: Any, modes: dict[str, Any], metrics: tuple[str, ...],
          labels: tuple[str, ...]) -> None:
    width = 0.8 / len(modes)
    for i, (mode, m) in enumerate(modes.items()):
        xs = [j + i * width for j in range(len(metrics))]
        med = [m[k]["median"] or 0 for k in metrics]
        low = [max((m[k]["median"] or 0) - (m[k]["min"] or 0), 0) for k in metrics]
        high = [max((m[k]["max"] or 0) - (m[k]["median"] or 0), 0) for k in metrics]
        ax.bar(xs, med, width=width, color=COLORS[mode], label=mode, yerr=[low, high],
               capsize=3)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(metrics))], labels)
