"""The simulator's cost profiles are a roofline of the hardware and the model, and the same
formulas land near published measurements."""

from __future__ import annotations

import pytest

from kvturn_server.connector._cost import CostModel, CostSettings
from kvturn_server.sim import (
    CHECKS,
    H100_SXM,
    H200,
    PROFILES,
    QWEN3_32B,
    CostProfile,
    Efficiency,
    itl_seconds,
    prefill_seconds,
    roofline_profile,
)


def test_qwen3_32b_shape() -> None:
    # 256 KiB of bf16 KV per token, 61 GiB of weights, attention as dear as the matmuls at
    # about 30k tokens of context (the connector's default A = 6 x hidden is 30,720).
    assert QWEN3_32B.kv_bytes_per_token == 262144
    assert round(QWEN3_32B.weight_bytes / 1024 ** 3, 1) == 61.0
    assert 29000 < QWEN3_32B.attention_tokens < 31000


def test_a_10k_token_prefill_on_an_h200_takes_a_third_of_the_old_profile() -> None:
    seconds = prefill_seconds(QWEN3_32B, H200, 1, Efficiency(), 10000)
    at_peak = prefill_seconds(QWEN3_32B, H200, 1, Efficiency(mfu=1.0), 10000)
    assert 1.1 < seconds < 1.35 and 0.7 < at_peak < 0.8
    assert seconds < 4.3 / 3  # the hand-fitted profile's 4.3 s


def test_profiles_follow_the_roofline() -> None:
    h200, h100 = PROFILES["qwen3-32b-h200"], PROFILES["qwen3-32b-h100-tp2"]
    assert h200 == roofline_profile("qwen3-32b-h200", QWEN3_32B, H200)
    # Two H100s compute twice as fast as one H200 and read KV over two NICs; HBM decides ITL.
    assert h100.compute_tokens_per_s == pytest.approx(2 * h200.compute_tokens_per_s, rel=1e-3)
    assert h100.read_gbps == 2 * h200.read_gbps
    assert h200.itl_ms == pytest.approx(
        1e3 * itl_seconds(QWEN3_32B, H200, 1, Efficiency(), 131072), abs=0.01)
    assert h100.memory_gib == pytest.approx(2 * H100_SXM.memory_gib)
    assert "roofline" in h200.source and "MFU 0.6" in h200.source


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.what.split(":")[0])
def test_derived_numbers_land_near_published_ones(check: object) -> None:
    assert 0.9 < check.ratio < 1.1, check.describe()  # type: ignore[attr-defined]


def test_a_profile_configures_the_connectors_cost_model() -> None:
    """The profile keeps CostModel's form: the connector decides with the simulator's numbers."""
    p: CostProfile = PROFILES["qwen3-32b-h200"]
    model = CostModel(CostSettings(read_fixed_ms=p.read_fixed_ms, read_gbps=p.read_gbps,
                                   compute_tokens_per_s=p.compute_tokens_per_s,
                                   compute_attention_tokens=p.attention_tokens),
                      bytes_per_token=QWEN3_32B.kv_bytes_per_token)
    cost = model.estimate(10000, 0)
    assert cost.compute_ms == pytest.approx(
        1e3 * prefill_seconds(QWEN3_32B, H200, 1, Efficiency(), 10000), rel=1e-3)
    assert cost.worth_reading  # 2.6 GB at 40 GB/s beats 1.2 s of compute
