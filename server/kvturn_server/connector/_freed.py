"""What a dropped retention left in the decode's prefix cache.

A retention that goes (evicted for live requests, expired, released) only drops its reference
on its blocks: vLLM keeps a freed block's content and hash in its prefix cache until an
allocation takes the block, and it gives out freed blocks least recently freed first, so a
conversation's history often outlives its lease there by a while (or by little, when the decode
is short of memory). The router asks before it continues a turn whose retention it knows is gone
(docs/http-api.md, C: a ``404`` describe answer carries ``cached_tokens``): the decode then
recomputes only what is really missing, and a history that is really gone takes a prefill.

Each entry keeps the retention's block ids and a 64-bit fingerprint (Python's ``hash``) of the
hash vLLM had given each block: 12 bytes a block, not the hashes themselves, which would keep
vLLM's evicted hash objects alive (a 100k-token history in 16-token blocks is 6,250 of them); a
block still holds the conversation's KV while its hash has the fingerprint kept (a collision
only makes the hint wrong, never an answer: the request that follows hits what vLLM finds). The
keeper frees tail blocks first, so the leading blocks are the last to go and the leading run of
matches is what a request would hit.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

REMEMBERED = 256
"""Dropped retentions remembered (least recently dropped forgotten first), 12 bytes a block
each: at most 19 MiB for 256 histories of 100k tokens in 16-token blocks."""

_NONE = 0  # the fingerprint of a block that had no hash (never matches: see _fingerprint)


def _fingerprint(block_hash: object) -> int:
    return _NONE if block_hash is None else hash(block_hash) or 1


@dataclass(frozen=True, slots=True)
class _Dropped:
    block_ids: array[int]
    fingerprints: array[int]
    num_tokens: int


class FreedBlocks:
    """Per conversation key, the blocks of its last dropped retention (engine thread writes,
    control threads read: the caller holds its lock)."""

    def __init__(self, limit: int = REMEMBERED) -> None:
        self._limit = limit
        self._dropped: OrderedDict[str, _Dropped] = OrderedDict()

    def __len__(self) -> int:
        return len(self._dropped)

    def note(self, key: str, block_ids: Sequence[int], blocks: Sequence[Any],
             num_tokens: int) -> None:
        """Remember what ``key``'s retention held as its blocks are freed (``blocks``: the
        pool's block objects for ``block_ids``, read before the free)."""
        self._dropped.pop(key, None)
        self._dropped[key] = _Dropped(array("i", block_ids),
                                      array("q", (_fingerprint(b.block_hash) for b in blocks)),
                                      num_tokens)
        while len(self._dropped) > self._limit:
            self._dropped.popitem(last=False)

    def forget(self, key: str) -> None:
        """``key`` is retained again: its old blocks say nothing about it any more."""
        self._dropped.pop(key, None)

    def cached_tokens(self, key: str, pool_blocks: Sequence[Any], block_size: int) -> int | None:
        """Tokens of ``key``'s dropped history still in the prefix cache, from its start; None
        when nothing is remembered of it."""
        dropped = self._dropped.get(key)
        if dropped is None:
            return None
        held = 0
        for block_id, kept in zip(dropped.block_ids, dropped.fingerprints, strict=True):
            if kept == _NONE or _fingerprint(pool_blocks[block_id].block_hash) != kept:
                break
            held += 1
        return min(held * block_size, dropped.num_tokens)
