"""Retentions a decode dropped on its own, numbered, so that routers can follow them.

A retention that is evicted (over the budget, or live requests needed its blocks) or expires
leaves the decode without the router being asked. A router that still records it would send
the conversation's next turn to continue on that decode, which then recomputes the history.
Routers follow this log instead (``GET /kvturn/v1/lost?after=N&wait=S``, docs/http-api.md C):
each entry has a sequence number, and a request waits up to ``wait`` seconds for entries after
``after`` (a long poll: one request per burst of evictions, not one per turn). Pure Python and
threads; no vLLM.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LostSince:
    """What :meth:`LostLog.since` answers.

    Attributes:
        seq: the last entry's number (the cursor for the next call).
        lost: ``(key, reason, read id)`` of the entries after the caller's cursor, oldest
            first; the read id is the retention's ``remote_request_id`` in its read params, so
            a router tells the retention it recorded from a newer one under the same key.
        truncated: entries after the cursor were dropped before this call (the log keeps the
            last ``capacity``), or the cursor is not from this log (a restarted engine).
    """

    seq: int
    lost: list[tuple[str, str, str]]
    truncated: bool


class LostLog:
    """The last ``capacity`` retentions dropped on their own, numbered from 1."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._cond = threading.Condition()
        self._seq = 0
        self._entries: deque[tuple[int, str, str, str]] = deque(maxlen=capacity)

    def add(self, lost: Iterable[tuple[str, str, str]]) -> None:
        with self._cond:
            added = False
            for key, reason, read_id in lost:
                self._seq += 1
                self._entries.append((self._seq, key, str(reason), read_id))
                added = True
            if added:
                self._cond.notify_all()

    def since(self, after: int, wait: float = 0.0) -> LostSince:
        """Entries after ``after``, waiting up to ``wait`` seconds for one when there is none."""
        with self._cond:
            if after > self._seq or after < 0:
                return LostSince(self._seq, [], True)
            if wait > 0 and after == self._seq:
                self._cond.wait_for(lambda: self._seq > after, timeout=wait)
            oldest = self._entries[0][0] if self._entries else self._seq + 1
            lost = [(key, reason, read_id) for seq, key, reason, read_id in self._entries
                    if seq > after]
            return LostSince(self._seq, lost, after + 1 < oldest and after < self._seq)
