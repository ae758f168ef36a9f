"""``kvturn bench agent``'s table: the configuration (the instances of each profile, their host
tier), the modes and what each stands for, each mode's medians and spread over the repeats, the
later turns run on the decode alone, then each kvturn mode against every stock mode (the ratios
of every repeat, the pooled ratios and the verdicts), the strongest stock mode first, with the
targets against it.

It reads JSON from before the stock modes beyond ``off`` existed as well: there ``comparison``
(kvturn against ``off``, keys ``X_off_over_on``) is the only comparison and there is no mode
table, no headline and no ``decode_turns``."""

from __future__ import annotations

from typing import Any

from kvturn_server.bench._host import describe_cpu
from kvturn_server.bench._profiles import describe_host_tier
from kvturn_server.bench._stats import fmt
from kvturn_server.bench.agent._modes import MODES_BY_NAME, titled
from kvturn_server.bench.agent._summary import (
    BASE,
    ITL_P99_TOLERANCE,
    LEGACY,
    never_slower_checks,
)


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
    blocks = cfg.get("decode_blocks")
    routers = "a router per run" if cfg.get("routers") else "router"
    instances = cfg.get("instances") or {}
    per_profile = "".join(
        f" ({'; '.join(f'{p} {_profile_text(e)}' for p, e in instances.items())})"
        if instances else "")
    return (f"configuration: prefill prefix cache "
            f"{'ON (vLLM default)' if cfg['prefill_prefix_cache'] else 'OFF'}, decode prefix "
            f"cache on; {cfg['prefills']} prefill + {cfg['decodes']} decode"
            + (f" of {blocks} KV blocks" if blocks else "")
            + (" per instance profile, side by side" if len(instances) > 1 else "")
            + per_profile + f" + {routers}; "
            f"{cfg['model']} model; {cfg['agents']} agents x {cfg['turns']} turns, "
            f"{cfg['system_tokens']}-token system prompt, tool gaps x"
            f"{settings['time_scale']:g}; replies: {reply}; {cfg['repeats']} repeat(s), "
            f"order {orders}; host: {describe_cpu(results['machine'])}")


def _profile_text(entry: dict[str, Any]) -> str:
    return f"for {', '.join(entry['modes'])}: {describe_host_tier(entry['host_tier'])}"


def _mode_rows(results: dict[str, Any]) -> list[str]:
    rows = []
    for m in results.get("mode_table") or []:
        rows.append(f"{titled(m['mode'], m['label'])}: router "
                    f"{' '.join(m['router_args']) or '(defaults)'}; client {m['client']}; "
                    f"{m.get('profile', 'plain')} instances: {m['stands_for']} "
                    f"[{'; '.join(m['sources'])}]")
    return rows


def table(results: dict[str, Any]) -> str:
    repeats = results["configuration"]["repeats"]
    width = max(5, *(len(m) + 1 for m in results["modes"]))
    rows = [configuration_line(results), *_mode_rows(results),
            f"per mode: medians over {repeats} repeat(s) (turns and err: summed)",
            f"{'mode':<{width}}{'turns':>6}{'err':>5}{'TTFT p50':>10}{'p90':>8}{'p99':>8}"
            f"{'t2+ p50':>9}{'ITL p50':>9}{'p99':>7}{'P computed':>12}{'D computed':>12}"
            f"{'sum':>10}{'host':>8}{'turns/s':>9}{'ret MiB max':>13}  reuse; routes"]
    for mode, s in results["modes"].items():
        outcomes = ", ".join(f"{k} {v:g}" for k, v in s["reuse"]["outcomes"].items())
        routes = ", ".join(f"{k} {v:g}" for k, v in s["routes"].items())
        rows.append(
            f"{mode:<{width}}{s['turns_ok_total']:>6}{s['errors_total']:>5}"
            f"{fmt(s['ttft_ms']['p50']):>10}{fmt(s['ttft_ms']['p90']):>8}"
            f"{fmt(s['ttft_ms']['p99']):>8}{fmt(s['ttft_ms_turn2plus']['p50']):>9}"
            f"{fmt(s['itl_ms']['p50'], '.1f'):>9}{fmt(s['itl_ms']['p99'], '.1f'):>7}"
            f"{fmt(s['prefill_computed_tokens']):>12}{fmt(s['decode_computed_tokens']):>12}"
            f"{fmt(s['computed_tokens']):>10}{fmt(s.get('host_tokens')):>8}"
            f"{fmt(s['turns_per_s'], '.3f'):>9}"
            f"{fmt(s['retained_mib']['max'], '.1f'):>13}  {outcomes}; {routes}")
        if s.get("replies_short"):
            rows.append(f"      {s['replies_short']:g} replies (median per repeat) ended before "
                        "their max_tokens")
    rows.extend(_decode_turn_rows(results["modes"]))
    rows.append("spread over the repeats (min-max):")
    for mode, s in results["modes"].items():
        sp = s["spread"]
        rows.append(
            f"{mode:<{width}} TTFT p50 {_range(sp['ttft_ms_p50'])}, p90 "
            f"{_range(sp['ttft_ms_p90'])}, p99 {_range(sp['ttft_ms_p99'])}; t2+ p50 "
            f"{_range(sp['ttft_ms_turn2plus_p50'])}; ITL p50 {_range(sp['itl_ms_p50'], '.1f')}"
            f", p99 {_range(sp['itl_ms_p99'], '.1f')}; TPOT p50 "
            f"{_range(sp['tpot_ms_p50'], '.1f')}; computed {_range(sp['computed_tokens'])}")
    tag = BASE if results.get("comparisons") is not None else LEGACY
    headlines = results.get("headlines") or {"on": results.get("headline")}
    for mine, comparisons in _comparisons(results).items():
        top = headlines.get(mine)
        if top:
            rows.extend(_headline_rows(top, mine))
        order = sorted(comparisons, key=lambda base: base != (top or {}).get("against"))
        for base in order:
            title = MODES_BY_NAME[base].title if base in MODES_BY_NAME else base
            rows.append(f"{_kvturn_title(mine)} against {title}"
                        + (", the strongest stock mode:" if top and top["against"] == base
                           else ":"))
            rows.extend(_comparison_rows(comparisons[base], base, tag, mine))
    return "\n".join(rows)


def _kvturn_title(mine: str) -> str:
    return "kvturn (on)" if mine == "on" else mine


def _comparisons(results: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Every kvturn mode's comparisons, by baseline: ``comparisons_by_mode`` where the JSON has
    it, else ``comparisons`` (kvturn ``on``'s), else (older JSON) ``comparison``, which is
    ``on`` against ``off``."""
    if results.get("comparisons_by_mode") is not None:
        return {mine: {k: v for k, v in by_base.items() if v}
                for mine, by_base in results["comparisons_by_mode"].items()}
    if results.get("comparisons") is not None:
        return {"on": {k: v for k, v in results["comparisons"].items() if v}}
    legacy = results.get("comparison")
    return {"on": {"off": legacy}} if legacy else {}


def _decode_turn_rows(modes: dict[str, Any]) -> list[str]:
    rows = []
    for mode, s in modes.items():
        d = s.get("decode_turns")
        if not d or not d.get("turns"):
            continue
        head = (f"  {mode}: {d['turns']:g} of {d['later_turns']:g} later turns ran on the "
                f"decode alone (median per repeat); ")
        if not d.get("reported"):
            rows.append(head + "vLLM reported no cached tokens for them")
            continue
        rows.append(
            head + f"of the {d['reported']:g} with vLLM's cached-token report, "
            f"{d['found_history']:g} found their history in its cache, "
            f"{d['missed_history']:g} did not; they computed {d['computed_tokens']:g} of "
            f"{d['prompt_tokens']:g} prompt tokens")
    if rows:
        rows.insert(0, "later turns the decode served alone (route decode):")
    return rows


def _headline_rows(top: dict[str, Any], mine: str = "on") -> list[str]:
    p50 = ", ".join(f"{m} {fmt(v)}" for m, v in top["ttft_ms_turn2plus_p50_pooled"].items())
    rows = ["strongest stock mode" + ("" if mine == "on" else f" against {mine}")
            + f": {titled(top['against'], top['label'])}, by {top['chosen_by']}; "
            f"turns 2+ TTFT p50 pooled, ms: {p50}"]
    b, on = top["against"], mine
    labels = {"ttft_never_slower_pooled": f"TTFT p50/p90/p99 {b}/{on}, pooled, lowest",
              "ttft_never_slower_every_repeat": f"TTFT p50/p90/p99 and turns 2+ p50 {b}/{on} "
                                                ">= 1.00 in every repeat",
              "computed_never_more": f"computed tokens (P+D) {on} <= {b} in every repeat",
              "turn2plus_p50_tight": f"turns 2+ TTFT p50 {b}/{on}, pooled (tight-decode bar)",
              "itl_p99_no_worse_pooled": f"ITL p99 {on}/{b}, every gap pooled"}
    for key, label in labels.items():
        t = top["targets"].get(key)
        if t is None:
            continue
        met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        if "target" in t:
            rows.append(f"  target {label}: {fmt(t['value'], '.2f')} "
                        f"{'>=' if t['at_least'] else '<='} {t['target']:g}: {met}")
        else:
            rows.append(f"  target {label}: {met}")
    return rows


def _labels(base: str, tag: str, on: str = "on") -> dict[str, str]:
    b = base
    return {f"ttft_ms_p50_{tag}_over_on": f"TTFT p50 {b}/{on}",
            f"ttft_ms_p90_{tag}_over_on": f"TTFT p90 {b}/{on}",
            f"ttft_ms_p99_{tag}_over_on": f"TTFT p99 {b}/{on}",
            f"ttft_ms_turn2plus_p50_{tag}_over_on": f"turns 2+ p50 {b}/{on}",
            f"ttft_ms_turn2plus_p99_{tag}_over_on": f"turns 2+ p99 {b}/{on}",
            f"ttft_ms_turn1_p50_{tag}_over_on": f"first turns p50 {b}/{on}",
            f"ttft_ms_turn1_p90_{tag}_over_on": f"first turns p90 {b}/{on}",
            f"itl_ms_p50_{tag}_over_on": f"ITL p50 {b}/{on}",
            f"itl_ms_p99_on_over_{tag}": f"ITL p99 {on}/{b}",
            f"tpot_ms_p50_on_over_{tag}": f"TPOT p50 {on}/{b}",
            f"prefill_computed_{tag}_over_on": f"prefill computed {b}/{on}",
            f"computed_{tag}_over_on": f"computed (P+D) {b}/{on}",
            f"turns_per_s_on_over_{tag}": f"turns/s {on}/{b}"}


def _comparison_rows(cmp: dict[str, Any], base: str, tag: str,
                     on: str = "on") -> list[str]:
    labels = _labels(base, tag, on)
    width = max(len(label) for label in labels.values()) + 2
    rows = [f"  ratios of repeat 1, 2, ... (min / median / max); {base}/{on} above 1: {on} "
            "faster or computing less:"]
    for key, label in labels.items():
        sp = cmp["spread"].get(key)
        if sp is None:  # a JSON from before the key existed
            continue
        values = " ".join(fmt(v, ".2f") for v in sp["per_repeat"])
        rows.append(f"    {label:<{width}}{values:<24}({fmt(sp['min'], '.2f')} / "
                    f"{fmt(sp['median'], '.2f')} / {fmt(sp['max'], '.2f')})")
    v = cmp["verdict"]
    n = len(cmp["per_repeat"])
    checks = never_slower_checks(tag)
    who = "kvturn" if on == "on" else on
    if v["never_slower"] is None:
        rows.append("  verdict: not measured (a TTFT figure is missing in some repeat)")
    elif v["never_slower"]:
        rows.append(f"  verdict: {who} was never slower than {base}: TTFT p50, p90, p99 and "
                    f"turns 2+ p50 {base}/{on} >= 1.00 in all {n} repeat(s)")
    else:
        # Three decimals: a ratio of 0.996 is slower and must not print as 1.00.
        worst = ", ".join(f"{labels[s['ratio']]} {s['value']:.3f} (repeat {s['repeat'] + 1})"
                          for s in v["slower"])
        rows.append(f"  verdict: {who} was SLOWER than {base} in {len(v['slower'])} of "
                    f"{n * len(checks)} checks: {worst}")
    rows.extend(_tail_rows(cmp, on))
    rows.extend(_pooled_rows(cmp.get("pooled"), base, tag, on))
    if v.get("pooled_never_slower") is not None:
        rows.append(f"  verdict over the pooled turns: {who} was " + (
            f"never slower than {base}: TTFT p50, p90, p99 and turns 2+ p50 {base}/{on} >= 1.00"
            if v["pooled_never_slower"] else "SLOWER in a pooled TTFT quantile"))
    yes_no = {True: "yes", False: "NO", None: "not measured"}
    rows.append(f"  computed tokens (prefill + decode) {on} <= {base} in every repeat: "
                f"{yes_no[v['computed_never_more']]}; ITL p99 {on}/{base} <= "
                f"{ITL_P99_TOLERANCE:.2f} in every repeat: {yes_no[v['itl_p99_within_10pct']]}"
                f" (max {fmt(v[f'itl_p99_on_over_{tag}_max'], '.2f')})")
    return rows


def _tail_rows(cmp: dict[str, Any], on: str = "on") -> list[str]:
    makeup = cmp.get("on_tail_makeup") or {}
    rows = []
    for q in ("p90", "p99"):
        per = makeup.get(q) or {}
        if per:
            parts = ", ".join(f"repeat {int(k) + 1}: {v['first_turns']} of {v['turns']}"
                              for k, v in sorted(per.items(), key=lambda kv: int(kv[0])))
            rows.append(f"    first turns among the {on} mode's turns at or above its TTFT "
                        f"{q}: {parts}")
    return rows


def _pooled_rows(pooled: dict[str, Any] | None, base: str, tag: str,
                 on: str = "on") -> list[str]:
    if not pooled:
        return []

    def cell(scope: str, q: str) -> str:
        v = pooled[f"ttft_ms_{scope}_{q}_{tag}_over_on"]
        return (f"{fmt(v['ratio'], '.2f')} [{fmt(v['low'], '.2f')}-"
                f"{fmt(v['high'], '.2f')}]")

    turns = pooled["turns"]
    return [f"  pooled over the repeats ({turns[tag]} {base} / {turns['on']} {on} turns), "
            f"{base}/{on} with 95 % bootstrap intervals:",
            f"    all turns   p50 {cell('all', 'p50')}, p90 {cell('all', 'p90')}, p99 "
            f"{cell('all', 'p99')}",
            f"    turns 2+    p50 {cell('turn2plus', 'p50')}, p90 {cell('turn2plus', 'p90')}, "
            f"p99 {cell('turn2plus', 'p99')}",
            f"    first turns p50 {cell('turn1', 'p50')}, p90 {cell('turn1', 'p90')} (nothing "
            "to reuse: the same work in every mode)"]
