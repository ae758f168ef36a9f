"""What a simulation measures: per turn, and retained memory over time."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict
from typing import Any

from kvturn_server.bench._stats import percentile
from kvturn_server.sim._config import GIB, SimSettings
from kvturn_server.sim._instances import SimDecode, SimPrefill
from kvturn_server.sim._workload import Conversation

GAP_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<10s", 10.0), ("10s-1min", 60.0), ("1-8min", 480.0), (">8min", float("inf")))
"""The tool gap before a turn, bucketed; 8 min is vLLM's fixed 480 s."""
REUSED = ("hit", "partial")
"""X-KVTurn-Reuse values that count as a reuse hit."""


def gap_bucket(gap_s: float) -> str:
    return next(name for name, upper in GAP_BUCKETS if gap_s < upper)


class Recorder:
    """Collects every turn's outcome and the fleet's retained memory over time."""

    def __init__(self, settings: SimSettings, decodes: list[SimDecode],
                 prefills: list[SimPrefill]) -> None:
        self.settings = settings
        self.decodes = decodes
        self.prefills = prefills
        self.waiting_max = 0
        self.turns = 0
        self.ttfts: list[float] = []
        self.prompt_tokens = 0
        self.computed_tokens = 0
        self.recomputed_tokens = 0
        self.reused_tokens = 0
        self.good = 0
        self.reasons: Counter[str] = Counter()
        self.routes: Counter[str] = Counter()
        self.later_turns = 0
        self.later_reused = 0
        self.by_gap: dict[str, list[int]] = {name: [0, 0] for name, _ in GAP_BUCKETS}
        self.memory: list[tuple[float, float]] = []
        self.end_s = 0.0

    def turn(self, conv: Conversation, index: int, *, ttft: float, prompt: int, computed: int,
             reused: int, reason: str, route: str, when: float) -> None:
        self.turns += 1
        self.ttfts.append(ttft)
        self.prompt_tokens += prompt
        self.computed_tokens += computed
        self.reused_tokens += reused
        if ttft <= self.settings.ttft_slo_s:
            self.good += 1
        self.reasons[reason] += 1
        self.routes[route] += 1
        if index == 0:
            return
        fresh = prompt - conv.prompt_tokens(index - 1) - conv.replies[index - 1]
        self.recomputed_tokens += max(0, computed - fresh)
        self.later_turns += 1
        bucket = self.by_gap[gap_bucket(conv.gaps_s[index - 1])]
        bucket[0] += 1
        if reason in REUSED:
            self.later_reused += 1
            bucket[1] += 1

    def sample(self, now: float) -> None:
        block = self.settings.fleet.block_bytes
        held = sum(d.table.held_blocks for d in self.decodes)
        self.memory.append((now, held * block / GIB))
        self.waiting_max = max(self.waiting_max, sum(len(d.waiting) for d in self.decodes))

    def finish(self, now: float) -> None:
        self.end_s = now

    def summary(self) -> dict[str, Any]:
        """The run's numbers (the JSON's per-policy object)."""
        s = self.settings
        stats: Counter[str] = Counter()
        for decode in self.decodes:
            stats.update(asdict(decode.table.stats))
            stats["evicted_for_live"] += decode.evicted_for_live
        gib = [g for _, g in self.memory]
        ttfts = self.ttfts
        return {
            "policy": s.policy.describe(),
            "turns": self.turns,
            "simulated_s": round(self.end_s, 1),
            "later_turns": self.later_turns,
            "later_turns_reused": self.later_reused,
            "hit_rate": _ratio(self.later_reused, self.later_turns),
            "hit_rate_by_gap": {name: {"turns": n, "hit_rate": _ratio(hits, n)}
                                for name, (n, hits) in self.by_gap.items()},
            "prompt_tokens": self.prompt_tokens,
            "computed_tokens": self.computed_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "reused_tokens": self.reused_tokens,
            "ttft_s": {"mean": round(statistics.fmean(ttfts), 4) if ttfts else None,
                       **{f"p{int(q * 100)}": _round(percentile(ttfts, q))
                          for q in (0.5, 0.9, 0.99)}},
            "goodput_turns_per_s": round(self.good / self.end_s, 3) if self.end_s else None,
            "ttft_slo_s": s.ttft_slo_s,
            "slo_met": _ratio(self.good, self.turns),
            "retained_gib": {"mean": round(statistics.fmean(gib), 3) if gib else 0.0,
                             "max": round(max(gib), 3) if gib else 0.0,
                             "per_decode_capacity": round(
                                 s.fleet.decode_capacity * s.fleet.block_bytes / GIB, 3)},
            "prefill_utilization": round(
                sum(p.busy_s for p in self.prefills) / (len(self.prefills) * self.end_s), 4)
            if self.end_s else None,
            "decode_waiting_max": self.waiting_max,
            "reasons": dict(self.reasons.most_common()),
            "routes": dict(self.routes),
            "retention_stats": dict(stats),
        }


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 4) if b else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
