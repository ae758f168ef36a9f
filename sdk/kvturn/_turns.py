"""Reuse visibility: what each turn reused (from the router's headers) and per-conversation sums."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import httpx2

from kvturn._constants import (
    HEADER_CONVERSATION_ECHO,
    HEADER_REQUEST_ID,
    HEADER_REUSE,
    HEADER_REUSED_TOKENS,
    REUSED_OUTCOMES,
    UNREPORTED,
)


class TurnInfo(NamedTuple):
    """The router's report on one turn, read from the response headers (immutable).

    Available as soon as the response starts: for a stream, before the first chunk.

    >>> conversation.chat.completions.create(model="m", messages=messages)  # doctest: +SKIP
    >>> conversation.last_turn.reuse, conversation.last_turn.reused_tokens  # doctest: +SKIP
    ('hit', 4096)
    """

    # A NamedTuple rather than a frozen dataclass: one is built per turn, and a frozen
    # dataclass's __init__ costs several times more.

    conversation_id: str
    """The id the SDK sent."""
    api: Literal["chat", "completions", "responses"]
    reuse: str | None
    """``X-KVTurn-Reuse``: ``hit``, ``partial``, ``miss``, ``expired``, ``stale``,
    ``below-threshold``, ``unverified`` or ``disabled``; None when the server sent no report
    (e.g. a plain vLLM server instead of the kvturn router)."""
    reused_tokens: int
    """``X-KVTurn-Reused-Tokens``: prompt tokens whose KV was read from the decode."""
    no_reuse_reason: str | None
    """Why the SDK asked the router not to reuse (``X-KVTurn-No-Reuse``), or None."""
    router_conversation: str | None
    """``X-KVTurn-Conversation``: the id the router used (an echo of ``conversation_id``)."""
    request_id: str | None
    attempts: int
    """1 plus the number of retries this turn took."""
    streamed: bool

    @property
    def reused(self) -> bool:
        """True when some of the prompt's KV came from the retained conversation."""
        return self.reuse in REUSED_OUTCOMES or self.reused_tokens > 0

    @classmethod
    def from_headers(cls, headers: httpx2.Headers, *, conversation_id: str,
                     api: Literal["chat", "completions", "responses"], no_reuse_reason: str | None,
                     attempts: int, streamed: bool) -> TurnInfo:
        # One pass over the raw headers: httpx2's Headers.get re-scans the list per name.
        found: dict[bytes, bytes] = {}
        for name, value in headers.raw:
            key = name.lower()
            if key in _REPORT_HEADERS:
                found[key] = value
        tokens = found.get(_REUSED_TOKENS_KEY)
        try:
            reused_tokens = max(int(tokens), 0) if tokens is not None else 0
        except ValueError:
            reused_tokens = 0  # a malformed report must not fail the user's turn
        return cls(conversation_id, api, _text(found.get(_REUSE_KEY)), reused_tokens,
                   no_reuse_reason, _text(found.get(_ECHO_KEY)),
                   _text(found.get(_REQUEST_ID_KEY)), attempts, streamed)


_REUSE_KEY = HEADER_REUSE.lower().encode()
_REUSED_TOKENS_KEY = HEADER_REUSED_TOKENS.lower().encode()
_ECHO_KEY = HEADER_CONVERSATION_ECHO.lower().encode()
_REQUEST_ID_KEY = HEADER_REQUEST_ID.lower().encode()
_REPORT_HEADERS = frozenset({_REUSE_KEY, _REUSED_TOKENS_KEY, _ECHO_KEY, _REQUEST_ID_KEY})


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


@dataclass(frozen=True, slots=True)
class ConversationStats:
    """A snapshot of one conversation's counters (forks have their own)."""

    turns: int
    """Turns the router answered (a stream counts when its response starts)."""
    reused_tokens: int
    outcomes: Mapping[str, int]
    """Turns per ``X-KVTurn-Reuse`` value (``"unreported"`` when the header was absent)."""
    no_reuse: Mapping[str, int]
    """Turns the SDK sent with ``X-KVTurn-No-Reuse``, per reason."""
    retries: int
    keepalives: int
    """Lease renewals that succeeded (heartbeat and explicit ``keepalive()``)."""
    keepalive_failures: int
    release_failures: int

    @property
    def hits(self) -> int:
        """Turns that reused some KV (``hit`` or ``partial``)."""
        return sum(n for outcome, n in self.outcomes.items() if outcome in REUSED_OUTCOMES)

    @property
    def misses(self) -> Mapping[str, int]:
        """Turns that reused nothing, per reason: ``miss``, ``expired``, ``stale``,
        ``below-threshold``, ``unverified``, ``disabled``, ``unreported``."""
        return MappingProxyType({outcome: n for outcome, n in self.outcomes.items()
                                 if outcome not in REUSED_OUTCOMES})


@dataclass(frozen=True, slots=True)
class Lease:
    """The router's answer to a keepalive: the retention and how long it now lives."""

    conversation_id: str
    retained: bool
    expires_in: float | None
    hold_remaining: float | None
    num_tokens: int | None

    @classmethod
    def from_json(cls, conversation_id: str, body: Any) -> Lease:
        data = body if isinstance(body, dict) else {}

        def number(name: str) -> float | None:
            value = data.get(name)
            return float(value) if isinstance(value, int | float) else None

        tokens = data.get("num_tokens")
        return cls(conversation_id=str(data.get("conversation_id", conversation_id)),
                   retained=bool(data.get("retained", True)), expires_in=number("expires_in"),
                   hold_remaining=number("hold_remaining"),
                   num_tokens=tokens if isinstance(tokens, int) else None)


class TurnReport:
    """A turn's response headers, parsed into a ``TurnInfo`` only when someone asks.

    Every turn makes one and most are never read one by one, so the parsing waits for
    ``last_turn`` or ``stats`` (kvturn's per-call budget is tens of microseconds).
    """

    __slots__ = ("_args", "_headers", "_info")

    def __init__(self, headers: httpx2.Headers, *, conversation_id: str,
                 api: Literal["chat", "completions", "responses"], no_reuse_reason: str | None,
                 attempts: int, streamed: bool) -> None:
        self._headers = headers
        self._args = (conversation_id, api, no_reuse_reason, attempts, streamed)
        self._info: TurnInfo | None = None

    def info(self) -> TurnInfo:
        if self._info is None:
            conversation_id, api, reason, attempts, streamed = self._args
            self._info = TurnInfo.from_headers(self._headers, conversation_id=conversation_id,
                                               api=api, no_reuse_reason=reason,
                                               attempts=attempts, streamed=streamed)
        return self._info


# Reports waiting to be counted are folded in at least this often, to bound their memory.
_FOLD_AT = 64


@dataclass(slots=True)
class StatsCounter:
    """The mutable counters behind ``ConversationStats``; updated from the caller's thread and
    from the keepalive thread, hence the lock (the conversation's own, which it holds when it
    records a turn). Turns are queued as raw reports and counted when a snapshot is taken (or
    every ``_FOLD_AT`` turns)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    turns: int = 0
    reused_tokens: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    no_reuse: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    keepalives: int = 0
    keepalive_failures: int = 0
    release_failures: int = 0
    pending: list[TurnReport] = field(default_factory=list)

    def turn_locked(self, report: TurnReport) -> None:
        """Count a turn; the caller holds ``lock``."""
        self.pending.append(report)
        if len(self.pending) >= _FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        for report in self.pending:
            info = report.info()
            self.turns += 1
            self.reused_tokens += info.reused_tokens
            self.outcomes[info.reuse or UNREPORTED] += 1
            if info.no_reuse_reason is not None:
                self.no_reuse[info.no_reuse_reason] += 1
        self.pending.clear()

    def add(self, name: Literal["retries", "keepalives", "keepalive_failures",
                                "release_failures"]) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)

    def snapshot(self) -> ConversationStats:
        with self.lock:
            self._fold()
            return ConversationStats(
                turns=self.turns, reused_tokens=self.reused_tokens,
                outcomes=MappingProxyType(dict(self.outcomes)),
                no_reuse=MappingProxyType(dict(self.no_reuse)), retries=self.retries,
                keepalives=self.keepalives, keepalive_failures=self.keepalive_failures,
                release_failures=self.release_failures)
