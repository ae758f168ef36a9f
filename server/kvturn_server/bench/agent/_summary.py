"""What ``kvturn bench agent`` measured, summarized: each mode's summary per repeat, the
medians and spreads over the repeats, each kvturn mode's comparison with every stock mode that
ran (the same ratios, verdicts and pooled intervals against each), the headline against the
strongest of them (``_results``, with the JSON document, ``build_results``); the table is in
``_report``, the plot in ``_plot``.

The JSON keeps ``comparison`` as it was before the stock modes beyond ``off`` existed: kvturn
(``on``) against ``off`` (stock P/D), keys ``X_off_over_on``; ``comparisons[base]`` has the same
for every stock mode ``base`` with keys ``X_base_over_on``, and ``headline`` names the
strongest. ``comparisons_by_mode[m][base]`` and ``headlines[m]`` have them for every kvturn mode
``m`` that ran (``on``, ``kvturn-offload``), under the same keys: there ``on`` stands for ``m``.

Computed prompt tokens are counted on both instances (``vllm:prompt_tokens_by_source_total``,
source ``local_compute``): the prefill's, the decode's, and their sum, which the comparison
uses. In plain P/D the decode computes only the prompt tokens it could not read from the
prefill (none, or a last partial token); where the router lets the decode continue a turn
itself (``X-KVTurn-Route: decode``), the decode computes that turn's new tokens, and a
comparison of the prefill's count alone would flatter kvturn. On the offload profile's
instances the tokens vLLM's CPU offloading loaded from a host tier are counted too
(``vllm:prompt_tokens_cached_by_source_total{source="host"}``, ``host_tokens``): kvturn's own
reuse report counts only what the decode's device cache held.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvturn.wire import Route
from kvturn_server.bench._profiles import CPU_BLOCK_SIZE
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
from kvturn_server.bench.agent._modes import (
    KVTURN_MODE,
    MODES_BY_NAME,
)
from kvturn_server.bench.agent._records import ModeRun, TurnRecord
from kvturn_server.local import PromptSources

# The bar for the decode's inter-token latency with kvturn on: p99 within 10 % of off.
ITL_P99_TOLERANCE = 1.10
# How a comparison's keys name its baseline: "off" in the comparison the JSON has always had
# (kvturn against stock P/D, X_off_over_on), "base" in comparisons[mode] (X_base_over_on).
LEGACY, BASE = "off", "base"


def never_slower_checks(tag: str = LEGACY) -> tuple[str, ...]:
    """The ratios that must all be >= 1.0 in every repeat for "kvturn was never slower"."""
    return (f"ttft_ms_p50_{tag}_over_on", f"ttft_ms_p90_{tag}_over_on",
            f"ttft_ms_p99_{tag}_over_on", f"ttft_ms_turn2plus_p50_{tag}_over_on")


NEVER_SLOWER = never_slower_checks(LEGACY)


def direction(base: str, tag: str) -> str:
    return (f"X_{tag}_over_on = {base} / on: above 1 kvturn is faster (latencies) or computes "
            f"less (tokens); X_on_over_{tag} = on / {base} (turns per second: above 1 kvturn "
            f"serves more; ITL p99: the target is <= {ITL_P99_TOLERANCE:.2f}); the top-level "
            "values are medians over the repeats, spread and per_repeat give every repeat's")


DIRECTION = direction("off", LEGACY)
MODES_NOTE = (
    "every number of a mode is the median over the repeats (counts missing from a repeat "
    "count 0 there); turns_ok_total and errors_total are sums; spread gives min, median and "
    "max of the headline figures; itl_ms_pooled pools every gap of every repeat; repeats[] "
    "has each repeat's own summaries")
DECODE_TURNS_NOTE = (
    "decode_turns: the later turns the router ran on the decode alone (route decode; stock-cond "
    "and kvturn), counted from vLLM's own per-request report (usage.prompt_tokens_details."
    "cached_tokens, the instances run with --enable-prompt-tokens-details; it counts what the "
    "device cache and, on the offload instances, the host tier supplied): found_history = "
    "the decode's cache supplied at least every full block of the previous turn's prompt, "
    "missed_history = it did not (that turn recomputed history); computed_tokens = prompt - "
    "cached over those turns, what the decode computed for them")
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
    return {"computed": d.computed, "local_cache": d.local_cache, "transferred": d.transferred,
            "host": d.host}


def _sum(*values: float | None) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def decode_turns(records: Sequence[TurnRecord], block_size: int) -> dict[str, int]:
    """The later turns the router ran on the decode alone (route ``decode``): how many, how
    many of them report what the decode's cache supplied (``cached_tokens``), how many found
    their history there (the cache supplied at least every full block of the previous turn's
    prompt) and how many did not, and their prompt, cached and computed tokens (computed =
    prompt - cached: what the decode computed for them)."""
    ok = [r for r in records if r.ok]
    prompts = {(r.agent, r.turn): r.prompt_tokens for r in ok}
    later = [r for r in ok if r.turn > 1]
    continued = [r for r in later if r.route == Route.DECODE]
    reported = [r for r in continued
                if r.cached_tokens is not None and r.prompt_tokens is not None]
    found = missed = 0
    for r in reported:
        previous = prompts.get((r.agent, r.turn - 1))
        if previous is None or r.cached_tokens is None:
            continue
        if r.cached_tokens >= previous // block_size * block_size:
            found += 1
        else:
            missed += 1
    prompt = sum(r.prompt_tokens or 0 for r in reported)
    cached = sum(r.cached_tokens or 0 for r in reported)
    return {"later_turns": len(later), "turns": len(continued), "reported": len(reported),
            "found_history": found, "missed_history": missed, "prompt_tokens": prompt,
            "cached_tokens": cached, "computed_tokens": prompt - cached}


def summarize(run: ModeRun, planned_turns: int,
              block_size: int = CPU_BLOCK_SIZE) -> dict[str, Any]:
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
        "profile": MODES_BY_NAME[run.mode].profile if run.mode in MODES_BY_NAME else None,
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
        "host_tokens": _sum(None if prefill is None else prefill["host"],
                            None if decode is None else decode["host"]),
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "reuse": {"outcomes": dict(sorted(outcomes.items())),
                  "reused_tokens": sum(r.reused_tokens for r in ok)},
        "routes": dict(sorted(Counter(r.route or "unreported" for r in ok).items())),
        "decode_turns": decode_turns(run.records, block_size),
        "prefill_choices": dict(sorted(Counter(
            r.prefill_choice or "unreported" for r in ok
            if r.prefill_choice is not None or r.route in (None, "prefill")).items())),
        "retained_mib": {
            "max": round(max(retained), 3) if retained else None,
            "mean": round(statistics.fmean(retained), 3) if retained else None,
            "samples": len(retained)},
        "load_average": {"before": list(run.load_before), "after": list(run.load_after)},
    }


def compare(summaries: dict[str, dict[str, Any]], base: str = "off",
            tag: str = LEGACY, mine: str = KVTURN_MODE) -> dict[str, Any] | None:
    """One repeat's ratios of the kvturn mode ``mine`` against ``base``, keys naming ``base``
    as ``tag`` and ``mine`` as ``on`` (``direction``); None unless both modes ran."""
    if base not in summaries or mine not in summaries:
        return None
    b, on = summaries[base], summaries[mine]
    out: dict[str, Any] = {}
    for key in ("ttft_ms", "ttft_ms_turn1", "ttft_ms_turn2plus", "itl_ms"):
        for q in ("p50", "p90", "p99"):
            out[f"{key}_{q}_{tag}_over_on"] = ratio(b[key][q], on[key][q])
    out[f"itl_ms_p99_on_over_{tag}"] = ratio(on["itl_ms"]["p99"], b["itl_ms"]["p99"])
    out[f"tpot_ms_p50_on_over_{tag}"] = ratio(on["tpot_ms"]["p50"], b["tpot_ms"]["p50"])
    out[f"prefill_computed_{tag}_over_on"] = ratio(b["prefill_computed_tokens"],
                                                   on["prefill_computed_tokens"])
    out[f"computed_{tag}_over_on"] = ratio(b["computed_tokens"], on["computed_tokens"])
    out[f"turns_per_s_on_over_{tag}"] = ratio(on["turns_per_s"], b["turns_per_s"])
    return out


# Over the repeats.

HEADLINE: dict[str, tuple[str, ...]] = {
    "ttft_ms_p50": ("ttft_ms", "p50"), "ttft_ms_p90": ("ttft_ms", "p90"),
    "ttft_ms_p99": ("ttft_ms", "p99"), "ttft_ms_turn2plus_p50": ("ttft_ms_turn2plus", "p50"),
    "itl_ms_p50": ("itl_ms", "p50"), "itl_ms_p90": ("itl_ms", "p90"),
    "itl_ms_p99": ("itl_ms", "p99"), "tpot_ms_p50": ("tpot_ms", "p50"),
    "prefill_computed_tokens": ("prefill_computed_tokens",),
    "decode_computed_tokens": ("decode_computed_tokens",),
    "computed_tokens": ("computed_tokens",), "host_tokens": ("host_tokens",),
    "turns_per_s": ("turns_per_s",), "retained_mib_max": ("retained_mib", "max"),
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


def verdict(per_repeat: Sequence[dict[str, Any]], tag: str = LEGACY) -> dict[str, Any]:
    """Was kvturn never slower (every ``never_slower_checks`` ratio >= 1.0 in every repeat),
    did it never compute more (prefill + decode), and did the ITL p99 stay within 10 % of the
    baseline's? None where a ratio was not measured."""
    checks = never_slower_checks(tag)
    slower = [{"ratio": key, "repeat": row["repeat"], "value": row[key]}
              for row in per_repeat for key in checks
              if row.get(key) is not None and row[key] < 1.0]
    measured = all(row.get(key) is not None for row in per_repeat for key in checks)
    computed = [row.get(f"computed_{tag}_over_on") for row in per_repeat]
    prefill = [row.get(f"prefill_computed_{tag}_over_on") for row in per_repeat]
    itl = [row.get(f"itl_ms_p99_on_over_{tag}") for row in per_repeat]

    def every(values: Sequence[float | None], ok: Any) -> bool | None:
        return None if not values or any(v is None for v in values) else all(
            ok(v) for v in values)

    return {
        "never_slower": (not slower) if measured and per_repeat else None,
        "never_slower_checks": list(checks),
        "slower": slower,
        "computed_never_more": every(computed, lambda v: v >= 1.0),
        "prefill_computed_never_more": every(prefill, lambda v: v >= 1.0),
        f"itl_p99_on_over_{tag}_max": max((v for v in itl if v is not None), default=None),
        "itl_p99_within_10pct": every(itl, lambda v: v <= ITL_P99_TOLERANCE),
    }


POOLED_NOTE = (
    "every repeat's turns of a mode pooled (repeats x agents x turns a mode), the {base}/on "
    "ratio of each quantile with a 95 % percentile-bootstrap interval (2,000 rounds, seeded; "
    "repeats resampled, then the turns of each: the spread between repeats counts); "
    "turn1 = first turns: a new conversation has nothing to reuse, so they are the same work "
    "in every mode and differ only by what else the host runs meanwhile")
POOLED_SCOPES: dict[str, Callable[[TurnRecord], bool]] = {
    "all": lambda r: True, "turn1": lambda r: r.turn == 1, "turn2plus": lambda r: r.turn > 1}


def pooled_ttft(runs: Sequence[ModeRun], mode: str,
                keep: Callable[[TurnRecord], bool] = POOLED_SCOPES["all"]) -> list[float]:
    """The TTFTs of ``mode``'s successful turns that ``keep`` keeps, every repeat pooled."""
    return [r.ttft_ms for run in runs if run.mode == mode for r in run.records
            if r.ok and r.ttft_ms is not None and keep(r)]


def pooled_comparison(runs: Sequence[ModeRun], base: str = "off",
                      tag: str = LEGACY, mine: str = KVTURN_MODE) -> dict[str, Any] | None:
    """The ``base``/``mine`` TTFT ratios over every repeat's turns pooled (``POOLED_NOTE``;
    ``mine`` keyed ``on``)."""
    repeats = sorted({run.repeat for run in runs if run.mode in (base, mine)})
    ttft = {side: {scope: [pooled_ttft([r for r in runs if r.repeat == repeat], mode, keep)
                           for repeat in repeats]
                   for scope, keep in POOLED_SCOPES.items()}
            for side, mode in ((tag, base), ("on", mine))}
    if not any(ttft[tag]["all"]) or not any(ttft["on"]["all"]):
        return None
    out: dict[str, Any] = {"note": POOLED_NOTE.format(base=base),
                           "turns": {side: sum(map(len, ttft[side]["all"]))
                                     for side in (tag, "on")}}
    for scope in POOLED_SCOPES:
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            b_by_repeat, on_by_repeat = ttft[tag][scope], ttft["on"][scope]
            b = [x for values in b_by_repeat for x in values]
            on = [x for values in on_by_repeat for x in values]
            low, high = bootstrap_ratio(b_by_repeat, on_by_repeat, q)
            out[f"ttft_ms_{scope}_{name}_{tag}_over_on"] = {
                "ratio": ratio(percentile(b, q), percentile(on, q)), "low": low,
                "high": high}
    return out


def tail_makeup(runs: Sequence[ModeRun], q: float,
                mine: str = KVTURN_MODE) -> dict[int, dict[str, int]]:
    """Per repeat, the kvturn mode ``mine``'s turns at or above its own TTFT quantile ``q``:
    how many, and how many of them are first turns (which kvturn cannot speed up: nothing to
    reuse)."""
    out: dict[int, dict[str, int]] = {}
    for run in runs:
        if run.mode != mine:
            continue
        ok = [r for r in run.records if r.ok and r.ttft_ms is not None]
        cut = percentile([r.ttft_ms for r in ok if r.ttft_ms is not None], q)
        if cut is None:
            continue
        tail = [r for r in ok if r.ttft_ms is not None and r.ttft_ms >= cut]
        out[run.repeat] = {"turns": len(tail), "first_turns": sum(r.turn == 1 for r in tail)}
    return out


def aggregate_comparison(per_repeat: Sequence[dict[str, Any]], tag: str = LEGACY,
                         base: str = "off") -> dict[str, Any] | None:
    """The ratios over the repeats: medians at the top (the one-run JSON's keys), their
    spread, every repeat's, and the verdict."""
    if not per_repeat:
        return None
    keys = [k for k in per_repeat[0] if k not in ("repeat", "order")]
    spreads = {k: spread([row.get(k) for row in per_repeat]) for k in keys}
    return {**{k: spreads[k]["median"] for k in keys},
            "direction": direction(base, tag),
            "spread": spreads,
            "per_repeat": list(per_repeat),
            "verdict": verdict(per_repeat, tag)}


def against(runs: Sequence[ModeRun], per_repeat: Sequence[dict[str, Any]], base: str,
            tag: str, mine: str = KVTURN_MODE) -> dict[str, Any] | None:
    """The kvturn mode ``mine`` against ``base``: every repeat's ratios aggregated, the pooled
    ratios with their intervals and verdict, and which of ``mine``'s tail turns are first
    turns."""
    cmp = aggregate_comparison(per_repeat, tag, base)
    if cmp is None:
        return None
    pooled = pooled_comparison(runs, base, tag, mine)
    checks = [f"ttft_ms_all_{q}_{tag}_over_on" for q in ("p50", "p90", "p99")] + [
        f"ttft_ms_turn2plus_p50_{tag}_over_on"]
    values = [None if pooled is None else pooled[k]["ratio"] for k in checks]
    pooled_ok = None if any(v is None for v in values) else all(
        v is not None and v >= 1.0 for v in values)
    out = {**cmp, "verdict": {**cmp["verdict"], "pooled_never_slower": pooled_ok},
           "pooled": pooled,
           "on_tail_makeup": {q: {str(k): v for k, v in tail_makeup(runs, x, mine).items()}
                              for q, x in (("p90", 0.9), ("p99", 0.99))}}
    return {"base": base, "mode": mine, **out} if tag == BASE else out


def _renamed(key: str) -> str:
    return "_".join(LEGACY if word == BASE else word for word in key.split("_"))


def _legacy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {_renamed(k): _legacy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_legacy(v) for v in tree]
    if isinstance(tree, str) and "_" in tree and " " not in tree:
        return _renamed(tree)  # a key named in a value: a verdict's checks and slower ratios
    return tree


def legacy_comparison(off: dict[str, Any] | None) -> dict[str, Any] | None:
    """``comparisons["off"]`` under the keys ``comparison`` has always had (``X_off_over_on``),
    for the readers of before the other stock modes: the same as ``against(runs, rows, "off",
    LEGACY)`` without computing the bootstrap intervals twice."""
    if off is None:
        return None
    out: dict[str, Any] = _legacy({k: v for k, v in off.items() if k not in ("base", "mode")})
    out["direction"] = DIRECTION
    return out
