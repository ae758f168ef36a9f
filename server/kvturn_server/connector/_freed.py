"""What a dropped retention left in the decode's prefix cache.

A retention that goes (evicted for live requests, expired, released) only drops its reference
on its blocks: vLLM keeps a freed block's content and hash in its prefix cache until an
allocation takes the block, and it gives out freed blocks least recently freed first, so a
conversation's history often outlives its lease there by a while (or by little, when the decode
is short of memory). The router asks before it continues a turn whose retention it knows is gone
(docs/http-api.md, C: a ``404`` describe answer carries ``cached_tokens``): the decode then
recomputes only what is really missing, and a history that is really gone takes a prefill.

Each entry keeps the retention's block ids and the hashes vLLM had given them, nothing else
(references to objects the block pool made, no copies); a block still holds the conversation's
KV while its hash is the one kept. The keeper frees tail blocks first, so the leading blocks are
the last to go and the leading run of matches is what a request would hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

REMEMBERED = 1024
"""Dropped retentions remembered (least recently dropped forgotten first): about a block id
and a reference per block each."""


@dataclass(frozen=True, slots=True)
class _Dropped:
    block_ids: tuple[int, ...]
    hashes: tuple[Any, ...]
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
        self._dropped[key] = _Dropped(tuple(block_ids), tuple(b.block_hash for b in blocks),
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
        for block_id, block_hash in zip(dropped.block_ids, dropped.hashes, strict=True):
            if block_hash is None or pool_blocks[block_id].block_hash != block_hash:
                break
            held += 1
        return min(held * block_size, dropped.num_tokens)
