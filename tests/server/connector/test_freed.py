"""What a dropped retention left in the prefix cache (connector/_freed.py)."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

from kvturn_server.connector._freed import FreedBlocks


@dataclass
class _Block:
    block_hash: object | None


def test_the_leading_run_of_blocks_still_holding_their_hashes_counts() -> None:
    blocks = [_Block(("h", i)) for i in range(6)]
    freed = FreedBlocks()
    freed.note("k", [1, 2, 3], [blocks[1], blocks[2], blocks[3]], num_tokens=10)
    assert freed.cached_tokens("k", blocks, block_size=4) == 10  # never past the history
    blocks[3] = _Block(("other",))
    assert freed.cached_tokens("k", blocks, block_size=4) == 8
    blocks[1] = _Block(None)  # evicted: later blocks alone are no hit
    assert freed.cached_tokens("k", blocks, block_size=4) == 0
    assert freed.cached_tokens("unknown", blocks, block_size=4) is None
    freed.forget("k")
    assert freed.cached_tokens("k", blocks, block_size=4) is None


def test_a_block_that_had_no_hash_when_freed_is_no_hit() -> None:
    blocks = [_Block(None), _Block(("h",))]
    freed = FreedBlocks()
    freed.note("k", [0, 1], blocks, num_tokens=8)
    assert freed.cached_tokens("k", blocks, block_size=4) == 0


def test_the_least_recently_dropped_are_forgotten_past_the_limit() -> None:
    blocks = [_Block(("h", 0))]
    freed = FreedBlocks(limit=2)
    for key in ("a", "b", "a", "c"):
        freed.note(key, [0], blocks, num_tokens=4)
    assert len(freed) == 2
    assert freed.cached_tokens("b", blocks, block_size=4) is None
    assert freed.cached_tokens("a", blocks, block_size=4) == 4


class _Hash:
    """A hash object vLLM's pool would make (weakly referenceable, for the test)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __hash__(self) -> int:
        return hash(("h", self.value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Hash) and other.value == self.value


def test_what_is_remembered_keeps_no_hash_of_vllm_s_alive() -> None:
    blocks = [_Block(_Hash(i)) for i in range(3)]
    freed = FreedBlocks()
    freed.note("k", [0, 1, 2], blocks, num_tokens=12)
    gone = weakref.ref(blocks[2].block_hash)
    blocks[2] = _Block(None)  # vLLM evicted it: nothing may keep its hash object
    gc.collect()
    assert gone() is None
    # An equal hash (the same content computed again) still matches.
    blocks[2] = _Block(_Hash(2))
    assert freed.cached_tokens("k", blocks, block_size=4) == 12
