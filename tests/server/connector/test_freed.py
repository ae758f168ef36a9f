"""What a dropped retention left in the prefix cache (connector/_freed.py)."""

from __future__ import annotations

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
