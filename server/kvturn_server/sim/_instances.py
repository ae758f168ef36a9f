"""The simulated vLLM instances: what each holds in KV, and its queue.

Every instance has vLLM's plain prefix cache: a finished request's blocks stay cached, keyed by
their hashes, until their memory is needed, least recently used first (:class:`PrefixCache`). A
decode also owns the connector's own :class:`RetentionTable` (clock injected), which holds
retained blocks out of that cache under a lease; a dropped retention's blocks fall back into
the cache, as the connector's freed blocks fall back into vLLM's free queue with their hashes.
A prefill computes first-in first-out; a decode computes the prompts it continues first-in
first-out too (one GPU). A host tier (:class:`HostTier`, vLLM's CPU offloading) keeps copies of
finished requests' blocks in host memory, least recently used first. On a decode that retains,
the table then runs with ``host_tier``: a retention live requests evict keeps its lease
host-only (no device blocks) until the host tier drops the conversation's first block; then it
is dropped and logged lost, as the connector's keeper does.

Block hashes are synthetic for drawn conversations and the trace's hash ids for replayed ones
(:func:`trace_hashes`); either way equal exactly where two prompts share history.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvturn_server.connector import HASH_SIZE, Retention, RetentionTable, verified_prefix_blocks
from kvturn_server.sim._config import Policy

_POOL: list[bytes] = []


def prompt_hashes(first: bytes, full_blocks: int) -> list[bytes]:
    """One hash per full block of a drawn conversation's prompt: ``first`` (the conversation and
    its history's version) then a chain every conversation shares from block 1 on (one list
    slice, whatever the conversation)."""
    if full_blocks <= 0:
        return []
    while len(_POOL) < full_blocks:
        _POOL.append(hashlib.blake2b(len(_POOL).to_bytes(8, "little"),
                                     digest_size=HASH_SIZE).digest())
    hashes = _POOL[:full_blocks]
    hashes[0] = first
    return hashes


def trace_hashes(scope: int, ids: Sequence[int]) -> list[bytes]:
    """A trace's hash ids as block hashes: equal ids of one scope are equal blocks (ids are 64-bit;
    a reader's made-up ids are negative)."""
    base, mask = scope << 64, (1 << 64) - 1
    return [(base | (i & mask)).to_bytes(HASH_SIZE, "little") for i in ids]


def unique_hashes(name: str, start: int, stop: int) -> list[bytes]:
    """Hashes of blocks ``start`` to ``stop`` that no other block has (``name`` says whose)."""
    return [hashlib.blake2b(f"{name}/{j}".encode(), digest_size=HASH_SIZE).digest()
            for j in range(start, stop)]


SHARED_SYSTEM = b"kvturn-sim/shared-system-prompt"[:HASH_SIZE]


def conversation_hash(cid: str) -> bytes:
    return hashlib.blake2b(b"kvturn-sim/" + cid.encode(), digest_size=HASH_SIZE).digest()


@dataclass(slots=True)
class _Cached:
    ids: list[int]
    hashes: tuple[bytes, ...]


class PrefixCache:
    """vLLM's prefix cache over free blocks: per conversation, the blocks of its last finished
    request with their hashes, least recently used first. Blocks here are free for any
    allocation: taking them evicts the least recently used conversation's, from its tail (vLLM
    frees a request's blocks tail first, so a partly evicted prefix still hits)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, _Cached] = OrderedDict()
        self.blocks = 0
        self.evicted_blocks = 0

    def put(self, key: str, ids: Sequence[int], hashes: Sequence[bytes]) -> list[int]:
        """Cache ``ids`` (in prefix order) under ``key``; return the ids of an older entry of
        ``key`` (stale now: they go back to the allocator)."""
        old = self._entries.pop(key, None)
        self._entries[key] = _Cached(list(ids), tuple(hashes[:len(ids)]))
        self.blocks += len(ids)
        if old is None:
            return []
        self.blocks -= len(old.ids)
        return old.ids

    def take(self, key: str, hashes: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """A request's hit: ``(the verified prefix's ids, now the request's; the entry's other
        ids, stale)``. The entry leaves the cache."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return [], []
        self.blocks -= len(entry.ids)
        verified = verified_prefix_blocks(hashes, entry.hashes)
        return entry.ids[:verified], entry.ids[verified:]

    def peek(self, key: str, hashes: Sequence[bytes]) -> int:
        """Blocks of ``hashes`` the cache would supply (no change)."""
        entry = self._entries.get(key)
        return 0 if entry is None else verified_prefix_blocks(hashes, entry.hashes)

    def ids(self) -> list[int]:
        """Every cached block (for checks)."""
        return [b for entry in self._entries.values() for b in entry.ids]

    def hashes(self, key: str) -> tuple[bytes, ...]:
        """The hashes cached under ``key`` (empty when none)."""
        entry = self._entries.get(key)
        return () if entry is None else entry.hashes

    def evict(self, needed: int) -> list[int]:
        """Up to ``needed`` blocks, the least recently used conversation's tail first."""
        out: list[int] = []
        while len(out) < needed and self._entries:
            key, entry = next(iter(self._entries.items()))
            take = min(needed - len(out), len(entry.ids))
            out.extend(entry.ids[len(entry.ids) - take:])
            del entry.ids[len(entry.ids) - take:]
            entry.hashes = entry.hashes[:len(entry.ids)]
            if not entry.ids:
                del self._entries[key]
        self.blocks -= len(out)
        self.evicted_blocks += len(out)
        return out


class HostTier:
    """Host memory holding copies of finished requests' blocks (vLLM's CPU KV offloading): per
    conversation its latest blocks' hashes, least recently used first, up to ``capacity``
    blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[bytes, ...]] = OrderedDict()
        self.blocks = 0

    def store(self, key: str, hashes: Sequence[bytes]) -> list[str]:
        """Keep a copy of ``key``'s latest blocks (replacing its older one), evicting the least
        recently used conversations' copies to make room; returns the conversations whose copy
        is gone now (evicted, or ``key``'s when too large to keep)."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.blocks -= len(old)
        if not hashes or len(hashes) > self.capacity:
            return [key]
        gone = []
        while self.blocks + len(hashes) > self.capacity and self._entries:
            evicted, dropped = self._entries.popitem(last=False)
            self.blocks -= len(dropped)
            gone.append(evicted)
        self._entries[key] = tuple(hashes)
        self.blocks += len(hashes)
        return gone

    def lookup(self, key: str, hashes: Sequence[bytes]) -> int:
        """Verified blocks of ``hashes`` held here (a use: most recently used now)."""
        held = self._entries.get(key)
        if held is None:
            return 0
        self._entries.move_to_end(key)
        return verified_prefix_blocks(hashes, held)

    def resident(self, key: str, hashes: Sequence[bytes]) -> int:
        """Verified blocks of ``hashes`` held here, from the start (no use: what the connector
        asks of its host tier, ``resident_tokens``)."""
        held = self._entries.get(key)
        return 0 if held is None else verified_prefix_blocks(hashes, held)


@dataclass(frozen=True, slots=True)
class Admission:
    """A decode leg's blocks and where its prefix came from."""

    block_ids: tuple[int, ...]
    verified: int
    """Leading blocks of the prompt the decode already held (retention or prefix cache)."""
    retained: bool
    """They came from the conversation's retention."""


class SimDecode:
    """One decode: its retention table, prefix cache, free blocks, live requests and waiting
    legs, and the compute queue of the prompts it continues."""

    def __init__(self, name: str, capacity: int, policy: Policy, *, max_num_seqs: int,
                 clock: Callable[[], float], host_blocks: int = 0) -> None:
        self.name = name
        self.capacity = capacity
        self.max_num_seqs = max_num_seqs
        budget = int(capacity * policy.budget) if policy.retain else 0
        self.host = HostTier(host_blocks) if host_blocks else None
        # With a host tier a retention live requests evict keeps its lease there, host-only
        # (the connector's table with ``host_tier``), until the host tier drops its copy too.
        self.table = RetentionTable(budget_blocks=budget, ttl=policy.ttl_s,
                                    max_hold=policy.max_hold_s, clock=clock,
                                    host_tier=self.host is not None and policy.retain)
        self.cache = PrefixCache()
        self._free = list(range(capacity - 1, -1, -1))
        # Blocks held by more than one owner (a live request extending the retention it
        # continues shares its blocks, as vLLM's prefix cache does): id -> owners.
        self._owners: dict[int, int] = {}
        self.live = 0
        self.waiting: deque[Any] = deque()
        self.evicted_for_live = 0
        self.busy_until = 0.0
        self.busy_s = 0.0

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones and the prefix cache's."""
        return len(self._free) + self.cache.blocks

    def free_ids(self) -> list[int]:
        """The blocks not owned by a request or a retention (for checks)."""
        return list(self._free) + self.cache.ids()

    def give_back(self, retentions: list[Retention]) -> None:
        """Dropped retentions' blocks fall back into the prefix cache (what the connector's
        freed blocks do in vLLM's free queue); blocks another owner still holds stay held."""
        for retention in retentions:
            if not retention.on_device:
                continue  # a host-only lease ended: no device blocks (and none of the cache's)
            unowned = self._release(retention.block_ids)
            if len(unowned) == len(retention.block_ids):
                self._free.extend(self.cache.put(retention.key, unowned,
                                                 retention.block_hashes))
            else:
                self._free.extend(unowned)

    def finish(self, key: str, block_ids: tuple[int, ...], hashes: Sequence[bytes]) -> None:
        """A finished request nothing retains: its blocks stay in the prefix cache."""
        unowned = self._release(block_ids)
        if len(unowned) == len(block_ids):
            self._free.extend(self.cache.put(key, unowned, hashes))
        else:
            self._free.extend(unowned)

    def free(self, block_ids: tuple[int, ...]) -> None:
        """Drop one owner of each block; a block with no owner left is free (uncached)."""
        self._free.extend(self._release(block_ids))

    def _release(self, block_ids: tuple[int, ...]) -> list[int]:
        owners = self._owners
        if not owners:
            return list(block_ids)
        out = []
        for block in block_ids:
            n = owners.get(block)
            if n is None:
                out.append(block)
            elif n == 2:
                del owners[block]
            else:
                owners[block] = n - 1
        return out

    def peek(self, key: str, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` this decode holds now on the device (retention or
        prefix cache)."""
        retention = self.table.get(key)
        if retention is not None and retention.on_device:
            return verified_prefix_blocks(hashes, retention.block_hashes)
        return self.cache.peek(key, hashes)

    def host_tokens(self, key: str, block_size: int) -> int:
        """What a pin's 404 says of ``key``'s live retention when it is host-only: the tokens
        of it the host tier holds from its start (the keeper's ``_placed``, capped at the
        retention's tokens); 0 when it is not host-only, or its host copy is gone (then it is
        dropped and logged lost, as the keeper does)."""
        retention = self._host_only(key)
        if retention is None:
            return 0
        assert self.host is not None
        return min(self.host.resident(key, retention.block_hashes) * block_size,
                   retention.num_tokens)

    def host_readable(self, key: str, block_size: int) -> tuple[bytes, ...]:
        """The hashes of ``key``'s host-only retention that its host tier holds from the start:
        what a pin with ``host_reads`` offers a prefill to read from host memory (the keeper's
        host rows, ``offload/_reads.py``); empty when it is not host-only."""
        tokens = self.host_tokens(key, block_size)
        retention = self.table.get(key) if tokens else None
        return () if retention is None else retention.block_hashes[:tokens // block_size]

    def keep_in_host(self, key: str, hashes: Sequence[bytes]) -> list[str]:
        """A finished request's blocks copied to the host tier (vLLM's offloading stores every
        computed block); returns the conversations whose host copy went (:meth:`host_lost`)."""
        return [] if self.host is None else self.host.store(key, hashes)

    def host_lost(self, keys: Sequence[str]) -> None:
        """The host tier no longer holds these conversations' first blocks: a host-only
        retention of one promises nothing now, and is dropped and logged lost (the keeper's
        ``lost_in_host``, then ``_placed``: ``RetentionTable.drop_lost``); the router reads it
        in the lost log."""
        for key in keys:
            self._host_only(key)

    def _host_only(self, key: str) -> Retention | None:
        """``key``'s live host-only retention while the host tier holds its first block; one
        whose host copy is gone is dropped and logged lost (``drop_lost``)."""
        retention = self.table.get(key)
        if retention is None or retention.on_device or self.host is None:
            return None
        if self.host.resident(key, retention.block_hashes):
            return retention
        self.table.drop_lost(key, retention.request_id)
        return None

    def admit(self, key: str, hashes: Sequence[bytes], blocks: int) -> Admission | None:
        """Blocks for a live request of ``blocks`` blocks whose prompt has ``hashes``: the
        verified prefix the decode holds (the retention's, shared; else the prefix cache's,
        taken) then new ones, evicting retentions if needed (never starve live work); None when
        even that is not enough (the request waits)."""
        if self.live >= self.max_num_seqs or blocks > self.capacity:
            return None
        retention = self.table.touch(key)
        if retention is not None and not retention.on_device:
            # Host-only: nothing on the device to share; what the evicted blocks left in the
            # prefix cache still hits, and the host tier loads the rest (the engine's lookup).
            retention = None
        shared: tuple[int, ...] = ()
        cached: list[int] = []
        if retention is not None:
            verified = verified_prefix_blocks(hashes, retention.block_hashes)
            shared = retention.block_ids[:verified]
            # Own the shared prefix first: an eviction below may drop the retention.
            for block in shared:
                self._owners[block] = self._owners.get(block, 1) + 1
        else:
            entry_hashes = self.cache.hashes(key)
            cached, stale = self.cache.take(key, hashes)
            self._free.extend(stale)
            verified = len(cached)
        new = max(0, blocks - len(shared) - len(cached))
        self.give_back(self.table.expire())
        short = new - self.free_blocks
        if short > 0:
            evicted = self.table.evict_for(short)
            self.evicted_for_live += len(evicted)
            self.give_back(evicted)
            if new > self.free_blocks:
                self.free(shared)
                if cached:
                    self._free.extend(self.cache.put(key, cached, entry_hashes))
                return None
        ids = shared + tuple(cached) + tuple(self._take(new))
        self.live += 1
        return Admission(ids, verified, retention is not None)

    def _take(self, n: int) -> list[int]:
        free = self._free
        if n <= len(free):
            out = free[len(free) - n:]
            del free[len(free) - n:]
            return out
        out = free[:]
        free.clear()
        out.extend(self.cache.evict(n - len(out)))
        return out


class SimPrefill:
    """One prefill: vLLM's prefix cache (per conversation, the hashes of the last prompt it
    computed, least recently used first, up to its capacity), a FIFO compute queue, and a host
    tier where the policy has one."""

    def __init__(self, name: str, capacity: int, host_blocks: int = 0) -> None:
        self.name = name
        self.capacity = capacity
        self.busy_until = 0.0
        self.busy_s = 0.0
        self._cache: OrderedDict[bytes | str, tuple[bytes, ...]] = OrderedDict()
        self._held = 0
        self.host = HostTier(host_blocks) if host_blocks else None

    def cached_blocks(self, key: bytes | str, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` still in the prefix cache under ``key`` (a use)."""
        held = self._cache.get(key)
        if held is None:
            return 0
        self._cache.move_to_end(key)
        return verified_prefix_blocks(hashes, held)

    def held_blocks(self, key: bytes | str) -> int:
        """Blocks cached under ``key``, unverified (the shared system prompt's entry: every
        conversation's first blocks are the same there) (a use)."""
        held = self._cache.get(key)
        if held is None:
            return 0
        self._cache.move_to_end(key)
        return len(held)

    def remember(self, key: bytes | str, hashes: Sequence[bytes]) -> None:
        """The prompt just computed stays cached until newer work pushes it out."""
        old = self._cache.pop(key, ())
        self._held -= len(old)
        if not hashes or len(hashes) > self.capacity:
            return
        while self._held + len(hashes) > self.capacity and self._cache:
            _, dropped = self._cache.popitem(last=False)
            self._held -= len(dropped)
        self._cache[key] = tuple(hashes)
        self._held += len(hashes)
