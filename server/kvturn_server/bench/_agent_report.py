"""What ``kvturn bench agent`` measured and how it is reported: the per-turn, per-agent and
per-sample records, each mode's summary per repeat, the medians and spreads over the repeats,
the off/on comparison with its verdict, the JSON, the table and the plot.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvturn_server._plot import pyplot, save
from kvturn_server.bench._agent_workload import (
    DECODES,
    MODES,
    ORDER_RATIONALE,
    PREFILLS,
    AgentBenchSettings,
    agent_shape,
    build_scripts,
)
from kvturn_server.bench._host import describe_cpu, host_info
from kvturn_server.bench._stats import (
    MIB,
    bootstrap_ratio,
    cdf_points,
    distribution,
    fmt,
    percentile,
    ratio,
    rounded,
    turn_summary,
)
from kvturn_server.local._metrics import PromptSources

# The issue's bar for the decode's inter-token latency with kvturn on: p99 within 10 % of off.
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


# Records.

@dataclass
class TurnRecord:
    mode: str
    agent: int
    turn: int
    conversation_id: str | None
    started_s: float
    """Seconds after the mode started."""
    message_role: str
    message_words: int
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    reuse: str | None = None
    reused_tokens: int = 0
    no_reuse_reason: str | None = None
    finish_reason: str | None = None
    gap_after_s: float | None = None
    error: str | None = None
    repeat: int = 0
    max_tokens: int | None = None
    route: str | None = None
    """``X-KVTurn-Route``: ``decode`` (the decode continued the turn itself), ``prefill``
    (prefill leg + decode leg) or ``fallback`` (the prefill failed); None where the router
    does not say."""
    prefill_choice: str | None = None
    """``X-KVTurn-Prefill-Choice`` (why this prefill: holder, load, round-robin, affinity)."""
    content_chunks: int = 0
    itl_gaps_ms: list[float] = field(default_factory=list, repr=False)
    """Gaps between consecutive content chunks after the first; summarized in the JSON."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first: first to last content chunk over
        ``completion_tokens - 1`` (None for replies of one token or without usage)."""
        if not self.itl_gaps_ms or self.completion_tokens is None or self.completion_tokens < 2:
            return None
        return round(sum(self.itl_gaps_ms) / (self.completion_tokens - 1), 3)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["itl_ms"] = distribution(data.pop("itl_gaps_ms"))
        data["tpot_ms"] = self.tpot_ms
        return data


@dataclass
class AgentOutcome:
    mode: str
    agent: int
    conversation_id: str | None
    turns_ok: int = 0
    error: str | None = None
    sdk_stats: dict[str, Any] | None = None
    repeat: int = 0


@dataclass
class Sample:
    mode: str
    t_s: float
    retained_bytes: int | None
    prefill_computed_tokens: float | None
    repeat: int = 0


@dataclass
class ModeRun:
    """Everything measured in one mode of one repeat."""

    mode: str
    wall_s: float
    records: list[TurnRecord]
    samples: list[Sample]
    agents: list[AgentOutcome]
    prefill_before: PromptSources | None = None
    prefill_after: PromptSources | None = None
    decode_before: PromptSources | None = None
    decode_after: PromptSources | None = None
    load_before: tuple[float, ...] = ()
    load_after: tuple[float, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    repeat: int = 0


# Statistics.

def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def spread(values: Sequence[float | int | None]) -> dict[str, Any]:
    """min, median and max of the measured values (None: not measured), and all of them."""
    present = [v for v in values if v is not None]
    return {"min": min(present) if present else None,
            "median": rounded(statistics.median(present), 4) if present else None,
            "max": max(present) if present else None, "per_repeat": list(values)}


_DROP = object()


def median_tree(values: Sequence[Any]) -> Any:
    """The median over repeats of a summary, leaf by leaf: numbers become their median,
    dicts are merged key by key (a key missing from a repeat counts 0 where the dict holds
    only numbers, as a counter does, else it is left out), equal other values stay, differing
    ones (lists of load averages, say) are dropped; None values are left out."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, dict) for v in present):
        counter = all(_is_number(x) for v in present for x in v.values())
        keys = list(dict.fromkeys(k for v in present for k in v))
        merged = {}
        for key in keys:
            value = median_tree([v.get(key, 0 if counter else None) for v in present])
            if value is not _DROP:
                merged[key] = value
        return merged
    if all(_is_number(v) for v in present):
        median = statistics.median(present)
        return median if isinstance(median, int) else round(median, 4)
    if all(v == present[0] for v in present):
        return present[0]
    return _DROP


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


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = summary
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def aggregate_mode(runs: Sequence[ModeRun], summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One mode over its repeats (``MODES_NOTE``)."""
    merged = median_tree([{k: v for k, v in s.items() if k != "repeat"} for s in summaries])
    gaps = [g for run in runs for r in run.records if r.ok for g in r.itl_gaps_ms]
    return {**merged,
            "repeats": len(summaries),
            "turns_ok_total": sum(s["turns_ok"] for s in summaries),
            "errors_total": sum(s["errors"] for s in summaries),
            "itl_ms_pooled": {**distribution(gaps), "cdf_pct": cdf_points(gaps)},
            "spread": {name: spread([_get(s, path) for s in summaries])
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


# The table.

def _range(entry: dict[str, Any], spec: str = ".0f") -> str:
    return f"{fmt(entry['min'], spec)}-{fmt(entry['max'], spec)}"


def configuration_line(results: dict[str, Any]) -> str:
    cfg = results["configuration"]
    settings = results["settings"]
    reply = (f"tool profile, {cfg['reply']['max_tokens']} tokens each"
             if cfg["reply"]["profile"] == "tool" else
             "long profile, {}-{} tokens each (drawn per turn)".format(
                 *cfg["reply"]["max_tokens_range"]))
    orders = " / ".join(",".join(o) for o in cfg["orders"])
    return (f"configuration: prefill prefix cache "
            f"{'ON (vLLM default)' if cfg['prefill_prefix_cache'] else 'OFF'}, decode prefix "
            f"cache on; {cfg['prefills']} prefill + {cfg['decodes']} decode + router; "
            f"{cfg['model']} model; {cfg['agents']} agents x {cfg['turns']} turns, "
            f"{cfg['system_tokens']}-token system prompt, tool gaps x"
            f"{settings['time_scale']:g}; replies: {reply}; {cfg['repeats']} repeat(s), "
            f"order {orders}; host: {describe_cpu(results['machine'])}")


def table(results: dict[str, Any]) -> str:
    repeats = results["configuration"]["repeats"]
    rows = [configuration_line(results),
            f"per mode: medians over {repeats} repeat(s) (turns and err: summed)",
            f"{'mode':<5}{'turns':>7}{'err':>5}{'TTFT p50':>10}{'p90':>8}{'p99':>8}"
            f"{'t2+ p50':>9}{'ITL p50':>9}{'p99':>7}{'P computed':>12}{'D computed':>12}"
            f"{'sum':>10}{'turns/s':>9}{'ret MiB max':>13}  reuse; routes"]
    for mode, s in results["modes"].items():
        outcomes = ", ".join(f"{k} {v:g}" for k, v in s["reuse"]["outcomes"].items())
        routes = ", ".join(f"{k} {v:g}" for k, v in s["routes"].items())
        rows.append(
            f"{mode:<5}{s['turns_ok_total']:>7}{s['errors_total']:>5}"
            f"{fmt(s['ttft_ms']['p50']):>10}{fmt(s['ttft_ms']['p90']):>8}"
            f"{fmt(s['ttft_ms']['p99']):>8}{fmt(s['ttft_ms_turn2plus']['p50']):>9}"
            f"{fmt(s['itl_ms']['p50'], '.1f'):>9}{fmt(s['itl_ms']['p99'], '.1f'):>7}"
            f"{fmt(s['prefill_computed_tokens']):>12}{fmt(s['decode_computed_tokens']):>12}"
            f"{fmt(s['computed_tokens']):>10}{fmt(s['turns_per_s'], '.3f'):>9}"
            f"{fmt(s['retained_mib']['max'], '.1f'):>13}  {outcomes}; {routes}")
        if s.get("replies_short"):
            rows.append(f"      {s['replies_short']:g} replies (median per repeat) ended before "
                        "their max_tokens")
    rows.append("spread over the repeats (min-max):")
    for mode, s in results["modes"].items():
        sp = s["spread"]
        rows.append(
            f"{mode:<5} TTFT p50 {_range(sp['ttft_ms_p50'])}, p90 {_range(sp['ttft_ms_p90'])}, "
            f"p99 {_range(sp['ttft_ms_p99'])}; t2+ p50 {_range(sp['ttft_ms_turn2plus_p50'])}; "
            f"ITL p50 {_range(sp['itl_ms_p50'], '.1f')}, p99 {_range(sp['itl_ms_p99'], '.1f')}"
            f"; TPOT p50 {_range(sp['tpot_ms_p50'], '.1f')}; computed "
            f"{_range(sp['computed_tokens'])}")
    cmp = results.get("comparison")
    if cmp:
        rows.extend(_comparison_rows(cmp))
    return "\n".join(rows)


def _comparison_rows(cmp: dict[str, Any]) -> list[str]:
    labels = {"ttft_ms_p50_off_over_on": "TTFT p50 off/on",
              "ttft_ms_p90_off_over_on": "TTFT p90 off/on",
              "ttft_ms_p99_off_over_on": "TTFT p99 off/on",
              "ttft_ms_turn2plus_p50_off_over_on": "turns 2+ p50 off/on",
              "ttft_ms_turn2plus_p99_off_over_on": "turns 2+ p99 off/on",
              "ttft_ms_turn1_p50_off_over_on": "first turns p50 off/on",
              "ttft_ms_turn1_p90_off_over_on": "first turns p90 off/on",
              "itl_ms_p50_off_over_on": "ITL p50 off/on",
              "itl_ms_p99_on_over_off": "ITL p99 on/off",
              "tpot_ms_p50_on_over_off": "TPOT p50 on/off",
              "prefill_computed_off_over_on": "prefill computed off/on",
              "computed_off_over_on": "computed (P+D) off/on",
              "turns_per_s_on_over_off": "turns/s on/off"}
    rows = ["ratios of repeat 1, 2, ... (min / median / max); off/on above 1: kvturn faster or "
            "computing less:"]
    for key, label in labels.items():
        sp = cmp["spread"].get(key)
        if sp is None:  # a JSON from before the key existed
            continue
        values = " ".join(fmt(v, ".2f") for v in sp["per_repeat"])
        rows.append(f"  {label:<24}{values:<24}({fmt(sp['min'], '.2f')} / "
                    f"{fmt(sp['median'], '.2f')} / {fmt(sp['max'], '.2f')})")
    v = cmp["verdict"]
    n = len(cmp["per_repeat"])
    if v["never_slower"] is None:
        rows.append("verdict: not measured (a TTFT figure is missing in some repeat)")
    elif v["never_slower"]:
        rows.append(f"verdict: kvturn was never slower: TTFT p50, p90, p99 and turns 2+ p50 "
                    f"off/on >= 1.00 in all {n} repeat(s)")
    else:
        # Three decimals: a ratio of 0.996 is slower and must not print as 1.00.
        worst = ", ".join(f"{labels[s['ratio']]} {s['value']:.3f} (repeat {s['repeat'] + 1})"
                          for s in v["slower"])
        rows.append(f"verdict: kvturn was SLOWER in {len(v['slower'])} of "
                    f"{n * len(NEVER_SLOWER)} checks: {worst}")
    rows.extend(_tail_rows(cmp))
    rows.extend(_pooled_rows(cmp.get("pooled")))
    if v.get("pooled_never_slower") is not None:
        rows.append("verdict over the pooled turns: kvturn was " + (
            "never slower: TTFT p50, p90, p99 and turns 2+ p50 off/on >= 1.00"
            if v["pooled_never_slower"] else "SLOWER in a pooled TTFT quantile"))
    yes_no = {True: "yes", False: "NO", None: "not measured"}
    rows.append(f"computed tokens (prefill + decode) on <= off in every repeat: "
                f"{yes_no[v['computed_never_more']]}; ITL p99 on/off <= "
                f"{ITL_P99_TOLERANCE:.2f} in every repeat: {yes_no[v['itl_p99_within_10pct']]}"
                f" (max {fmt(v['itl_p99_on_over_off_max'], '.2f')})")
    return rows


def _tail_rows(cmp: dict[str, Any]) -> list[str]:
    makeup = cmp.get("on_tail_makeup") or {}
    rows = []
    for q in ("p90", "p99"):
        per = makeup.get(q) or {}
        if per:
            parts = ", ".join(f"repeat {int(k) + 1}: {v['first_turns']} of {v['turns']}"
                              for k, v in sorted(per.items(), key=lambda kv: int(kv[0])))
            rows.append(f"  first turns among the on mode's turns at or above its TTFT {q}: "
                        f"{parts}")
    return rows


def _pooled_rows(pooled: dict[str, Any] | None) -> list[str]:
    if not pooled:
        return []

    def cell(key: str) -> str:
        v = pooled[key]
        return (f"{fmt(v['ratio'], '.2f')} [{fmt(v['low'], '.2f')}-"
                f"{fmt(v['high'], '.2f')}]")

    turns = pooled["turns"]
    return [f"pooled over the repeats ({turns['off']} off / {turns['on']} on turns), off/on "
            "with 95 % bootstrap intervals:",
            f"  all turns   p50 {cell('ttft_ms_all_p50_off_over_on')}, p90 "
            f"{cell('ttft_ms_all_p90_off_over_on')}, p99 {cell('ttft_ms_all_p99_off_over_on')}",
            f"  turns 2+    p50 {cell('ttft_ms_turn2plus_p50_off_over_on')}, p90 "
            f"{cell('ttft_ms_turn2plus_p90_off_over_on')}, p99 "
            f"{cell('ttft_ms_turn2plus_p99_off_over_on')}",
            f"  first turns p50 {cell('ttft_ms_turn1_p50_off_over_on')}, p90 "
            f"{cell('ttft_ms_turn1_p90_off_over_on')} (nothing to reuse: the same work in "
            "both modes)"]


# The plot.

def write_plot(results: dict[str, Any], path: Path) -> bool:
    """PNG: TTFT and inter-token latency distributions (CDF, every repeat pooled) per mode,
    retained MiB and prefill computed tokens over time (one line per repeat); False when
    matplotlib (extra ``[bench]``) is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    colors = {"off": "tab:red", "on": "tab:blue"}
    labels = {"off": "off (plain P/D)", "on": "on (kvturn conversations)"}
    fig, (ax_ttft, ax_itl, ax_mem, ax_tok) = plt.subplots(1, 4, figsize=(21, 4.8))
    for mode, summary in results["modes"].items():
        ttft = sorted(t["ttft_ms"] for t in results["turns"]
                      if t["mode"] == mode and t["error"] is None and t["ttft_ms"] is not None)
        if ttft:
            ax_ttft.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post",
                         color=colors[mode], label=f"{labels[mode]}, n={len(ttft)}")
        pooled = summary.get("itl_ms_pooled") or {}
        cdf = [v for v in pooled.get("cdf_pct") or [] if v is not None]
        if cdf:
            ax_itl.plot(cdf, [i / (len(cdf) - 1) if len(cdf) > 1 else 1.0
                              for i in range(len(cdf))], color=colors[mode],
                        label=f"{labels[mode]}, n={pooled['n']}")
        repeats = sorted({s.get("repeat", 0) for s in results["samples"] if s["mode"] == mode})
        for n, repeat in enumerate(repeats):
            samples = [s for s in results["samples"]
                       if s["mode"] == mode and s.get("repeat", 0) == repeat]
            label = labels[mode] if n == 0 else None
            mem = [(s["t_s"], s["retained_bytes"] / MIB) for s in samples
                   if s["retained_bytes"] is not None]
            if mem:
                ax_mem.step(*zip(*mem, strict=True), where="post", color=colors[mode],
                            alpha=0.8, label=label)
            tok = [(s["t_s"], s["prefill_computed_tokens"]) for s in samples
                   if s["prefill_computed_tokens"] is not None]
            if tok:
                base = tok[0][1]
                ax_tok.plot([t for t, _ in tok], [v - base for _, v in tok],
                            color=colors[mode], alpha=0.8, label=label)
    ax_ttft.set_xscale("log")
    ax_ttft.set_xlabel("TTFT (ms)")
    ax_ttft.set_ylabel("fraction of turns")
    ax_ttft.set_title("TTFT distribution")
    ax_itl.set_xscale("log")
    ax_itl.set_xlabel("inter-token latency (ms)")
    ax_itl.set_ylabel("fraction of gaps")
    ax_itl.set_title("inter-token latency distribution")
    ax_mem.set_xlabel("seconds since the mode started")
    ax_mem.set_ylabel("decode retained MiB")
    ax_mem.set_title("retained KV over time (a line per repeat)")
    ax_tok.set_xlabel("seconds since the mode started")
    ax_tok.set_ylabel("prompt tokens computed by the prefill")
    ax_tok.set_title("prefill compute (cumulative, a line per repeat)")
    for ax in (ax_ttft, ax_itl, ax_mem, ax_tok):
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    cfg = results["configuration"]
    reply = cfg["reply"]
    replies = (f"{reply['max_tokens']}-token replies" if reply["profile"] == "tool" else
               "{}-{}-token replies".format(*reply["max_tokens_range"]))
    fig.suptitle(
        f"kvturn bench agent: {cfg['agents']} agents x {cfg['turns']} turns, {cfg['model']} "
        f"model, prefill prefix cache {'on' if cfg['prefill_prefix_cache'] else 'off'}, "
        f"{cfg['prefills']} prefill + {cfg['decodes']} decode, {replies}, "
        f"{cfg['repeats']} repeat(s); {describe_cpu(results['machine'])}")
    save(plt, fig, path)
    return True
