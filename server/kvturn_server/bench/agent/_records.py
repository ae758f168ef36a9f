"""What ``kvturn bench agent`` records: per turn, per agent, per sample, and per mode of a
repeat (``ModeRun``). ``kvturn bench fleet`` shares ``AgentOutcome`` through the agent loop."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvturn_server.bench._stats import (
    distribution,
)
from kvturn_server.local import PromptSources


@dataclass
class TurnRecord:
    mode: str
    agent: int
    turn: int
    conversation_id: str | None
    started_s: float
    """Seconds after the mode started."""
    message_role: str
    message_words: int
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """The prompt tokens the serving instance's cache supplied, as vLLM reports them
    (``usage.prompt_tokens_details.cached_tokens``, with ``--enable-prompt-tokens-details``):
    on a turn the decode served alone (route ``decode``) its own prefix-cache hit, so
    ``prompt_tokens - cached_tokens`` is what it computed; on a P/D turn vLLM passes on the
    prefill's hit. None where not reported."""
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    reuse: str | None = None
    reused_tokens: int = 0
    no_reuse_reason: str | None = None
    finish_reason: str | None = None
    gap_after_s: float | None = None
    error: str | None = None
    repeat: int = 0
    max_tokens: int | None = None
    route: str | None = None
    """``X-KVTurn-Route``: ``decode`` (the decode continued the turn itself), ``prefill``
    (prefill leg + decode leg) or ``fallback`` (the prefill failed); None where the router
    does not say."""
    prefill_choice: str | None = None
    """``X-KVTurn-Prefill-Choice`` (why this prefill: holder, load, round-robin, affinity)."""
    content_chunks: int = 0
    itl_gaps_ms: list[float] = field(default_factory=list, repr=False)
    """Gaps between consecutive content chunks after the first; summarized in the JSON."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first: first to last content chunk over
        ``completion_tokens - 1`` (None for replies of one token or without usage)."""
        if not self.itl_gaps_ms or self.completion_tokens is None or self.completion_tokens < 2:
            return None
        return round(sum(self.itl_gaps_ms) / (self.completion_tokens - 1), 3)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["itl_ms"] = distribution(data.pop("itl_gaps_ms"))
        data["tpot_ms"] = self.tpot_ms
        return data


@dataclass
class AgentOutcome:
    mode: str
    agent: int
    conversation_id: str | None
    turns_ok: int = 0
    error: str | None = None
    sdk_stats: dict[str, Any] | None = None
    repeat: int = 0


@dataclass
class Sample:
    mode: str
    t_s: float
    retained_bytes: int | None
    prefill_computed_tokens: float | None
    repeat: int = 0


@dataclass
class ModeRun:
    """Everything measured in one mode of one repeat."""

    mode: str
    wall_s: float
    records: list[TurnRecord]
    samples: list[Sample]
    agents: list[AgentOutcome]
    prefill_before: PromptSources | None = None
    prefill_after: PromptSources | None = None
    decode_before: PromptSources | None = None
    decode_after: PromptSources | None = None
    load_before: tuple[float, ...] = ()
    load_after: tuple[float, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    repeat: int = 0

