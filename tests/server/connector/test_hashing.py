"""Chained per-block content hashes over token ids."""

from __future__ import annotations

import hashlib
import random
import struct
import time

import pytest

from kvturn_server.connector._hashing import HASH_SIZE, block_hashes, verified_prefix_blocks

BS = 4


def test_one_hash_per_full_block_only() -> None:
    assert block_hashes([], BS) == []
    assert block_hashes([1, 2, 3], BS) == []
    assert len(block_hashes(list(range(8)), BS)) == 2
    assert len(block_hashes(list(range(11)), BS)) == 2
    assert all(len(h) == HASH_SIZE for h in block_hashes(list(range(12)), BS))


def test_deterministic_and_independent_of_sequence_type() -> None:
    tokens = list(range(100, 120))
    assert block_hashes(tokens, BS) == block_hashes(tuple(tokens), BS)
    assert block_hashes(tokens, BS) == block_hashes(range(100, 120), BS)


def test_trailing_partial_block_does_not_change_full_block_hashes() -> None:
    tokens = list(range(8))
    assert block_hashes([*tokens, 9, 9], BS) == block_hashes(tokens, BS)


def test_chain_equal_hash_means_equal_prefix() -> None:
    base = list(range(16))
    edited = list(base)
    edited[5] = 999  # block 1
    a, b = block_hashes(base, BS), block_hashes(edited, BS)
    assert a[0] == b[0]
    # Blocks 2 and 3 hold identical tokens, but their prefix differs, so their hashes do too.
    assert a[1] != b[1] and a[2] != b[2] and a[3] != b[3]


def test_same_block_tokens_at_different_positions_hash_differently() -> None:
    hashes = block_hashes([7] * 12, BS)
    assert len(set(hashes)) == 3


def test_chain_matches_documented_construction() -> None:
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    prev = hashlib.blake2b(b"kvturn-v1" + struct.pack("<I", BS), digest_size=16).digest()
    expected = []
    for i in range(2):
        prev = hashlib.blake2b(
            prev + struct.pack("<4I", *tokens[i * 4:(i + 1) * 4]), digest_size=16).digest()
        expected.append(prev)
    assert block_hashes(tokens, BS) == expected


def test_seed_and_block_size_separate_hash_spaces() -> None:
    tokens = list(range(16))
    assert block_hashes(tokens, BS, seed=b"other") != block_hashes(tokens, BS)
    # The first 8-token block covers the same tokens as two 4-token blocks, yet never matches.
    assert block_hashes(tokens, 8)[0] not in block_hashes(tokens, 4)


def test_token_id_range_limits() -> None:
    assert len(block_hashes([0, 2**32 - 1, 0, 1], BS)) == 1


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, 2, -1, 4], "position 2 is outside 0..2\\*\\*32-1: -1"),
        ([2**32, 1, 2, 3], "position 0 is outside"),
        ([1, 2.0, 3, 4], "position 1 is not an int: 2.0"),
        ([1, "2", 3, 4], "position 1 is not an int"),
        ([1, None, 3, 4], "position 1 is not an int"),
        ([1, 2, 3, 4, -5], "position 4 is outside"),  # checked even in the partial block
    ],
)
def test_bad_token_ids_are_rejected(tokens: list[object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        block_hashes(tokens, BS)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -4, True, 4.0, "4", None])
def test_bad_block_size_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        block_hashes([1, 2, 3, 4], bad)  # type: ignore[arg-type]


def test_seed_must_be_bytes() -> None:
    with pytest.raises(ValueError, match="seed must be bytes"):
        block_hashes([1, 2, 3, 4], BS, seed="kvturn-v1")  # type: ignore[arg-type]


def test_fast_enough_for_long_prompts() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(200_000) for _ in range(16_384)]
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        hashes = block_hashes(tokens, 16)
        best = min(best, time.perf_counter() - start)
    assert len(hashes) == 1024
    assert best < 0.010, f"hashing 16k tokens took {best * 1e3:.1f} ms"


def test_verified_prefix_blocks() -> None:
    a = block_hashes(list(range(20)), BS)
    assert verified_prefix_blocks(a, a) == 5
    assert verified_prefix_blocks(a, a[:3]) == 3
    assert verified_prefix_blocks(a[:2], a) == 2
    assert verified_prefix_blocks([], a) == 0
    assert verified_prefix_blocks(a, []) == 0
    edited = list(range(20))
    edited[9] = 12345  # block 2
    assert verified_prefix_blocks(a, block_hashes(edited, BS)) == 2
    assert verified_prefix_blocks(a, [b"x" * 16, *a[1:]]) == 0


def test_verified_prefix_stops_at_first_mismatch_even_if_later_hashes_match() -> None:
    a = block_hashes(list(range(20)), BS)
    spliced = [a[0], b"\0" * 16, *a[2:]]
    assert verified_prefix_blocks(a, spliced) == 1
