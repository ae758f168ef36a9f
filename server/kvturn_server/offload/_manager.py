"""The decode's host tier as kvturn's keeper sees it: vLLM's offloading manager, plus discards.

vLLM's ``CPUOffloadingManager`` runs the host tier on the scheduler side: chunk pool, reference
counts, lookups, store and load bookkeeping, eviction through a cache policy. It reclaims a
chunk only when a store needs the room; :class:`HostTierManager` adds what kvturn's lease
needs on top (the :class:`~kvturn_server.connector._tiers.HostTier` protocol):

- **discard**: a conversation whose lease ended (release, expiry) has its host blocks freed at
  once unless a live lease shares them; a chunk whose copy failed is freed before anything can
  load it. A chunk in use (a copy in flight) is freed when its copy completes.
- **what a request loaded**: the host-tier connector (``_connector.py``) notes each request's
  host load and whether its copy failed; the keeper's decode side reads it into the turn's
  reuse report.
- **what it holds of a conversation** (with kvturn's policy, ``_policy.py``).
- **what it stores**: everything, as vLLM does, unless a decode with kvturn's policy is told
  not to store one-off requests (``store_one_offs: false``; ``_order.stores_request`` says
  when that is right).

It registers itself with the engine's :class:`~kvturn_server.connector._tiers.TierLink`, where
kvturn's keeper finds it, and gives its policy the link to find the keeper's leases.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvturn_server.connector import HostCounters, HostLoad, HostRead, TierLink
from kvturn_server.offload._policy import LeasedCachePolicy
from kvturn_server.offload._reads import LOOPBACK

log = logging.getLogger("kvturn.offload")


class HostTierManager(CPUOffloadingManager):  # type: ignore[misc]
    """vLLM's CPU offloading manager with discards, load notes and kvturn's link."""

    def __init__(self, *, link: TierLink, tokens_per_block: int, store_one_offs: bool = True,
                 blocks_per_chunk: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tokens_per_block = tokens_per_block
        self.blocks_per_chunk = blocks_per_chunk
        # Where prefills read this host tier over NIXL: the worker reports its side channel's
        # port once it serves reads (``_reads.py``, ``_connector.py``); None until then.
        self.read_port: int | None = None
        self._loads: dict[str, HostLoad] = {}
        self._doomed: set[OffloadKey] = set()  # discarded while a copy used them
        self._counters = HostCounters()  # since take_counters
        self._totals = HostCounters()  # since start (evictions are the policy's)
        self.policy_name = str(kwargs.get("cache_policy", "lru"))
        if isinstance(self._policy, LeasedCachePolicy):
            self._policy.link = link
            self._policy.store_one_offs = store_one_offs
            self._policy.tokens_per_chunk = tokens_per_block
        link.host = self

    # kvturn's HostTier: what the keeper and the decode side ask.

    def resident_tokens(self, conversation: str) -> int:
        if not isinstance(self._policy, LeasedCachePolicy):
            return 0  # vLLM's policies do not know conversations
        return self._policy.resident_prefix(conversation) * self.tokens_per_block

    def host_read(self, conversation: str, request_id: str) -> HostRead | None:
        """Where a prefill reads the resident blocks of the conversation's turn
        ``request_id`` from its first: the worker's read side channel and the blocks' host
        rows, one per device block (``_rows.py``); None before the worker reported its side
        channel, with vLLM's policies, or with none of that turn's blocks resident."""
        if self.read_port is None or not isinstance(self._policy, LeasedCachePolicy):
            return None
        n = self.blocks_per_chunk
        rows = tuple(chunk * n + j
                     for chunk in self._policy.resident_chunks(conversation, request_id)
                     for j in range(n))
        return HostRead(LOOPBACK, self.read_port, rows) if rows else None

    def discard(self, conversations: Iterable[str]) -> int:
        """Free the host blocks of conversations whose lease ended, unless a live lease (a
        newer turn of the same conversation, or another one sharing a prefix) holds them."""
        policy = self._policy
        if not isinstance(policy, LeasedCachePolicy):
            return 0
        leases = policy.link.leases if policy.link is not None else None
        live = leases.standings() if leases is not None else {}
        keys: list[OffloadKey] = []
        for conversation in dict.fromkeys(conversations):
            if conversation not in live:
                keys.extend(policy.drop(conversation, live))
        return self.discard_keys(keys)

    def take_loaded(self, request_id: str) -> HostLoad | None:
        return self._loads.pop(request_id, None)

    def take_counters(self) -> HostCounters:
        counters, self._counters = self._counters, HostCounters()
        if isinstance(self._policy, LeasedCachePolicy):
            counters.evicted = self._policy.take_evicted()
        return counters

    def usage(self) -> dict[str, Any]:
        """Size, use and counters since start (read racily from other threads: a snapshot of
        ints, never iterated while the engine thread changes it)."""
        allocated = self._num_allocated_chunks - len(self._free_list)
        evicted = dict(self._policy.evicted_total) \
            if isinstance(self._policy, LeasedCachePolicy) else {}
        return {"blocks": self._num_chunks, "blocks_used": allocated,
                "tokens_per_block": self.tokens_per_block, "policy": self.policy_name,
                "evicted": evicted, "discarded": self._totals.discarded,
                "load_failures": self._totals.load_failures}

    # The host-tier connector's notes (engine thread).

    def note_load(self, request_id: str, tokens: int) -> None:
        """A request loads ``tokens`` of its prompt from here (its first load counts, as
        kvturn counts a decode leg's first local hit)."""
        self._loads.setdefault(request_id, HostLoad(tokens))

    def note_load_failed(self, request_id: str) -> None:
        self._loads[request_id] = HostLoad(0, failed=True)
        self._counters.load_failures += 1
        self._totals.load_failures += 1

    def forget_load(self, request_id: str) -> None:
        self._loads.pop(request_id, None)

    def discard_keys(self, keys: Iterable[OffloadKey]) -> int:
        """Free these chunks now, or when the copy using them completes; the number freed now."""
        freed: list[OffloadKey] = []
        for key in dict.fromkeys(keys):
            chunk = self._policy.get(key)
            if chunk is None:
                self._doomed.discard(key)
                continue
            if chunk.ref_cnt != 0:
                self._doomed.add(key)
                continue
            # As CPUOffloadingManager's own eviction does: out of the policy, an idle chunk
            # fewer, its slot back on the free list.
            self._policy.remove(key)
            self._num_evictable_cache_chunks -= 1
            self._free_chunk(chunk)
            self._doomed.discard(key)
            freed.append(key)
        if freed:
            self._counters.discarded += len(freed)
            self._totals.discarded += len(freed)
            if self.events is not None:
                self.events.append(OffloadingEvent(keys=freed, medium=self.medium,
                                                   removed=True))
        return len(freed)

    # vLLM's manager: what is stored, and a doomed chunk goes as soon as its copy is done.

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        if isinstance(self._policy, LeasedCachePolicy) and not self._policy.stores(req_context):
            # What vLLM's manager answers when every key is stored already: nothing to copy.
            return PrepareStoreOutput(keys_to_store=[], store_spec=self._get_load_store_spec(
                [], []), evicted_keys=[])
        output: PrepareStoreOutput | None = super().prepare_store(keys, req_context)
        return output

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        super().complete_store(keys, req_context, success)
        self._free_doomed(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        super().complete_load(keys, req_context)
        self._free_doomed(keys)

    def reset_cache(self) -> None:
        super().reset_cache()
        self._doomed.clear()

    def _free_doomed(self, keys: Collection[OffloadKey]) -> None:
        if self._doomed:
            self.discard_keys([k for k in keys if k in self._doomed])
