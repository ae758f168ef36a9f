"""What a set of conversations looks like: the samples a trace is described by, and counts."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvturn_server.traces._model import TraceConversation


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """The samples and counts that describe a set of conversations. Quantiles of the samples
    are for the caller to take, with the one definition every kvturn report uses
    (``kvturn_server.bench._stats.quantile``); this package computes none."""

    conversations: int
    subagents: int
    requests: int
    prompt_tokens: tuple[int, ...]
    """Every request's prompt (its context), in read order."""
    reply_tokens: tuple[int, ...]
    new_tokens: tuple[int, ...]
    """Per follow-up: prompt tokens beyond the previous prompt and its reply."""
    gaps_s: tuple[float, ...]
    """Per follow-up: the client's time before it (tool or user)."""
    shrinks: int
    """Follow-ups whose prompt is shorter than the previous one (compaction)."""
    divergences: int
    """Follow-ups that do not start with the whole previous prompt (compaction or an edit)."""

    @property
    def followups(self) -> int:
        return len(self.new_tokens)

    def share_adding_at_most(self, tokens: int) -> float | None:
        """The share of follow-ups that add at most ``tokens`` to the previous prompt and its
        reply; None without follow-ups."""
        if not self.new_tokens:
            return None
        return sum(1 for n in self.new_tokens if n <= tokens) / len(self.new_tokens)

    def gaps_longer_than(self, seconds: float) -> int:
        return sum(1 for g in self.gaps_s if g > seconds)

    def describe(self, quantile: Callable[[Sequence[float], float], float]) -> dict[str, Any]:
        """The summary as a report states it: counts, p50/p90 of the prompts, replies, new
        tokens and gaps, the shares of follow-ups adding at most 512 / 1,024 / 2,048 tokens
        and the gaps over 480 s (the deployed lease), with ``quantile(values, q)`` the caller's
        one quantile definition."""
        def cut(values: Sequence[float]) -> dict[str, float | None]:
            return {f"p{round(q * 100)}": (round(quantile(values, q), 3) if values else None)
                    for q in (0.5, 0.9)}
        shares = {str(n): self.share_adding_at_most(n) for n in (512, 1024, 2048)}
        return {"conversations": self.conversations, "subagents": self.subagents,
                "requests": self.requests, "followups": self.followups,
                "prompt_tokens": cut(self.prompt_tokens), "reply_tokens": cut(self.reply_tokens),
                "new_tokens_per_followup": cut(self.new_tokens),
                "followups_adding_at_most": {k: None if v is None else round(v, 4)
                                             for k, v in shares.items()},
                "gap_s": cut(self.gaps_s), "gaps_over_480_s": self.gaps_longer_than(480.0),
                "shrinks": self.shrinks, "divergences": self.divergences}


def summarize(conversations: Iterable[TraceConversation]) -> TraceSummary:
    """The summary of ``conversations`` (subagents counted as conversations, as they are)."""
    items = list(conversations)
    requests = [r for c in items for r in c.requests]
    followups = [r for r in requests if r.is_followup]
    return TraceSummary(
        conversations=len(items), subagents=sum(1 for c in items if c.is_subagent),
        requests=len(requests), prompt_tokens=tuple(r.prompt_tokens for r in requests),
        reply_tokens=tuple(r.reply_tokens for r in requests),
        new_tokens=tuple(r.new_tokens for r in followups if r.new_tokens is not None),
        gaps_s=tuple(r.gap_s for r in followups),
        shrinks=sum(1 for r in followups if r.shrank),
        divergences=sum(1 for r in followups if not r.extends))
