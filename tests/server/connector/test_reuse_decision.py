"""The prefill's reuse decision for one request: every reason, range and malformed input."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from kvturn.wire import ReuseReason
from kvturn_server.connector._cost import CostSource, ReadCost
from kvturn_server.connector._hashing import block_hashes
from kvturn_server.connector._reuse import ReuseDecision, decide_reuse

BS = 4
# Block ids on the decode are arbitrary; offsetting them keeps prompt indices and block ids apart.
ID_BASE = 100


def decide(
    prompt: Sequence[int],
    retained: Sequence[int] | None,
    **overrides: Any,
) -> ReuseDecision:
    retained_hashes = block_hashes(retained, BS) if retained is not None else []
    args: dict[str, Any] = {
        "prompt_hashes": block_hashes(prompt, BS),
        "local_hit_tokens": 0,
        "retained_hashes": retained_hashes,
        "retained_block_ids": [ID_BASE + i for i in range(len(retained_hashes))],
        "block_size": BS,
        "threshold": 0,
        "expired": False,
        "engine_known": True,
        "enabled": True,
    }
    args.update(overrides)
    return decide_reuse(**args)


def ids(first: int, stop: int) -> tuple[int, ...]:
    return tuple(ID_BASE + i for i in range(first, stop))


HISTORY = list(range(1, 17))  # 4 full blocks


# Reasons that read nothing.


def test_disabled_wins_over_a_perfect_retention() -> None:
    d = decide(HISTORY, HISTORY, enabled=False)
    assert d == ReuseDecision(ReuseReason.DISABLED, (), 0, 0)
    assert not d.reused


def test_no_retention_is_a_miss() -> None:
    d = decide(HISTORY, None)
    assert d.reason is ReuseReason.MISS and not d.reused


def test_prompt_without_a_full_block_is_a_miss() -> None:
    d = decide([1, 2, 3], HISTORY)
    assert d.reason is ReuseReason.MISS and d.remote_blocks == ()


def test_expired_retention() -> None:
    assert decide(HISTORY, HISTORY, expired=True).reason is ReuseReason.EXPIRED


def test_unknown_engine_is_stale() -> None:
    assert decide(HISTORY, HISTORY, engine_known=False).reason is ReuseReason.STALE


def test_precedence_disabled_miss_expired_stale() -> None:
    flags = {"expired": True, "engine_known": False}
    assert decide(HISTORY, HISTORY, enabled=False, **flags).reason is ReuseReason.DISABLED
    assert decide(HISTORY, None, **flags).reason is ReuseReason.MISS
    assert decide(HISTORY, HISTORY, **flags).reason is ReuseReason.EXPIRED
    # Stale is decided before looking at hashes: a diverged history on an unknown engine.
    assert decide([99, *HISTORY], HISTORY, engine_known=False).reason is ReuseReason.STALE


def test_divergence_at_block_zero_is_unverified() -> None:
    prompt = [999, *HISTORY[1:]]
    d = decide(prompt, HISTORY)
    assert d == ReuseDecision(ReuseReason.UNVERIFIED, (), 0, 0)


def test_unverified_even_when_the_local_cache_hits() -> None:
    prompt = [999, *HISTORY[1:]]
    d = decide(prompt, HISTORY, local_hit_tokens=2 * BS)
    assert d == ReuseDecision(ReuseReason.UNVERIFIED, (), 2, 0)


# Hit: every full block of the prompt covered.


def test_exact_block_boundary_prompt_is_a_full_hit() -> None:
    d = decide(HISTORY, HISTORY)
    assert d == ReuseDecision(ReuseReason.HIT, ids(0, 4), 0, 16)
    assert d.reused


def test_partial_last_block_does_not_prevent_a_hit() -> None:
    d = decide([*HISTORY, 50, 51, 52], HISTORY)
    assert d == ReuseDecision(ReuseReason.HIT, ids(0, 4), 0, 16)


def test_retention_longer_than_prompt_reads_only_the_prompt_blocks() -> None:
    # A retried or shortened turn: the retention holds more than the prompt needs.
    d = decide(HISTORY[:8], HISTORY)
    assert d == ReuseDecision(ReuseReason.HIT, ids(0, 2), 0, 8)


def test_local_hit_blocks_are_not_read_again() -> None:
    d = decide(HISTORY, HISTORY, local_hit_tokens=BS)
    assert d == ReuseDecision(ReuseReason.HIT, ids(1, 4), 1, 12)


def test_local_cache_covering_the_whole_prompt_is_a_hit_with_nothing_to_read() -> None:
    d = decide(HISTORY, HISTORY, local_hit_tokens=16)
    assert d == ReuseDecision(ReuseReason.HIT, (), 4, 0)
    assert not d.reused


def test_local_cache_ahead_of_a_short_verified_range_still_hits() -> None:
    prompt = HISTORY
    retained = [*HISTORY[:8], 77, 77, 77, 77]  # verified 2 blocks
    d = decide(prompt, retained, local_hit_tokens=16)
    assert d == ReuseDecision(ReuseReason.HIT, (), 4, 0)


# Partial: some but not all full blocks covered.


def test_next_turn_with_new_suffix_is_partial() -> None:
    prompt = [*HISTORY, *range(200, 208), 300]  # 6 full blocks plus a partial one
    d = decide(prompt, HISTORY)
    assert d == ReuseDecision(ReuseReason.PARTIAL, ids(0, 4), 0, 16)


def test_edited_middle_block_stops_the_verified_prefix_there() -> None:
    prompt = list(HISTORY)
    prompt[9] = 4242  # block 2 edited; blocks 0-1 still shared
    d = decide(prompt, HISTORY)
    assert d == ReuseDecision(ReuseReason.PARTIAL, ids(0, 2), 0, 8)


def test_stripped_reasoning_reuses_up_to_where_reasoning_began() -> None:
    system_and_user = list(range(1, 11))  # 10 tokens: blocks 0-1 full, block 2 starts at 8
    reasoning = [900, 901, 902, 903, 904, 905]
    answer = [20, 21, 22, 23, 24, 25]
    retained = [*system_and_user, *reasoning, *answer]  # what the decode generated
    # The chat template drops earlier turns' reasoning from the next prompt.
    prompt = [*system_and_user, *answer, *range(40, 48)]
    d = decide(prompt, retained)
    # Block 2 holds tokens 8..11, where reasoning began: only blocks 0 and 1 verify.
    assert d == ReuseDecision(ReuseReason.PARTIAL, ids(0, 2), 0, 8)


def test_local_cache_ahead_of_verified_range_with_more_prompt_is_partial() -> None:
    prompt = [*HISTORY, *range(200, 204)]  # 5 blocks
    retained = [*HISTORY[:8], 77, 77, 77, 77]  # verified 2 blocks
    d = decide(prompt, retained, local_hit_tokens=12)
    assert d == ReuseDecision(ReuseReason.PARTIAL, (), 3, 0)


def test_local_hit_and_remote_range_both_short_of_the_prompt() -> None:
    prompt = [*HISTORY, *range(200, 208)]  # 6 blocks
    d = decide(prompt, HISTORY, local_hit_tokens=2 * BS)
    assert d == ReuseDecision(ReuseReason.PARTIAL, ids(2, 4), 2, 8)


# The recompute threshold.


def test_threshold_zero_reads_any_non_empty_range() -> None:
    d = decide(HISTORY, HISTORY, local_hit_tokens=12, threshold=0)
    assert d == ReuseDecision(ReuseReason.HIT, ids(3, 4), 3, 4)


def test_range_equal_to_threshold_is_read() -> None:
    d = decide(HISTORY, HISTORY, local_hit_tokens=BS, threshold=12)
    assert d == ReuseDecision(ReuseReason.HIT, ids(1, 4), 1, 12)


def test_range_shorter_than_threshold_is_recomputed() -> None:
    d = decide(HISTORY, HISTORY, local_hit_tokens=BS, threshold=13)
    assert d == ReuseDecision(ReuseReason.BELOW_THRESHOLD, (), 1, 0)


def test_threshold_larger_than_the_whole_range() -> None:
    prompt = [*HISTORY, *range(200, 208)]
    d = decide(prompt, HISTORY, threshold=64)
    assert d == ReuseDecision(ReuseReason.BELOW_THRESHOLD, (), 0, 0)


def test_empty_range_is_never_below_threshold() -> None:
    d = decide(HISTORY, HISTORY, local_hit_tokens=16, threshold=64)
    assert d.reason is ReuseReason.HIT and not d.reused


# The cost model: above the threshold, read only what is expected to be faster to read.


class Costs:
    """A cost model stand-in: reading costs ``fixed_ms`` plus 1 ms a token, computing 2 ms a
    token plus 1 ms per token of context; records what it was asked."""

    def __init__(self, fixed_ms: float) -> None:
        self.fixed_ms = fixed_ms
        self.asked: list[tuple[int, int]] = []

    def __call__(self, tokens: int, context: int) -> ReadCost:
        self.asked.append((tokens, context))
        return ReadCost(tokens, self.fixed_ms + tokens, 2.0 * tokens + context,
                        CostSource.CALIBRATED)


def test_a_range_cheaper_to_read_is_read_and_carries_the_estimate() -> None:
    costs = Costs(fixed_ms=5.0)
    d = decide(HISTORY, HISTORY, local_hit_tokens=BS, cost=costs)
    assert costs.asked == [(12, BS)]  # the range, at the local hit's context
    assert d == ReuseDecision(ReuseReason.HIT, ids(1, 4), 1, 12,
                              ReadCost(12, 17.0, 28.0, CostSource.CALIBRATED))
    assert d.reused and not d.cheaper_to_compute


def test_a_range_cheaper_to_compute_is_below_threshold_and_reads_nothing() -> None:
    d = decide(HISTORY, HISTORY, local_hit_tokens=BS, cost=Costs(fixed_ms=20.0))
    assert d.reason is ReuseReason.BELOW_THRESHOLD
    assert (d.remote_blocks, d.first_block, d.num_tokens) == ((), 1, 0)
    assert d.cost == ReadCost(12, 32.0, 28.0, CostSource.CALIBRATED)
    assert d.cheaper_to_compute and not d.reused


def test_equal_costs_are_computed() -> None:
    d = decide(HISTORY, HISTORY, local_hit_tokens=BS, cost=Costs(fixed_ms=16.0))
    assert d.reason is ReuseReason.BELOW_THRESHOLD and d.cheaper_to_compute


def test_the_threshold_is_a_floor_the_cost_model_is_not_asked_below() -> None:
    costs = Costs(fixed_ms=0.0)  # reading would win
    d = decide(HISTORY, HISTORY, local_hit_tokens=BS, threshold=13, cost=costs)
    assert d == ReuseDecision(ReuseReason.BELOW_THRESHOLD, (), 1, 0)
    assert costs.asked == [] and d.cost is None and not d.cheaper_to_compute


def test_the_cost_model_is_not_asked_when_nothing_would_be_read() -> None:
    costs = Costs(fixed_ms=0.0)
    assert decide(HISTORY, HISTORY, local_hit_tokens=16, cost=costs) == ReuseDecision(
        ReuseReason.HIT, (), 4, 0)
    for flags in ({"enabled": False}, {"expired": True}, {"engine_known": False}):
        assert decide(HISTORY, HISTORY, cost=costs, **flags).cost is None
    assert decide([999, *HISTORY[1:]], HISTORY, cost=costs).cost is None
    assert costs.asked == []


def test_a_declined_partial_range_is_below_threshold_too() -> None:
    prompt = [*HISTORY, *range(200, 208)]
    d = decide(prompt, HISTORY, cost=Costs(fixed_ms=100.0))
    assert d.reason is ReuseReason.BELOW_THRESHOLD and d.cheaper_to_compute


# Types and malformed input.


def test_reasons_are_the_header_values() -> None:
    assert [r.value for r in ReuseReason] == [
        "hit", "partial", "miss", "expired", "stale", "below-threshold", "unverified",
        "disabled"]
    assert str(ReuseReason.BELOW_THRESHOLD) == "below-threshold"
    assert ReuseReason("stale") is ReuseReason.STALE


def test_decision_is_frozen() -> None:
    d = decide(HISTORY, HISTORY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.num_tokens = 0  # type: ignore[misc]


GOOD_HASHES = block_hashes(HISTORY, BS)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"retained_block_ids": [1, 2, 3]}, "4 block hashes but 3 block ids"),
        ({"retained_hashes": GOOD_HASHES[:2]}, "2 block hashes but 4 block ids"),
        ({"retained_block_ids": [1, -2, 3, 4]}, "block id 1 must be a non-negative int"),
        ({"retained_block_ids": [1, True, 3, 4]}, "block id 1 must be a non-negative int"),
        ({"retained_block_ids": [1, "2", 3, 4]}, "block id 1 must be a non-negative int"),
        ({"retained_block_ids": [1, 2.0, 3, 4]}, "block id 1 must be a non-negative int"),
        ({"retained_block_ids": [1, 2, 1, 4]}, "block id 1 appears more than once"),
        ({"retained_hashes": [*GOOD_HASHES[:3], b"short"]}, "hash 3 must be 16 bytes"),
        ({"retained_hashes": [*GOOD_HASHES[:3], "ab" * 8]}, "hash 3 must be 16 bytes"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"block_size": True}, "block_size must be an int"),
        ({"threshold": -1}, "threshold must be >= 0"),
        ({"threshold": 64.0}, "threshold must be an int"),
        ({"local_hit_tokens": -4}, "local_hit_tokens must be >= 0"),
        ({"local_hit_tokens": 6}, "not a multiple of block_size"),
        ({"local_hit_tokens": 20}, "exceeds the prompt's 4 full blocks"),
    ],
)
def test_malformed_input_is_rejected(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decide(HISTORY, HISTORY, **overrides)


def test_malformed_retention_is_rejected_even_when_disabled() -> None:
    with pytest.raises(ValueError, match="must pair one to one"):
        decide(HISTORY, HISTORY, enabled=False, retained_block_ids=[1])


def test_hostile_hashes_that_do_not_match_read_nothing() -> None:
    forged = [b"\0" * 16] * 4
    d = decide(HISTORY, None, retained_hashes=forged, retained_block_ids=[5, 6, 7, 8])
    assert d.reason is ReuseReason.UNVERIFIED and not d.reused
