"""Router state: which decode holds each conversation's last retained turn.

One interface, two implementations with the same semantics (one test suite runs against both):
``MemoryStore`` (default: this process only) and ``RedisStore`` (``--state redis://...``:
shared by router replicas, kept across restarts; in ``_state_redis.py``).

Semantics, for both:

- Each entry has a *deadline*: the lease's ``expires_at`` plus ``remember_expired`` seconds. Up
  to the deadline ``get`` returns the entry (the turn logic tells "expired" from "miss" by it);
  from the deadline on the entry is gone (``get`` returns None, ``purge`` removes it).
- The table is bounded: ``put`` beyond ``max_entries`` evicts the least recently used entries
  (``get`` and ``put`` count as use) and says how many went.
- ``delete(key, turn=...)`` deletes only the entry that turn recorded, so a turn that found a
  stale handle cannot delete a newer one recorded meanwhile by a concurrent turn.
- ``put`` is a compare-and-set on ``Placement.version`` (when its turn began, store clock:
  the later of two concurrent turns carries the longer history, however long its capture
  took): a placement older than the live one is not written (``SUPERSEDED``). Two turns of one
  conversation running at once, on two router replicas or one, thus keep the newest retention,
  whichever router writes last.
- Times come from one injected clock (wall-clock seconds; Redis shares them between replicas).

The store is a hint, never the authority: the decode's pin answer is. A lost or stale entry
costs one turn's reuse, never a wrong answer.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvturn_server.router import _json
from kvturn_server.router._history import History


class StoreError(Exception):
    """The state store could not be reached or answered nonsense."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a conversation's last turn is retained, and what served it.

    Attributes:
        decode: base URL of the decode that holds it.
        engine_id: that decode's engine id when it retained (a restart changes it).
        num_tokens: tokens retained.
        expires_at: store-clock time the lease runs out unless renewed.
        turn: request id of the turn that recorded this placement.
        readable_tokens: of ``num_tokens``, those in full blocks (what a prefix cache or a
            read can use); None when the decode did not say.
        block_size: tokens per KV block on the decode (0: unknown).
        prefill: base URL of the prefill that computed the conversation's last prefill leg
            (its prefix cache likely still holds that prompt); None when none did.
        prefill_tokens: prompt tokens of that leg.
        history: the messages of the last turn's request (chat only), for the decode's
            continuation of short turns (``_placement.py``).
        version: store-clock time the turn that recorded it began; ``put`` keeps the
            newest.
        retained: False when the decode served the last turn but holds no retention of it
            (never retained: refused over the budget, too short, an opted-out client; or
            gone since: evicted, expired). Its plain prefix cache may still hold the
            conversation, so the record keeps the decode and the history, as a stock router
            would; ``num_tokens`` is then what that decode processed of the last turn (prompt
            and reply) and nothing is pinned.
        lost: why the decode said, after the turn, that the retention is gone (``evicted`` or
            ``expired``: its blocks were freed, and under memory pressure soon reused). The
            record keeps the decode and the prefill for affinity; the next turn continues on
            that decode only if its prefix cache kept enough of the history (``_plan.py``,
            ``plan_probe``).
        read_id: the retention's read id (its params' ``remote_request_id``), which the
            decode's lost log names (``_lost.py``); None when unknown.
    """

    decode: str
    engine_id: str | None
    num_tokens: int
    expires_at: float
    turn: str
    readable_tokens: int | None = None
    block_size: int = 0
    prefill: str | None = None
    prefill_tokens: int = 0
    history: History | None = None
    version: float = 0.0
    retained: bool = True
    lost: str | None = None
    read_id: str | None = None

    def to_json(self) -> bytes:
        data: dict[str, Any] = {
            "decode": self.decode, "engine_id": self.engine_id, "num_tokens": self.num_tokens,
            "expires_at": self.expires_at, "turn": self.turn,
            "readable_tokens": self.readable_tokens, "block_size": self.block_size,
            "prefill": self.prefill, "prefill_tokens": self.prefill_tokens,
            "history": None if self.history is None else self.history.to_dict(),
            "version": self.version, "retained": self.retained, "lost": self.lost,
            "read_id": self.read_id}
        return _json.dumps(data)

    @classmethod
    def from_json(cls, data: bytes | str) -> Placement:
        try:
            raw = _json.loads(data)
            readable = raw.get("readable_tokens")
            prefill = raw.get("prefill")
            # Records written by an older router lack the later fields: they default.
            return cls(decode=str(raw["decode"]),
                       engine_id=None if raw.get("engine_id") is None else str(raw["engine_id"]),
                       num_tokens=int(raw["num_tokens"]), expires_at=float(raw["expires_at"]),
                       turn=str(raw["turn"]),
                       readable_tokens=None if readable is None else int(readable),
                       block_size=int(raw.get("block_size") or 0),
                       prefill=None if prefill is None else str(prefill),
                       prefill_tokens=int(raw.get("prefill_tokens") or 0),
                       history=History.from_dict(raw.get("history")),
                       version=float(raw.get("version") or 0.0),
                       retained=raw.get("retained") is not False,
                       lost=raw["lost"] if isinstance(raw.get("lost"), str) else None,
                       read_id=raw["read_id"] if isinstance(raw.get("read_id"), str) else None)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StoreError(f"unreadable placement record: {exc}") from exc

    @property
    def cached_tokens(self) -> int:
        """Tokens of the retention a prefix cache can use (full blocks); 0 without one."""
        if not self.retained:
            return 0
        return self.num_tokens if self.readable_tokens is None else self.readable_tokens


# What ``put`` returns when the live entry is newer than the one offered.
SUPERSEDED = -1


class ConversationStore(Protocol):
    """Conversation key -> Placement; see the module docstring for the semantics."""

    kind: str

    async def get(self, key: str) -> Placement | None: ...

    async def put(self, key: str, placement: Placement) -> int:
        """Insert or replace unless the live entry is newer (a higher ``version``); returns
        how many entries the cap evicted, or ``SUPERSEDED`` when not written."""
        ...

    async def delete(self, key: str, *, turn: str | None = None) -> bool:
        """Delete (only ``turn``'s entry when given); True when a live entry went."""
        ...

    async def size(self) -> int: ...

    async def purge(self) -> int:
        """Remove entries past their deadline; returns how many."""
        ...

    async def aclose(self) -> None: ...


class MemoryStore:
    """In-process store: an LRU-ordered dict beside a deadline heap (lazy deletion)."""

    kind = "memory"

    def __init__(self, *, max_entries: int = 100_000, remember_expired: float = 600.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.max_entries = max_entries
        self.remember_expired = remember_expired
        self._clock = clock
        # key -> (placement, deadline, seq); first is least recently used.
        self._entries: OrderedDict[str, tuple[Placement, float, int]] = OrderedDict()
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0

    async def get(self, key: str) -> Placement | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry[0]

    async def put(self, key: str, placement: Placement) -> int:
        old = self._entries.get(key)
        if old is not None and old[0].version > placement.version and old[1] > self._clock():
            return SUPERSEDED
        deadline = placement.expires_at + self.remember_expired
        self._seq += 1
        self._entries[key] = (placement, deadline, self._seq)
        self._entries.move_to_end(key)
        heapq.heappush(self._heap, (deadline, self._seq, key))
        evicted = 0
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            evicted += 1
        if len(self._heap) > 2 * len(self._entries) + 1024:
            self._heap = [(d, s, k) for k, (_, d, s) in self._entries.items()]
            heapq.heapify(self._heap)
        return evicted

    async def delete(self, key: str, *, turn: str | None = None) -> bool:
        entry = self._entries.get(key)
        if entry is None or (turn is not None and entry[0].turn != turn):
            return False
        del self._entries[key]
        return entry[1] > self._clock()

    async def size(self) -> int:
        return len(self._entries)

    async def purge(self) -> int:
        now = self._clock()
        removed = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, seq, key = heapq.heappop(heap)
            entry = self._entries.get(key)
            if entry is not None and entry[2] == seq:
                del self._entries[key]
                removed += 1
        return removed

    async def aclose(self) -> None:
        return None
