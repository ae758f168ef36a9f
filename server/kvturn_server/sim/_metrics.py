"""What a simulation measures: per turn, and the memory holding KV over time.

A later turn **reused its history** when the tokens of its history (what its prompt shares with
the previous prompt and reply) that were computed again are at most the previous reply plus two
blocks: whichever cache supplied it (a retention, a decode's or a prefill's prefix cache, a host
tier), a prefill that held the last prompt and computed only the reply back counts. The
measure is what happened, for every policy alike; the router's own words (``reasons``, what
``X-KVTurn-Reuse`` would say) are kept beside it. Turns whose history is under one block have
nothing to reuse and are left out of the hit rates.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict
from typing import Any

from kvturn_server.bench import percentile
from kvturn_server.sim._config import GIB, SimSettings
from kvturn_server.sim._instances import SimDecode, SimPrefill
from kvturn_server.sim._workload import Conversation

GAP_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<10s", 10.0), ("10s-1min", 60.0), ("1-8min", 480.0), (">8min", float("inf")))
"""The tool gap before a turn, bucketed; 8 min is vLLM's fixed 480 s."""
SLACK_BLOCKS = 2
"""A history counts as reused when at most the previous reply and this many blocks of it were
computed again (the partial blocks at either end of the reply)."""


def gap_bucket(gap_s: float) -> str:
    return next(name for name, upper in GAP_BUCKETS if gap_s < upper)


def _quantiles(values: list[float]) -> dict[str, float | None]:
    return {"mean": round(statistics.fmean(values), 4) if values else None,
            **{f"p{int(q * 100)}": _round(percentile(values, q)) for q in (0.5, 0.9, 0.99)}}


class Recorder:
    """Collects every turn's outcome and the fleet's KV memory over time."""

    def __init__(self, settings: SimSettings, decodes: list[SimDecode],
                 prefills: list[SimPrefill]) -> None:
        self.settings = settings
        self.decodes = decodes
        self.prefills = prefills
        self.waiting_max = 0
        self.turns = 0
        self.ttfts: list[float] = []
        self.later_ttfts: list[float] = []
        self.prompt_tokens = 0
        self.computed_tokens = 0
        self.recomputed_tokens = 0
        self.history_tokens = 0
        self.reused_tokens = 0
        self.good = 0
        self.reasons: Counter[str] = Counter()
        self.routes: Counter[str] = Counter()
        self.later_turns = 0
        self.later_reused = 0
        self.by_gap: dict[str, list[int]] = {name: [0, 0] for name, _ in GAP_BUCKETS}
        self.memory: list[tuple[float, float]] = []
        self.cached: list[float] = []
        self.host: list[float] = []
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
        self.later_ttfts.append(ttft)
        history = min(prompt, conv.history_tokens(index))
        recomputed = max(0, computed - (prompt - history))
        self.recomputed_tokens += recomputed
        bs = self.settings.fleet.block_size
        if history < bs:
            return
        self.history_tokens += history
        self.later_turns += 1
        bucket = self.by_gap[gap_bucket(conv.gaps_s[index - 1])]
        bucket[0] += 1
        if recomputed <= conv.replies[index - 1] + SLACK_BLOCKS * bs:
            self.later_reused += 1
            bucket[1] += 1

    def sample(self, now: float) -> None:
        block = self.settings.fleet.block_bytes / GIB
        self.memory.append((now, sum(d.table.held_blocks for d in self.decodes) * block))
        self.cached.append(sum(d.cache.blocks for d in self.decodes) * block)
        tiers = [i.host for i in self.decodes] + [i.host for i in self.prefills]
        self.host.append(sum(t.blocks for t in tiers if t is not None) * block)
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
            stats["prefix_cache_evicted_blocks"] += decode.cache.evicted_blocks
        gib = [g for _, g in self.memory]
        busy = self.end_s * len(self.prefills)
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
            "history_tokens": self.history_tokens,
            "reused_tokens": self.reused_tokens,
            "ttft_s": _quantiles(self.ttfts),
            "ttft_later_s": _quantiles(self.later_ttfts),
            "goodput_turns_per_s": round(self.good / self.end_s, 3) if self.end_s else None,
            "ttft_slo_s": s.ttft_slo_s,
            "slo_met": _ratio(self.good, self.turns),
            "retained_gib": {"mean": _mean(gib), "max": round(max(gib), 3) if gib else 0.0,
                             "per_decode_capacity": round(
                                 s.fleet.decode_capacity * s.fleet.block_bytes / GIB, 3)},
            "prefix_cached_gib": {"mean": _mean(self.cached),
                                  "max": round(max(self.cached), 3) if self.cached else 0.0},
            "host_gib": {"mean": _mean(self.host),
                         "max": round(max(self.host), 3) if self.host else 0.0},
            "prefill_utilization": round(sum(p.busy_s for p in self.prefills) / busy, 4)
            if busy else None,
            "decode_compute_utilization": round(
                sum(d.busy_s for d in self.decodes) / (self.end_s * len(self.decodes)), 4)
            if self.end_s else None,
            "decode_waiting_max": self.waiting_max,
            "reasons": dict(self.reasons.most_common()),
            "routes": dict(self.routes),
            "retention_stats": dict(stats),
        }


def _mean(values: list[float]) -> float:
    return round(statistics.fmean(values), 3) if values else 0.0


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 4) if b else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
