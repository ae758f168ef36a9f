"""Reuse visibility: what each turn reused (from the router's headers) and per-conversation sums."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import httpx2

from kvturn._constants import UNREPORTED
from kvturn.wire import (
    HEADER_BLOCK_SIZE,
    HEADER_CONVERSATION_ECHO,
    HEADER_REQUEST_ID,
    HEADER_REUSE,
    HEADER_REUSED_TOKENS,
    PENDING,
    REUSED_OUTCOMES,
)


class TurnInfo(NamedTuple):
    """The router's report on one turn, read from the response headers (immutable).

    Available as soon as the response starts: for a stream, before the first chunk. A stream
    the decode continued alone (no prefill leg) is ``pending`` then: what the decode's cache
    supplied is known only once it has run. When the call asked for usage
    (``stream_options={"include_usage": True}``) the conversation's ``last_turn`` and
    ``stats`` are settled from the stream's usage event once it has been read (``settled``).

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
    ``below-threshold``, ``unverified``, ``disabled`` or ``pending`` (not known yet); None
    when the server sent no report (e.g. a plain vLLM server instead of the kvturn router)."""
    reused_tokens: int
    """``X-KVTurn-Reused-Tokens``: prompt tokens whose KV was read from the decode (on a turn
    the decode continued alone, supplied by its own cache)."""
    no_reuse_reason: str | None
    """The caller's own ``X-KVTurn-No-Reuse`` value when it sent one (an explicit opt-out:
    the router then reports ``disabled``), else None. The SDK never sends that header itself:
    an edited history reuses its verified prefix."""
    router_conversation: str | None
    """``X-KVTurn-Conversation``: the id the router used (an echo of ``conversation_id``)."""
    request_id: str | None
    attempts: int
    """1 plus the number of retries this turn took."""
    streamed: bool
    block_size: int | None = None
    """``X-KVTurn-Block-Size``, sent with ``pending``: what tells ``hit`` from ``partial``."""

    @property
    def reused(self) -> bool:
        """True when some of the prompt's KV came from the retained conversation."""
        return self.reuse in REUSED_OUTCOMES or self.reused_tokens > 0

    def settled(self, prompt_tokens: int, cached_tokens: int) -> TurnInfo:
        """This report settled by the decode's usage (``prompt_tokens`` and
        ``prompt_tokens_details.cached_tokens``) when it is ``pending``, else unchanged: as the
        router settles it, ``hit`` when the cached tokens cover every full block of all but the
        last prompt token, ``partial`` when some (any, without a block size), ``miss`` when
        none."""
        if self.reuse != PENDING:
            return self
        cached = max(0, min(cached_tokens, prompt_tokens))
        size = self.block_size or 0
        if cached == 0:
            reuse = "miss"
        elif size > 0 and cached >= (prompt_tokens - 1) // size * size:
            reuse = "hit"
        else:
            reuse = "partial"
        return self._replace(reuse=reuse, reused_tokens=cached)

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
        reuse = _text(found.get(_REUSE_KEY))
        size = _count(found.get(_BLOCK_SIZE_KEY)) if reuse == PENDING else 0
        return cls(conversation_id, api, reuse, _count(found.get(_REUSED_TOKENS_KEY)),
                   no_reuse_reason, _text(found.get(_ECHO_KEY)),
                   _text(found.get(_REQUEST_ID_KEY)), attempts, streamed, size or None)


_REUSE_KEY = HEADER_REUSE.lower().encode()
_REUSED_TOKENS_KEY = HEADER_REUSED_TOKENS.lower().encode()
_ECHO_KEY = HEADER_CONVERSATION_ECHO.lower().encode()
_REQUEST_ID_KEY = HEADER_REQUEST_ID.lower().encode()
_BLOCK_SIZE_KEY = HEADER_BLOCK_SIZE.lower().encode()
_REPORT_HEADERS = frozenset({_REUSE_KEY, _REUSED_TOKENS_KEY, _ECHO_KEY, _REQUEST_ID_KEY,
                             _BLOCK_SIZE_KEY})


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


def _count(value: bytes | None) -> int:
    try:
        return max(int(value), 0) if value is not None else 0
    except ValueError:
        return 0  # a malformed report must not fail the user's turn


@dataclass(frozen=True, slots=True)
class ConversationStats:
    """A snapshot of one conversation's counters (forks have their own)."""

    turns: int
    """Turns the router answered (a stream counts when its response starts)."""
    reused_tokens: int
    outcomes: Mapping[str, int]
    """Turns per ``X-KVTurn-Reuse`` value (``"unreported"`` when the header was absent)."""
    no_reuse: Mapping[str, int]
    """Turns the caller sent with its own ``X-KVTurn-No-Reuse``, per value (see
    ``TurnInfo.no_reuse_reason``)."""
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
        ``below-threshold``, ``unverified``, ``disabled``, ``unreported``; and ``pending``,
        streams whose reuse the SDK never learned (no usage asked for)."""
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

    __slots__ = ("_args", "_headers", "_info", "counted")

    def __init__(self, headers: httpx2.Headers, *, conversation_id: str,
                 api: Literal["chat", "completions", "responses"], no_reuse_reason: str | None,
                 attempts: int, streamed: bool) -> None:
        self._headers = headers
        self._args = (conversation_id, api, no_reuse_reason, attempts, streamed)
        self._info: TurnInfo | None = None
        self.counted = False  # in the counters (StatsCounter._fold)

    def info(self) -> TurnInfo:
        if self._info is None:
            conversation_id, api, reason, attempts, streamed = self._args
            self._info = TurnInfo.from_headers(self._headers, conversation_id=conversation_id,
                                               api=api, no_reuse_reason=reason,
                                               attempts=attempts, streamed=streamed)
        return self._info

    def settle(self, prompt_tokens: int, cached_tokens: int) -> tuple[TurnInfo, TurnInfo] | None:
        """Settle a ``pending`` report from the decode's usage; (before, after) when that
        changed it."""
        before = self.info()
        after = before.settled(prompt_tokens, cached_tokens)
        if after is before:
            return None
        self._info = after
        return before, after


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
            report.counted = True
            self.turns += 1
            self.reused_tokens += info.reused_tokens
            self.outcomes[info.reuse or UNREPORTED] += 1
            if info.no_reuse_reason is not None:
                self.no_reuse[info.no_reuse_reason] += 1
        self.pending.clear()

    def settle_locked(self, report: TurnReport, prompt_tokens: int, cached_tokens: int) -> None:
        """Settle a ``pending`` turn from its stream's usage (``TurnInfo.settled``), in the
        counters too when it was counted already; the caller holds ``lock``."""
        changed = report.settle(prompt_tokens, cached_tokens)
        if changed is None or not report.counted:
            return
        before, after = changed
        self.reused_tokens += after.reused_tokens - before.reused_tokens
        old = before.reuse or UNREPORTED
        self.outcomes[old] -= 1
        if not self.outcomes[old]:
            del self.outcomes[old]
        self.outcomes[after.reuse or UNREPORTED] += 1

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
