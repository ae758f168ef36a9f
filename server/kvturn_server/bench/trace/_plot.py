"""``kvturn bench trace``'s PNG: the TTFT distribution of every mode (every repeat pooled), TTFT
quantiles of all and later turns with their range over repeats, prompt tokens computed and
moved, and the decodes' retained memory over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvturn_server._plot import pyplot, save
from kvturn_server.bench._stats import MIB

COLORS = {"stock-pd": "tab:red", "stock-cond": "tab:orange", "stock-cond-2k": "tab:olive",
          "stock-cond-offload": "tab:purple", "stock-cond-2k-offload": "tab:pink",
          "kvturn": "tab:blue", "kvturn-offload": "tab:cyan", "kvturn-512-offload": "tab:green"}


def _bars(ax: Any, modes: dict[str, Any], metrics: tuple[str, ...],
          labels: tuple[str, ...]) -> None:
    width = 0.8 / max(len(modes), 1)
    for i, (mode, m) in enumerate(modes.items()):
        xs = [j + i * width for j in range(len(metrics))]
        med = [m[k]["median"] or 0 for k in metrics]
        low = [max((m[k]["median"] or 0) - (m[k]["min"] or 0), 0) for k in metrics]
        high = [max((m[k]["max"] or 0) - (m[k]["median"] or 0), 0) for k in metrics]
        ax.bar(xs, med, width=width, color=COLORS.get(mode), label=mode, yerr=[low, high],
               capsize=3)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(metrics))], labels)


def write_plot(results: dict[str, Any], path: Path) -> bool:
    """The PNG at ``path``; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    modes = results["modes"]
    fig, (ax_cdf, ax_ttft, ax_tok, ax_mem) = plt.subplots(1, 4, figsize=(22, 5))
    for mode in modes:
        ttft = sorted(t["ttft_ms"] for t in results["turns"]
                      if t["mode"] == mode and t["error"] is None and t["ttft_ms"] is not None)
        if ttft:
            ax_cdf.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post",
                        color=COLORS.get(mode), label=f"{mode}, n={len(ttft)}")
        points = [(s["t_s"], sum(v for v in s["retained_bytes"].values() if v) / MIB)
                  for s in results["samples"] if s["mode"] == mode and s["repeat"] == 0]
        if points:
            ax_mem.step(*zip(*points, strict=True), where="post", color=COLORS.get(mode),
                        label=mode)
    _bars(ax_ttft, modes, ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_later_p50_ms",
                           "ttft_later_p90_ms", "ttft_later_p99_ms"),
          ("p50", "p90", "p99", "later p50", "later p90", "later p99"))
    _bars(ax_tok, modes, ("computed_tokens", "moved_tokens", "transferred_tokens"),
          ("computed", "moved from a decode", "prefill to decode"))
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("TTFT (ms)")
    ax_cdf.set_ylabel("fraction of turns")
    ax_cdf.set_title("TTFT, every repeat pooled")
    ax_ttft.set_ylabel("TTFT (ms), median and range over repeats")
    ax_ttft.set_title("TTFT, all turns and later turns")
    ax_tok.set_ylabel("prompt tokens per run, median and range")
    ax_tok.set_title("prompt tokens")
    ax_mem.set_xlabel("seconds since the run started (repeat 0)")
    ax_mem.set_ylabel("decodes' retained MiB")
    ax_mem.set_title("retained KV over time")
    for ax in (ax_cdf, ax_ttft, ax_tok, ax_mem):
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    sc = results["plan"]["scaling"]
    fig.suptitle(f"kvturn bench trace: {len(results['plan']['conversations'])} conversations, "
                 f"tokens x1/{sc['token_divisor']:g}, gaps x{sc['time_scale']:g}, "
                 f"{results['settings']['repeats']} repeats")
    save(plt, fig, path)
    return True
