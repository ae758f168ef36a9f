"""The prefill side of decode -> prefill reuse: only content-verified blocks are read."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvturn_server.connector._hashing import DEFAULT_SEED, block_hashes
from kvturn_server.connector._params import FORMAT, KVTURN_FIELD
from kvturn_server.connector._prefill import PrefillSide, ReadRules

BS = 4


@dataclass
class FakeRequest:
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any]
    request_id: str = "req"
    # What vLLM's prefix cache keys on besides token ids: none of it here (plain text).
    lora_request: Any = None
    mm_features: list[Any] = field(default_factory=list)
    cache_salt: str | None = None
    prompt_embeds: Any = None


def prefill(threshold: int = 0) -> PrefillSide:
    # No calibration: the threshold alone decides here (cost model: elsewhere).
    return PrefillSide(ReadRules(engine_id="prefill-engine", block_size=BS,
                                 hash_seed=DEFAULT_SEED, threshold=threshold, enabled=True))


def decode_params(retained_tokens: list[int], block_ids: list[int]) -> dict[str, Any]:
    """What a kvturn decode returns: its blocks plus a hash per full block."""
    return {
        "do_remote_decode": True, "do_remote_prefill": False,
        "remote_block_ids": [list(block_ids)], "remote_num_tokens": len(retained_tokens),
        KVTURN_FIELD: {"format": FORMAT, "block_size": BS,
                       "block_hashes": [h.hex() for h in block_hashes(retained_tokens, BS)]},
    }


RETAINED = list(range(100, 118))  # 4 full blocks + 2 tokens on the decode
D_BLOCKS = [40, 41, 42, 43, 44]


def restrict(prompt: list[int], local: int, params: dict[str, Any],
             threshold: int = 0) -> dict[str, Any]:
    prefill(threshold)._restrict_to_verified_blocks(FakeRequest(prompt, params), local, params)
    return params


def test_an_extended_conversation_reads_the_blocks_beyond_the_local_hit() -> None:
    prompt = [*RETAINED, 7, 8, 9, 10, 11]
    params = restrict(prompt, 4, decode_params(RETAINED, D_BLOCKS))
    assert params["remote_block_ids"] == [[41, 42, 43]]
    assert params["remote_num_tokens"] == 16
    assert params[KVTURN_FIELD]["decision"] == "partial"


def test_edited_history_reads_only_up_to_the_first_different_block() -> None:
    prompt = [*RETAINED, 7, 8]
    prompt[9] = 999  # inside block 2
    params = restrict(prompt, 4, decode_params(RETAINED, D_BLOCKS))
    assert params["remote_block_ids"] == [[41]]
    assert params["remote_num_tokens"] == 8


def test_the_prompts_last_token_is_never_read() -> None:
    prompt = RETAINED[:16]  # exactly 4 blocks: the last one holds the token that gives logits
    params = restrict(prompt, 0, decode_params(RETAINED, D_BLOCKS))
    assert params["remote_block_ids"] == [[40, 41, 42]]
    assert params["remote_num_tokens"] == 12


def test_nothing_is_read_when_the_local_hit_covers_the_verified_range() -> None:
    prompt = [*RETAINED[:8], 5, 5, 5, 5, 5]
    params = restrict(prompt, 8, decode_params(RETAINED, D_BLOCKS))
    assert params["remote_num_tokens"] == 0
    assert params["remote_block_ids"] == [[]]


def test_a_short_remote_range_is_recomputed() -> None:
    prompt = [*RETAINED, 1]
    params = restrict(prompt, 8, decode_params(RETAINED, D_BLOCKS), threshold=12)
    assert params["remote_num_tokens"] == 0
    assert params[KVTURN_FIELD]["decision"] == "below-threshold"


def test_asking_again_gives_the_same_answer() -> None:
    prompt = [*RETAINED, 7]
    params = decode_params(RETAINED, D_BLOCKS)
    restrict(prompt, 4, params)
    first = copy.deepcopy(params)
    restrict(prompt, 4, params)
    assert params == first


@pytest.mark.parametrize("break_it", [
    lambda p: p.pop(KVTURN_FIELD),
    lambda p: p[KVTURN_FIELD].update(format=99),
    lambda p: p[KVTURN_FIELD].update(block_size=8),
    lambda p: p[KVTURN_FIELD].update(block_hashes="nothex"),
    lambda p: p[KVTURN_FIELD].update(block_hashes=["zz"]),
    lambda p: p[KVTURN_FIELD].update(block_hashes=["00ff"]),
    lambda p: p.update(remote_block_ids=[[40, 40, 41, 42, 43]]),
    lambda p: p.update(remote_block_ids=[[40, -1, 41, 42, 43]]),
    lambda p: p.update(remote_block_ids=[[40, 41], [1, 2]]),
    lambda p: p.update(remote_block_ids=[[40]]),
], ids=["no field", "format", "block size", "hashes not a list", "bad hex", "short hash",
        "duplicate ids", "negative id", "two groups", "fewer ids than hashes"])
def test_malformed_or_hostile_params_read_nothing(break_it: Any) -> None:
    params = decode_params(RETAINED, D_BLOCKS)
    break_it(params)
    restrict([*RETAINED, 1], 0, params)
    assert params["remote_num_tokens"] == 0
