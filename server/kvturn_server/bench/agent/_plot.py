"""``kvturn bench agent``'s plot: TTFT and inter-token latency distributions, retained KV and
prefill compute over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvturn_server._plot import pyplot, save
from kvturn_server.bench._host import describe_cpu
from kvturn_server.bench._stats import (
    MIB,
)
from kvturn_server.bench.agent._modes import MODE_TABLE


def write_plot(results: dict[str, Any], path: Path) -> bool:
    """PNG: TTFT and inter-token latency distributions (CDF, every repeat pooled) per mode,
    retained MiB and prefill computed tokens over time (one line per repeat); False when
    matplotlib (extra ``[bench]``) is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    colors = {"off": "tab:red", "stock-cond": "tab:orange", "stock-cond-2k": "tab:brown",
              "stock-cond-offload": "tab:purple", "on": "tab:blue",
              "kvturn-offload": "tab:cyan"}
    labels = {m.name: m.title for m in MODE_TABLE}
    fig, (ax_ttft, ax_itl, ax_mem, ax_tok) = plt.subplots(1, 4, figsize=(21, 4.8))
    for mode, summary in results["modes"].items():
        color, name = colors.get(mode, "tab:gray"), labels.get(mode, mode)
        ttft = sorted(t["ttft_ms"] for t in results["turns"]
                      if t["mode"] == mode and t["error"] is None and t["ttft_ms"] is not None)
        if ttft:
            ax_ttft.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post",
                         color=color, label=f"{name}, n={len(ttft)}")
        pooled = summary.get("itl_ms_pooled") or {}
        cdf = [v for v in pooled.get("cdf_pct") or [] if v is not None]
        if cdf:
            ax_itl.plot(cdf, [i / (len(cdf) - 1) if len(cdf) > 1 else 1.0
                              for i in range(len(cdf))], color=color,
                        label=f"{name}, n={pooled['n']}")
        repeats = sorted({s.get("repeat", 0) for s in results["samples"] if s["mode"] == mode})
        for n, repeat in enumerate(repeats):
            samples = [s for s in results["samples"]
                       if s["mode"] == mode and s.get("repeat", 0) == repeat]
            label = name if n == 0 else None
            mem = [(s["t_s"], s["retained_bytes"] / MIB) for s in samples
                   if s["retained_bytes"] is not None]
            if mem:
                ax_mem.step(*zip(*mem, strict=True), where="post", color=color,
                            alpha=0.8, label=label)
            tok = [(s["t_s"], s["prefill_computed_tokens"]) for s in samples
                   if s["prefill_computed_tokens"] is not None]
            if tok:
                base = tok[0][1]
                ax_tok.plot([t for t, _ in tok], [v - base for _, v in tok],
                            color=color, alpha=0.8, label=label)
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
        f"{cfg['prefills']} prefill + {cfg['decodes']} decode"
        + (f" of {cfg['decode_blocks']} KV blocks" if cfg.get("decode_blocks") else "")
        + f", {replies}, "
        f"{cfg['repeats']} repeat(s); {describe_cpu(results['machine'])}")
    save(plt, fig, path)
    return True
