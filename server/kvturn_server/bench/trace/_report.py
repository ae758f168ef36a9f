"""``kvturn bench trace``'s table: the configuration (factors, instances and their host tier,
KV sizing, host), the modes, per mode the medians over repeats with their range, and each
kvturn mode against the strongest stock mode and against every stock mode."""

from __future__ import annotations

from typing import Any

from kvturn_server.bench._fleet_report import _grid, describe_profiles
from kvturn_server.bench._host import describe_cpu
from kvturn_server.bench._stats import fmt


def _cell(metric: dict[str, Any], spec: str = ".0f") -> str:
    """The median over repeats, and the range where more than one repeat gave a value."""
    text = fmt(metric["median"], spec)
    if len([v for v in metric["per_repeat"] if v is not None]) > 1:
        text += f" [{fmt(metric['min'], spec)}-{fmt(metric['max'], spec)}]"
    return text


def _ratio(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "-"
    return (f"{fmt(entry['ratio'], '.2f')} ({fmt(entry['low'], '.2f')}-"
            f"{fmt(entry['high'], '.2f')})")


def configuration(results: dict[str, Any]) -> list[str]:
    st, kv, plan = results["settings"], results["kv"], results["plan"]
    sc = plan["scaling"]
    traces = plan["trace_summary"]
    gap = "no cap" if sc["max_gap_trace_s"] is None else f"capped at {sc['max_gap_trace_s']:g} s"
    subagents = sum(1 for c in plan["conversations"] if c["parent"] is not None)
    cuts = sum(1 for c in plan["conversations"] for cut in c["cuts"] if cut is not None)
    return [
        f"kvturn bench trace: {len(plan['conversations'])} conversations ({subagents} "
        f"subagents) from {', '.join(sorted({c['source'] for c in plan['conversations']}))}",
        f"  factors: tokens x1/{sc['token_divisor']:g} (replies at least "
        f"{sc['min_reply_tokens']}), gaps {gap} then x{sc['time_scale']:g}, sessions "
        f"{sc['stagger_s']:g} s apart, at most {sc['max_requests'] or 'every'} requests a "
        f"conversation; lease {st['effective_retention_ttl_s']:g} s (480 s scaled), keepalive "
        f"{st['effective_keepalive_interval_s']:g} s; router thresholds "
        f"{'scaled like the tokens' if st['scale_thresholds'] else 'as deployed'}",
        f"  workload: {plan['requests']} requests a run, {cuts} of them after a compaction or "
        f"edit; at trace scale prompts p50 {fmt(traces['prompt_tokens']['p50'])} / p90 "
        f"{fmt(traces['prompt_tokens']['p90'])} tokens, replies p50 "
        f"{fmt(traces['reply_tokens']['p50'])}, gaps p50 {fmt(traces['gap_s']['p50'], '.1f')} "
        f"s, {traces['gaps_over_480_s']} gaps over 480 s"
        + (f"; left out: {', '.join(plan['left_out'])}" if plan["left_out"] else ""),
        f"  instances: {st['prefills']} prefill + {st['decodes']} decode, {st['size']} model, "
        f"prefix caching on everywhere; each {kv['blocks']} blocks x {kv['block_size']} = "
        f"{kv['capacity_tokens']} tokens ({kv['kv_mib']} MiB), holds "
        f"{kv['conversations_an_instance_holds']:g} of the {kv['conversations']} conversations",
        f"  stands for: {kv['stands_for']}",
        *describe_profiles((results.get("fleet") or {}).get("profiles"), results["mode_table"]),
        f"  host: {describe_cpu(results['machine'])}; {st['repeats']} repeats, order rotated: "
        + " / ".join(",".join(o) for o in results.get("order", [])),
    ]


def table(results: dict[str, Any]) -> str:
    rows = configuration(results)
    for entry in results["mode_table"]:
        flags = " ".join(entry["router_args"]) or "(defaults)"
        rows.append(f"  {entry['mode']:<18} router {flags}; client {entry['client']}; "
                    f"{entry.get('profile', 'plain')} instances: {entry['stands_for']}")
    modes = results["modes"]
    rows.append("latency, ms (median [min-max] over repeats; turns and errors summed); later = "
                "turns 2+:")
    rows += _grid(["mode", "turns", "err", "TTFT p50", "p90", "p99", "later p50", "p90", "p99",
                   "ITL p50", "ITL p99", "turns/s"],
                  [[mode, str(m["turns_ok"]), str(m["errors_total"]), _cell(m["ttft_p50_ms"]),
                    _cell(m["ttft_p90_ms"]), _cell(m["ttft_p99_ms"]),
                    _cell(m["ttft_later_p50_ms"]), _cell(m["ttft_later_p90_ms"]),
                    _cell(m["ttft_later_p99_ms"]), _cell(m["itl_p50_ms"], ".1f"),
                    _cell(m["itl_p99_ms"]), _cell(m["turns_per_s"], ".2f")]
                   for mode, m in modes.items()])
    rows.append("prompt tokens per run (median [min-max]): computed on every instance; moved = "
                "read from a decode; transferred = prefill to decode (and host-tier loads); "
                "host = loaded from a host tier; decodes' retained MiB")
    rows += _grid(["mode", "computed", "moved", "transferred", "host", "retained max", "mean"],
                  [[mode, _cell(m["computed_tokens"]), _cell(m["moved_tokens"]),
                    _cell(m["transferred_tokens"]),
                    _cell(m["host_tokens"]) if "host_tokens" in m else "-",
                    _cell(m["retained_mib_max"], ".1f"),
                    _cell(m["retained_mib_mean"], ".1f")] for mode, m in modes.items()])
    checks = results.get("plan_check")
    if checks:
        off = {m: c for m, c in checks.items() if c["off_plan"]}
        rows.append("  prompts as planned (vLLM's usage): " + (
            "every turn" if not off else "; ".join(
                f"{m} {c['off_plan']} of {c['turns']} turns off, by up to "
                f"{c['max_abs_diff']} tokens" for m, c in off.items())))
    for run in results["runs"]:
        rows.append(f"  r{run['repeat']} {run['mode']}: routes {run['routes']}, reuse "
                    f"{run['reuse']}")
    cmp = results.get("comparison") or {}
    theirs = cmp.get("strongest_stock", "best stock")
    if "strongest_stock" in cmp:
        p50 = ", ".join(f"{m} {fmt(v)}" for m, v in cmp["stock_ttft_later_p50_ms"].items())
        rows.append(f"strongest stock mode: {theirs}, by {cmp['strongest_by']} (ms: {p50})")
    for mode in (m for m in modes if m in cmp):
        c = cmp[mode]
        rows.append(f"{theirs} / {mode} (above 1: {mode} better), medians over repeats "
                    "[per-repeat min-max]:")
        rows.append("  " + "; ".join(
            f"{name.removesuffix('_ms')} {fmt(c[name]['ratio'], '.2f')} "
            f"[{fmt(c[name]['per_repeat']['min'], '.2f')}-"
            f"{fmt(c[name]['per_repeat']['max'], '.2f')}]"
            for name in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_later_p50_ms",
                         "itl_p99_ms", "computed_tokens", "turns_per_s")))
        p = c["pooled"]
        rows.append(f"  pooled over repeats against {theirs} (95 % CI): TTFT p50 "
                    f"{_ratio(p['ttft_all_p50'])}; p90 {_ratio(p['ttft_all_p90'])}"
                    f"; p99 {_ratio(p['ttft_all_p99'])}")
        rows.append(f"    later turns: p50 {_ratio(p['ttft_later_p50'])}; p90 "
                    f"{_ratio(p['ttft_later_p90'])}; p99 "
                    f"{_ratio(p['ttft_later_p99'])}; ITL p50 "
                    f"{_ratio(p['itl_p50'])}; ITL p99 {_ratio(p['itl_p99'])}")
        every = c.get("by_stock_mode") or {}
        if every:
            rows.append(f"  every stock mode / {mode}, pooled: later turns p50 and p90 (95 % CI), "
                        "all turns p50, later p99, ITL p99:")
            rows += [f"    {base}: {_ratio(e['ttft_later_p50'])}, "
                     f"{_ratio(e['ttft_later_p90'])}; {fmt(e['ttft_all_p50'], '.2f')}, "
                     f"{fmt(e['ttft_later_p99'], '.2f')}, {fmt(e['itl_p99'], '.2f')}"
                     for base, e in every.items()]
    return "\n".join(rows)
