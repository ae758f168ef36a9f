"""What a trace holds once read: conversations of requests, typed and frozen."""

from __future__ import annotations

from dataclasses import dataclass


class TraceFormatError(ValueError):
    """A trace file that cannot be read as the format it claims: says which file, which
    request and what is wrong."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One model call of a conversation, as recorded."""

    index: int
    """Its position in the conversation (0: the first call)."""
    arrival_s: float
    """When it was sent, in seconds since the trace's start (a subagent's requests count from
    its parent's clock)."""
    gap_s: float
    """The client's time before it (a tool running, the user typing): seconds between the
    previous reply and this request; 0 for a conversation's first request."""
    prompt_tokens: int
    reply_tokens: int
    hash_ids: tuple[int, ...]
    """One id per full ``block_size``-token block of the prompt: two prompts share a prefix
    exactly as far as their ids agree (ids are comparable within one ``scope``)."""
    block_size: int
    shared_blocks: int
    """Leading blocks shared with the previous request of the conversation (0 for the first)."""
    extends: bool
    """The prompt starts with the whole previous prompt (every full block of it): a plain
    follow-up, the previous reply and a new message appended. False for the first request and
    where the history was compacted or edited before its end."""
    shrank: bool
    """The prompt is shorter than the previous one: the client compacted the history."""
    new_tokens: int | None
    """Prompt tokens beyond the previous prompt and its reply (the tool result or user message;
    negative where the client dropped part of the reply, thinking say); None for the first."""
    kind: str = "n"
    """The recorded call type (``n``, ``s``, ...; ``n`` where the format has none)."""
    api_time_s: float | None = None
    """The model's time for the call when it was recorded, where known."""

    @property
    def shared_tokens(self) -> int:
        """Leading tokens shared with the previous request (whole blocks)."""
        return min(self.shared_blocks * self.block_size, self.prompt_tokens)

    @property
    def is_followup(self) -> bool:
        return self.index > 0


@dataclass(frozen=True, slots=True)
class TraceConversation:
    """One conversation: a session, or a subagent of one (a conversation of its own)."""

    cid: str
    """Unique over everything read together: ``<file stem>`` for a session,
    ``<parent cid>/<agent id>`` for a subagent, the JSONL's conversation id prefixed with the
    file stem."""
    source: str
    """The file it was read from."""
    scope: str
    """Conversations of equal scope may share hash ids (a system prompt, say); ids of
    different scopes are unrelated."""
    requests: tuple[TraceRequest, ...]
    parent: str | None = None
    """The cid of the conversation that started it (a subagent's session); None otherwise."""
    agent_type: str | None = None
    system_tokens: int | None = None
    tool_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.requests:
            raise TraceFormatError(f"{self.source}: conversation {self.cid} has no request")

    @property
    def start_s(self) -> float:
        return self.requests[0].arrival_s

    @property
    def is_subagent(self) -> bool:
        return self.parent is not None
