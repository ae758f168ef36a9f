"""Scaling recorded agent traces to this machine, keeping their structure.

Tokens are divided by ``token_divisor`` (a 100k-token context becomes 4k at 25), gaps are capped
at ``max_gap_s`` trace seconds and multiplied by ``time_scale``, and each conversation keeps its
first ``max_requests`` requests (``conversations`` caps how many are replayed). What the replay
keeps, request by request (``plan_conversation``):

- **The prompt's length**: each request's prompt is planned at its trace length scaled (the
  *target*): the new message is sized so that the history so far, the reply as it comes back and
  the chat template's framing (``MESSAGE_FRAMING_TOKENS`` per message, measured on the local
  tokenizer, which does not scale) add up to the target. Where they already exceed it (a short
  tool result after a long reply), the new message is one word and the next request catches up.
- **Shared prefixes and compaction**: a follow-up that starts with its whole previous prompt
  (``TraceRequest.extends``) appends the previous reply, exactly as the model produced it, and a
  new message; one that parts from it earlier (compaction, or an edit such as a changed system
  prompt) keeps the history up to where the hash ids part, scaled (``HistoryCut``), and new text
  after it. Text comes from the hash ids (``_text``): equal ids at equal positions give equal
  words, so prefix caches and kvturn's verification see the sharing the trace shows (two
  subagents' common system prompt, say).
- **Subagents** are conversations of their own, started at their parent's time.
- **Replies** are ``max(MIN_REPLY_TOKENS, out / token_divisor)`` tokens, run to that length.
- **Time**: a session starts ``stagger_s`` after the one before it (the traces record no
  absolute start); a subagent at its parent's start plus the parent's clock at its start,
  compressed as the gaps are (each interval between the parent's requests capped, then scaled);
  each request follows its previous reply by its own ``think_time``, capped and scaled. A
  subagent that starts after its parent's last replayed request is left out (and counted).

Nothing here starts a process or draws a word: the plan is a value a test can read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvturn_server.bench.agent._workload import HistoryCut
from kvturn_server.traces import TraceConversation, TraceRequest

# The local tokenizer's ChatML framing (kvturn_server.local._chat_template), measured: a message
# is <|im_start|> role \n ... <|im_end|> \n (5 tokens around its words), and a prompt ends with
# the generation prompt <|im_start|> assistant \n (3).
MESSAGE_FRAMING_TOKENS = 5
GENERATION_PROMPT_TOKENS = 3
MIN_REPLY_TOKENS = 2
"""Every reply has at least one inter-token gap to measure."""


@dataclass(frozen=True)
class Scaling:
    """The stated factors a replay runs at."""

    token_divisor: float = 25.0
    time_scale: float = 0.05
    max_gap_s: float | None = 600.0
    """Cap on a gap in trace seconds, before scaling (None: none)."""
    stagger_s: float = 2.0
    max_requests: int | None = 16
    """Each conversation's first requests replayed (None: all). 16 keeps a run of the nine
    shared traces (144 requests, the longest conversation's gaps about 70 s) near 1.5 minutes a
    mode on a 2-core machine; all of them (580, with the subagents and the compactions, which
    come later in the sessions) take over 20 minutes a mode."""
    conversations: int | None = None

    def __post_init__(self) -> None:
        if not self.token_divisor >= 1:
            raise ValueError(f"the token divisor must be >= 1, got {self.token_divisor}")
        if not self.time_scale > 0:
            raise ValueError(f"the time scale must be positive, got {self.time_scale}")
        if self.max_gap_s is not None and not self.max_gap_s > 0:
            raise ValueError(f"the gap cap must be positive, got {self.max_gap_s}")
        if self.stagger_s < 0:
            raise ValueError(f"the stagger must be >= 0, got {self.stagger_s}")
        for name in ("max_requests", "conversations"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")

    def tokens(self, trace_tokens: float) -> int:
        return round(trace_tokens / self.token_divisor)

    def capped(self, trace_s: float) -> float:
        return trace_s if self.max_gap_s is None else min(trace_s, self.max_gap_s)

    def seconds(self, trace_s: float) -> float:
        """A trace interval on the replay's clock: capped, then scaled."""
        return self.capped(trace_s) * self.time_scale

    def reply_tokens(self, trace_tokens: int) -> int:
        return max(MIN_REPLY_TOKENS, self.tokens(trace_tokens))

    def describe(self) -> dict[str, Any]:
        return {"token_divisor": self.token_divisor, "time_scale": self.time_scale,
                "max_gap_trace_s": self.max_gap_s, "stagger_s": self.stagger_s,
                "max_requests": self.max_requests, "conversations": self.conversations,
                "min_reply_tokens": MIN_REPLY_TOKENS,
                "message_framing_tokens": MESSAGE_FRAMING_TOKENS,
                "generation_prompt_tokens": GENERATION_PROMPT_TOKENS}


@dataclass(frozen=True)
class ReplayRequest:
    """One request as the replay sends it (token counts at scale)."""

    trace: TraceRequest
    target_tokens: int
    """The trace's prompt, scaled."""
    planned_tokens: int
    """The prompt the plan sends (the target, or more where framing and the reply exceed it)."""
    new_words: int
    """The request's new message (one token per word)."""
    new_start: int
    """Where the new message starts in the trace's prompt, scaled: its words follow the hash
    ids from there (``_text``)."""
    reply_tokens: int
    gap_s: float
    """Seconds between the previous reply and this request (0 for the first)."""
    cut: HistoryCut | None
    """The history kept before the new message where the request does not extend the previous
    prompt; None where it does (or for the first)."""


@dataclass(frozen=True)
class ReplayConversation:
    """One conversation as the replay sends it."""

    trace: TraceConversation
    start_s: float
    system_words: int
    requests: tuple[ReplayRequest, ...]

    @property
    def cid(self) -> str:
        return self.trace.cid

    def context_tokens(self) -> int:
        """The most tokens a request of it needs: its planned prompt and its reply."""
        return max(r.planned_tokens + r.reply_tokens for r in self.requests)


def _tokens(words: Sequence[int]) -> int:
    """A prompt of messages of ``words`` words each, with the template's framing."""
    return sum(words) + MESSAGE_FRAMING_TOKENS * len(words) + GENERATION_PROMPT_TOKENS


def _cut(history: list[int], keep: int) -> tuple[list[int], HistoryCut]:
    """The history (words per message, the system prompt first) cut to about ``keep`` tokens,
    framing included: whole messages while they fit, then the part of the next that does.
    At least one word of the system prompt is kept."""
    kept: list[int] = []
    used = 0
    for words in history:
        whole = words + MESSAGE_FRAMING_TOKENS
        if used + whole <= keep:
            kept.append(words)
            used += whole
            continue
        part = keep - used - MESSAGE_FRAMING_TOKENS
        if part >= 1 or not kept:
            kept.append(max(part, 1))
            return kept, HistoryCut(len(kept), kept[-1])
        break
    return kept, HistoryCut(len(kept))


def plan_conversation(trace: TraceConversation, scaling: Scaling,
                      start_s: float) -> ReplayConversation:
    """``trace`` at ``scaling``, its first request at ``start_s`` (see the module docstring)."""
    requests = trace.requests[:scaling.max_requests]
    stated = (trace.system_tokens or 0) + (trace.tool_tokens or 0)
    first = requests[0]
    # The system prompt as the trace states it, within the first prompt's blocks.
    system = scaling.tokens(min(stated, max(first.prompt_tokens - first.block_size, 0)))
    history = [system]
    out: list[ReplayRequest] = []
    previous: ReplayRequest | None = None
    for request in requests:
        target = scaling.tokens(request.prompt_tokens)
        cut: HistoryCut | None = None
        if previous is None:
            start = system
        else:
            history.append(previous.reply_tokens)
            if request.extends:
                start = scaling.tokens(previous.trace.prompt_tokens
                                       + previous.trace.reply_tokens)
            else:
                start = scaling.tokens(request.shared_tokens)
                history, cut = _cut(history, start)
        new = max(1, target - _tokens([*history, 0]))
        history.append(new)
        current = ReplayRequest(
            trace=request, target_tokens=target, planned_tokens=_tokens(history),
            new_words=new, new_start=start, reply_tokens=scaling.reply_tokens(
                request.reply_tokens),
            gap_s=0.0 if previous is None else scaling.seconds(request.gap_s), cut=cut)
        out.append(current)
        previous = current
    return ReplayConversation(trace=trace, start_s=start_s, system_words=system,
                              requests=tuple(out))


def _compressed(parent: TraceConversation, at_s: float, scaling: Scaling) -> float:
    """The parent's clock at trace time ``at_s`` on the replay's: every interval between its
    requests (and from the last one before ``at_s`` to ``at_s``) capped, then scaled."""
    clock, last = 0.0, parent.start_s
    for request in parent.requests[1:]:
        if request.arrival_s > at_s:
            break
        clock += scaling.seconds(request.arrival_s - last)
        last = request.arrival_s
    return clock + scaling.seconds(max(at_s - last, 0.0))


@dataclass(frozen=True)
class ReplayPlan:
    """Every conversation the replay sends, and what the caps left out."""

    scaling: Scaling
    conversations: tuple[ReplayConversation, ...]
    left_out: dict[str, str]
    """cid -> why it is not replayed."""

    def context_tokens(self) -> int:
        return max(c.context_tokens() for c in self.conversations)

    @property
    def requests(self) -> int:
        return sum(len(c.requests) for c in self.conversations)


def plan_replay(conversations: Sequence[TraceConversation], scaling: Scaling) -> ReplayPlan:
    """The replay of ``conversations`` (in read order: sessions, each before its subagents) at
    ``scaling``: sessions up to ``scaling.conversations`` (subagents count), their starts and
    every request."""
    by_cid = {c.cid: c for c in conversations}
    planned: dict[str, ReplayConversation] = {}
    left_out: dict[str, str] = {}
    sessions = 0
    for trace in conversations:
        if scaling.conversations is not None and len(planned) >= scaling.conversations:
            left_out[trace.cid] = f"over the cap of {scaling.conversations} conversations"
            continue
        parent = by_cid.get(trace.parent) if trace.parent is not None else None
        if parent is None:
            start = sessions * scaling.stagger_s
            sessions += 1
        elif parent.cid not in planned:
            left_out[trace.cid] = f"its parent {parent.cid} is not replayed"
            continue
        else:
            mine = planned[parent.cid]
            cut_at = len(mine.requests)
            if cut_at < len(parent.requests) and \
                    trace.start_s > parent.requests[cut_at].arrival_s:
                left_out[trace.cid] = (
                    f"starts after {parent.cid}'s request {cut_at}, which is not replayed "
                    "(raise --max-requests)")
                continue
            start = mine.start_s + _compressed(parent, trace.start_s, scaling)
        planned[trace.cid] = plan_conversation(trace, scaling, start)
    if not planned:
        raise ValueError("no conversation to replay")
    return ReplayPlan(scaling, tuple(planned.values()), left_out)
