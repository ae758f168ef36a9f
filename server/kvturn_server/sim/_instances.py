"""The simulated vLLM instances: what each holds in KV, and its queue.

A decode owns the connector's own :class:`RetentionTable` (clock injected) and a block
allocator of its capacity; a prefill owns a prefix cache (least recently used conversations,
whole prompts, as vLLM's prefix cache holds them until other work needs the blocks) and a
first-in first-out compute queue. Block hashes are synthetic but keep the property the reuse
decision relies on: equal exactly where two prompts share history (block 0 names the
conversation and its history's version; later blocks are shared objects, so a prompt's hashes
cost one list slice).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from kvturn_server.connector._hashing import HASH_SIZE
from kvturn_server.connector._retention import Retention, RetentionTable
from kvturn_server.sim._config import Policy

_POOL: list[bytes] = []


def prompt_hashes(first: bytes, full_blocks: int) -> list[bytes]:
    """One hash per full block of a conversation's prompt: ``first`` then the shared chain."""
    if full_blocks <= 0:
        return []
    while len(_POOL) < full_blocks:
        _POOL.append(hashlib.blake2b(len(_POOL).to_bytes(8, "little"),
                                     digest_size=HASH_SIZE).digest())
    hashes = _POOL[:full_blocks]
    hashes[0] = first
    return hashes


SHARED_SYSTEM = b"kvturn-sim/shared-system-prompt"[:HASH_SIZE]


def conversation_hash(cid: str) -> bytes:
    return hashlib.blake2b(b"kvturn-sim/" + cid.encode(), digest_size=HASH_SIZE).digest()


class SimDecode:
    """One decode: its retention table, free blocks, live requests and waiting legs."""

    def __init__(self, name: str, capacity: int, policy: Policy, *, max_num_seqs: int,
                 clock: Callable[[], float]) -> None:
        self.name = name
        self.capacity = capacity
        self.max_num_seqs = max_num_seqs
        budget = int(capacity * policy.budget) if policy.retain else 0
        self.table = RetentionTable(budget_blocks=budget, ttl=policy.ttl_s,
                                    max_hold=policy.max_hold_s, clock=clock)
        self._free = list(range(capacity - 1, -1, -1))
        # Blocks held by more than one owner (a live request extending the retention it
        # continues shares its blocks, as vLLM's prefix cache does): id -> owners.
        self._owners: dict[int, int] = {}
        self.live = 0
        self.waiting: deque[Any] = deque()
        self.evicted_for_live = 0

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        """The free block ids (for checks: every block is free or owned, never both)."""
        return list(self._free)

    def give_back(self, retentions: list[Retention]) -> None:
        """Return dropped retentions' blocks to the allocator (what the connector does)."""
        for retention in retentions:
            self.free(retention.block_ids)

    def free(self, block_ids: tuple[int, ...]) -> None:
        """Drop one owner of each block; a block with no owner left is free."""
        owners = self._owners
        if not owners:
            self._free.extend(block_ids)
            return
        for block in block_ids:
            n = owners.get(block)
            if n is None:
                self._free.append(block)
            elif n == 2:
                del owners[block]
            else:
                owners[block] = n - 1

    def allocate(self, blocks: int, shared: tuple[int, ...] = ()) -> tuple[int, ...] | None:
        """Blocks for a live request: ``shared`` (a retained prefix it extends, now owned by
        both) then new ones, evicting retentions if needed (never starve live work); None when
        even that is not enough (the request waits)."""
        if self.live >= self.max_num_seqs or blocks > self.capacity:
            return None
        # Own the shared prefix first: an eviction below may drop the retention holding it.
        for block in shared:
            self._owners[block] = self._owners.get(block, 1) + 1
        new = blocks - len(shared)
        self.give_back(self.table.expire())
        short = new - len(self._free)
        if short > 0:
            evicted = self.table.evict_for(short)
            self.evicted_for_live += len(evicted)
            self.give_back(evicted)
            if new > len(self._free):
                self.free(shared)
                return None
        ids = shared + tuple(self._free[len(self._free) - new:])
        del self._free[len(self._free) - new:]
        self.live += 1
        return ids


class SimPrefill:
    """One prefill: a prefix cache of whole prompts (LRU) and a FIFO compute queue."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.busy_until = 0.0
        self.busy_s = 0.0
        self._cache: OrderedDict[bytes, int] = OrderedDict()
        self._held = 0

    def cached_blocks(self, first: bytes) -> int:
        """Full blocks of this conversation's last prompt (or of the shared system prompt,
        under its own key) still in the prefix cache."""
        blocks = self._cache.get(first)
        if blocks is None:
            return 0
        self._cache.move_to_end(first)
        return blocks

    def remember(self, first: bytes, blocks: int) -> None:
        """The prompt just computed stays cached until newer work pushes it out."""
        old = self._cache.pop(first, 0)
        self._held -= old
        if blocks <= 0 or blocks > self.capacity:
            return
        while self._held + blocks > self.capacity and self._cache:
            _, dropped = self._cache.popitem(last=False)
            self._held -= dropped
        self._cache[first] = blocks
        self._held += blocks
