"""kvturn's eviction order as a vLLM cache policy (``eviction_policy: "kvturn"``).

vLLM's ``CPUOffloadingManager`` owns the host tier's chunk pool, reference counts and copy
jobs, and delegates two things to a ``CachePolicy`` (``vllm/v1/kv_offload/cpu/policies/``):
keeping the chunks by key, and choosing which to evict. This binding keeps the chunks and hands
every decision to :class:`~kvturn_server.offload._order.HostOrder`: who owns a block comes from
the request's transfer params (``kvturn.conversation``), how each conversation stands from
kvturn's leases, found through the engine's :class:`~kvturn_server.connector._tiers.TierLink`
(set by the manager, ``_manager.py``). Without leases (a prefill, or a decode that retains
nothing) it never claims a block, and the order is vLLM's LRU.

The manager calls it on the engine thread; the keeper asks :meth:`resident_prefix` from the
control endpoint's threads, so every method holds the policy's lock. The leases are read
before taking it: the keeper's lock and this one are never held together.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from contextlib import suppress
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

from kvturn_server.connector import LeaseView, Standing, TierLink, conversation_key
from kvturn_server.offload._order import HostOrder, stores_request

POLICY_NAME = "kvturn"


class LeasedCachePolicy(CachePolicy):  # type: ignore[misc]
    """vLLM's cache-policy interface over :class:`HostOrder`."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.order = HostOrder()
        self.link: TierLink | None = None
        self.evicted: dict[str, int] = {}  # blocks evicted by standing, since taken
        self.evicted_total: dict[str, int] = {}
        self._running: dict[str, str] = {}  # request id -> conversation, turns in progress
        # conversation -> its last finished turn (request id) and that turn's blocks a host
        # read may name: from its first, each at its own position (``resident_chunks``)
        self._turn_of: dict[str, tuple[str, tuple[OffloadKey, ...]]] = {}
        # conversation -> the keys its last host read was handed (``resident_chunks``): kept
        # from eviction while its standing is pinned, owned or not (a later turn of the
        # conversation may have dropped some from its list while the read is in flight)
        self._reading: dict[str, tuple[OffloadKey, ...]] = {}
        self.store_one_offs = True  # the manager sets it from its config
        # Tokens of one host block (chunk), the step of vLLM's offload key positions; 0:
        # unknown, and no host reads (the manager sets it).
        self.tokens_per_chunk = 0
        self._lock = threading.Lock()

    # What the keeper asks (any thread).

    def resident_prefix(self, conversation: str) -> int:
        with self._lock:
            return self.order.resident_prefix(conversation)

    def resident_chunks(self, conversation: str, request_id: str) -> list[int]:
        """Chunk ids of the blocks of the conversation's turn ``request_id`` from its first
        that are resident and written, without a gap (else none: a later turn that was not
        retained may have listed other blocks, and a read must get the retention's own).

        The i-th id holds the turn's i-th block: the turn's keys were checked against their
        positions when it finished, and a block whose store is still in flight ends the list."""
        with self._lock:
            turn = self._turn_of.get(conversation)
            if turn is None or turn[0] != request_id:
                return []
            chunks: list[int] = []
            for key in turn[1]:
                chunk = self.chunks.get(key)
                if chunk is None or not chunk.is_ready:
                    break
                chunks.append(chunk.chunk_id)
            if chunks:
                self._reading[conversation] = turn[1][:len(chunks)]
            return chunks

    def drop(self, conversation: str, live: Iterable[str]) -> list[OffloadKey]:
        with self._lock:
            self._turn_of.pop(conversation, None)
            self._reading.pop(conversation, None)
            return self.order.drop(conversation, set(live))

    def take_evicted(self) -> dict[str, int]:
        with self._lock:
            evicted, self.evicted = self.evicted, {}
        return evicted

    def stores(self, req_context: ReqContext) -> bool:
        """Whether the request's blocks are worth storing (``stores_request``)."""
        leased = self.link is not None and self.link.leases is not None
        return stores_request(self._owner(req_context), leased=leased,
                              one_offs=self.store_one_offs)

    # vLLM's CachePolicy (the manager, engine thread).

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        with self._lock:
            self.chunks[key] = chunk
            self.order.add(key, idle=chunk.ref_cnt == 0)

    def remove(self, key: OffloadKey) -> None:
        with self._lock:
            del self.chunks[key]
            self.order.remove(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        conversation = self._owner(req_context)
        with self._lock:
            if conversation is not None:
                self._running[req_context.req_id] = conversation
                self.order.claim(conversation, keys)
            self.order.use(keys)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # Claimed before they are stored: a turn's blocks are its own while it runs.
        self.touch(keys, req_context)

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]],
                            insertion_only_keys: set[OffloadKey], reused_keys: set[OffloadKey],
                            req_context: ReqContext) -> None:
        keys = order_request_keys(key_groups, req_context)
        conversation = self._owner(req_context)
        with self._lock:
            self._running.pop(req_context.req_id, None)
            self.order.finish(conversation, keys)
            if conversation is not None:
                self._turn_of[conversation] = (req_context.req_id,
                                               self._in_place(keys, req_context))

    def evict(self, n: int,
              protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        leases = self.link.leases if self.link is not None else None
        standings = dict(leases.standings()) if leases is not None else {}
        with self._lock:
            # A running turn's conversation counts as used now (unless pinned).
            for conversation in self._running.values():
                view = standings.get(conversation)
                if view is None or view.standing < Standing.PINNED:
                    standings[conversation] = LeaseView(Standing.LEASED, math.inf)
            for conversation in [c for c in self._reading
                                 if (v := standings.get(c)) is None
                                 or v.standing < Standing.PINNED]:
                del self._reading[conversation]  # its reads are over
            if self._reading:
                protected = {*protected, *(k for keys in self._reading.values() for k in keys)}
            chosen = self.order.evict(n, protected, standings)
            if chosen is None:
                return None
            out = []
            for key, standing in chosen:
                out.append((OffloadKey(key), self.chunks.pop(OffloadKey(key))))
                self.evicted[standing] = self.evicted.get(standing, 0) + 1
                self.evicted_total[standing] = self.evicted_total.get(standing, 0) + 1
            headless = self.order.take_headless()
        if headless and leases is not None:
            leases.lost_in_host(headless)
        return out

    def clear(self) -> None:
        with self._lock:
            self.chunks.clear()
            self._running.clear()
            self._turn_of.clear()
            self._reading.clear()
            self.order = HostOrder()

    def mark_evictable(self, key: OffloadKey) -> None:
        with self._lock:
            self.order.mark_idle(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        with self._lock:
            self.order.mark_busy(key)

    def _in_place(self, keys: Sequence[OffloadKey],
                  req_context: ReqContext) -> tuple[OffloadKey, ...]:
        """The request's keys from its first block while the i-th is its i-th block (vLLM's
        position of a key is the end token of its chunk). vLLM lists only the keys a request
        stored, loaded or found ready: one another request was still storing is missing, and
        so are the device prefix-cache hits before a load from here (vLLM's chunk-level
        policy); every later key would name another block than the one a read expects."""
        step = self.tokens_per_chunk
        out: list[OffloadKey] = []
        for i, key in enumerate(keys):
            if step <= 0 or req_context.get_offload_key_position(key) != (i + 1) * step:
                break
            out.append(key)
        return tuple(out)

    def _owner(self, req_context: ReqContext) -> str | None:
        """The request's conversation, when this engine has kvturn's leases to order by."""
        if self.link is None or self.link.leases is None:
            return None
        params: Any = req_context.kv_transfer_params
        return conversation_key(params) if isinstance(params, dict) else None


def _register() -> None:
    """Make ``eviction_policy: "kvturn"`` resolve to this class in vLLM's policy factory."""
    with suppress(ValueError):  # registered already
        CachePolicyFactory.register_cache_policy(POLICY_NAME, __name__, "LeasedCachePolicy")


_register()
