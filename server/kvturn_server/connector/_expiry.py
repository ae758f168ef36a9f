"""Lease deadlines, soonest first, for the retention table (``_retention.py``).

A heap with lazy deletion: a renewal pushes a new entry instead of searching the heap for the
old one, and an entry is current only while it carries the key's latest sequence number. Apart
from the table because it is a data structure, not a rule: the table decides what expires and
when, this only answers "which deadline comes first" in O(log n).
"""

from __future__ import annotations

import heapq


class ExpiryQueue:
    """One deadline per key; ``first`` is the soonest current one."""

    def __init__(self) -> None:
        # (expires_at, sequence, key); superseded entries stay until they reach the top.
        self._heap: list[tuple[float, int, str]] = []
        # key -> (expires_at, sequence) of its current entry.
        self._current: dict[str, tuple[float, int]] = {}
        self._next_seq = 0

    def __len__(self) -> int:
        """Entries in the heap, superseded ones included (what the rebuild bounds)."""
        return len(self._heap)

    def schedule(self, key: str, expires_at: float) -> None:
        """Set (or move) ``key``'s deadline."""
        seq = self._next_seq
        self._next_seq += 1
        self._current[key] = (expires_at, seq)
        heapq.heappush(self._heap, (expires_at, seq, key))
        # Superseded entries only leave the heap when they reach its top; with long leases and
        # frequent keepalives they would pile up, so rebuild once they dominate.
        if len(self._heap) > 2 * len(self._current) + 64:
            self._heap = [(when, s, k) for k, (when, s) in self._current.items()]
            heapq.heapify(self._heap)

    def discard(self, key: str) -> None:
        """Forget ``key``'s deadline (it must have one)."""
        del self._current[key]

    def pop_first(self) -> None:
        """Take the entry ``first`` just returned off the heap; the caller discards its key."""
        heapq.heappop(self._heap)

    def first(self) -> tuple[float, str] | None:
        """The soonest current deadline and its key, or None; superseded entries on top go."""
        heap = self._heap
        while heap:
            expires_at, seq, key = heap[0]
            current = self._current.get(key)
            if current is not None and current[1] == seq:
                return expires_at, key
            heapq.heappop(heap)  # superseded by a renewal, or the retention is gone
        return None
