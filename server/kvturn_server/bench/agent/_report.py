"""``kvturn bench agent``'s table: the configuration, each mode's medians and spread over
the repeats, the off/on ratios of every repeat, the pooled ratios and the verdicts."""

from __future__ import annotations

from typing import Any

from kvturn_server.bench._host import describe_cpu
from kvturn_server.bench._stats import (
    fmt,
)
from kvturn_server.bench.agent._summary import ITL_P99_TOLERANCE, NEVER_SLOWER


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


