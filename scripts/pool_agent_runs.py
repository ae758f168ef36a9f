"""Pool several ``kvturn bench agent`` (or ``bench trace``) runs and compare two modes.

One run of 3 repeats is often too few where a quantile is bimodal (the tight-decode scenario:
a turn the decode continues at once takes about 0.1 s, one that queues for blocks 1-2 s, and
the median lands on either side). Runs of the same scenario on the same host, each with both
modes rotated, pool into more repeats: every repeat stays a cluster, so the interval resamples
repeats, then their turns (``kvturn_server.bench._stats.bootstrap_ratio``, as each run does).

Usage: ``python scripts/pool_agent_runs.py BASE_MODE MODE RUN.json [RUN.json ...]``; prints,
for later turns (turn 2 on, no errors), each quantile of both modes and ``BASE/MODE`` with its
95 % interval (above 1: MODE faster).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvturn_server.bench._stats import bootstrap_ratio, quantile

QUANTILES = (0.5, 0.9, 0.99)


def later_turns(paths: Sequence[Path], mode: str) -> list[list[float]]:
    """TTFT (ms) of ``mode``'s later turns, one list per repeat of every run."""
    repeats: list[list[float]] = []
    for path in paths:
        turns = json.loads(path.read_text())["turns"]
        for repeat in sorted({t["repeat"] for t in turns}):
            repeats.append([t["ttft_ms"] for t in turns
                            if t["mode"] == mode and t["repeat"] == repeat and t["turn"] > 1
                            and not t.get("error") and t.get("ttft_ms") is not None])
    return [r for r in repeats if r]


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3:
        sys.stderr.write(__doc__ or "")
        return 2
    base, mode, paths = argv[0], argv[1], [Path(p) for p in argv[2:]]
    a, b = later_turns(paths, base), later_turns(paths, mode)
    if not a or not b:
        sys.stderr.write(f"no later turns of {base if not a else mode} in "
                         f"{', '.join(map(str, paths))}\n")
        return 1
    flat_a = [t for r in a for t in r]
    flat_b = [t for r in b for t in r]
    sys.stdout.write(f"later turns, {len(a)} / {len(b)} repeats, {len(flat_a)} / "
                     f"{len(flat_b)} turns ({len(paths)} runs)\n")
    for q in QUANTILES:
        qa, qb = quantile(flat_a, q), quantile(flat_b, q)
        low, high = bootstrap_ratio(a, b, q)
        interval = f"[{low:.2f}-{high:.2f}]" if low is not None and high is not None \
            else "(no interval: repeats differ between the modes)"
        sys.stdout.write(f"  p{round(q * 100)}: {base} {qa:.0f} ms, {mode} {qb:.0f} ms, "
                         f"{base}/{mode} {qa / qb:.2f} {interval}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
