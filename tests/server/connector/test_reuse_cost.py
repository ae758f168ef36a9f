"""The prefill's cost model: expected read and compute times, their sources, and calibration
from synthetic observations (engine steps, NIXL transfers, reads) on a manual clock."""

from __future__ import annotations

import pytest

from kvturn_server.connector._calibration import (
    MAX_STEPS_IN_FLIGHT,
    MIN_STEP_TOKENS,
    Calibration,
)
from kvturn_server.connector._cost import (
    ALPHA,
    COMPUTE_WARMUP,
    DEFAULT_COMPUTE_TOKENS_PER_S,
    DEFAULT_READ_FIXED_MS,
    DEFAULT_READ_GBPS,
    READ_WARMUP,
    CostModel,
    CostSettings,
    CostSource,
    ReadCost,
    RunningMean,
)

KIB = 1024
LLAMA_8B_KV = 128 * KIB  # bytes per token: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes


def model(bytes_per_token: float = 1e6, **settings: float | int | None) -> CostModel:
    return CostModel(CostSettings(**settings),  # type: ignore[arg-type]
                     bytes_per_token=bytes_per_token, hidden_size=4096)


def pinned(**settings: float | int | None) -> CostModel:
    """Every calibratable parameter configured: estimates are exact arithmetic."""
    values: dict[str, float | int | None] = {
        "read_fixed_ms": 5.0, "read_gbps": 1.0, "compute_tokens_per_s": 1000.0,
        "compute_attention_tokens": 1000}
    values.update(settings)
    return model(**values)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# RunningMean.


def test_a_running_mean_is_unknown_until_warmed_up_then_a_plain_mean() -> None:
    mean = RunningMean(warmup=3)
    for x in (1.0, 2.0):
        mean.observe(x)
        assert mean.value is None
    mean.observe(6.0)
    assert mean.value == pytest.approx(3.0)
    assert mean.samples == 3


def test_a_running_mean_turns_into_an_ewma_after_one_over_alpha_observations() -> None:
    mean = RunningMean(warmup=1, alpha=0.25)
    for x in (8.0, 4.0, 6.0, 6.0):  # weights 1, 1/2, 1/3, 1/4: a plain mean
        mean.observe(x)
    assert mean.value == pytest.approx(6.0)
    mean.observe(2.0)  # a plain mean would give it 1/5; from now on each weighs alpha
    assert mean.value == pytest.approx(6.0 - 0.25 * 4.0)


@pytest.mark.parametrize(("warmup", "alpha"), [(0, 0.1), (3, 0.0), (3, 1.5)])
def test_a_running_mean_refuses_meaningless_parameters(warmup: int, alpha: float) -> None:
    with pytest.raises(ValueError):
        RunningMean(warmup=warmup, alpha=alpha)


# Estimates.


def test_read_time_is_a_fixed_cost_plus_bytes_over_bandwidth() -> None:
    cost = pinned().estimate(tokens=100, context=0)
    # 5 ms + 100 tokens x 1 MB at 1 GB/s
    assert cost.read_ms == pytest.approx(5.0 + 100.0)
    assert cost.source is CostSource.CONFIGURED


def test_compute_time_grows_with_the_context_through_the_attention_term() -> None:
    m = pinned()  # 1000 tokens/s at context 0; attention doubles a token's cost at 1000
    assert m.estimate(1, 0).compute_ms == pytest.approx(1.0)
    assert m.estimate(1, 1000).compute_ms == pytest.approx(2.0)
    # 10 tokens after 500: contexts 500..509, on average 504.5
    assert m.estimate(10, 500).compute_ms == pytest.approx(10 * (1 + 504.5 / 1000))


def test_the_attention_context_defaults_to_six_times_the_hidden_size() -> None:
    m = CostModel(CostSettings(), bytes_per_token=1.0, hidden_size=896)
    assert m.attention_tokens == 6 * 896
    assert CostModel(CostSettings(), bytes_per_token=1.0).attention_tokens == 6 * 4096
    assert model(compute_attention_tokens=777).attention_tokens == 777


def test_reading_is_chosen_only_when_strictly_faster() -> None:
    assert ReadCost(64, 9.999, 10.0, CostSource.DEFAULT).worth_reading
    assert not ReadCost(64, 10.0, 10.0, CostSource.DEFAULT).worth_reading


def test_the_break_even_length_follows_from_the_parameters() -> None:
    # Per token: read 1 MB at 10 GB/s = 0.1 ms; compute at 5,000 tokens/s = 0.2 ms (context 0,
    # attention negligible): the 5 ms fixed cost breaks even at about 50 tokens.
    m = model(read_fixed_ms=5.0, read_gbps=10.0, compute_tokens_per_s=5000.0,
              compute_attention_tokens=10**9)
    assert not m.estimate(48, 0).worth_reading
    assert m.estimate(52, 0).worth_reading


def test_a_long_context_makes_even_a_short_range_worth_reading() -> None:
    m = model(read_fixed_ms=5.0, read_gbps=10.0, compute_tokens_per_s=5000.0)
    assert not m.estimate(16, 0).worth_reading
    assert m.estimate(16, 200_000).worth_reading  # attention at 200k context: 8x the cost


def test_uncalibrated_defaults_read_every_range_a_threshold_of_64_lets_through() -> None:
    # The defaults keep the threshold-only behaviour for all but tiny ranges, on a KV size as
    # large as an 8B model's and far larger.
    for bytes_per_token in (LLAMA_8B_KV, 1024 * KIB):
        m = CostModel(CostSettings(), bytes_per_token=bytes_per_token, hidden_size=4096)
        for tokens in (64, 128, 1024, 16384):
            cost = m.estimate(tokens, 0)
            assert cost.worth_reading, (bytes_per_token, tokens, cost)
            assert cost.source is CostSource.DEFAULT
    small = CostModel(CostSettings(), bytes_per_token=LLAMA_8B_KV).estimate(1, 0)
    assert not small.worth_reading  # one token is never worth a read's fixed cost


def test_default_values_are_the_documented_ones() -> None:
    m = model(bytes_per_token=DEFAULT_READ_GBPS * 1e8)  # 0.1 s a token at the default rate
    cost = m.estimate(1, 0)
    assert cost.read_ms == pytest.approx(DEFAULT_READ_FIXED_MS + 100.0)
    assert cost.compute_ms == pytest.approx(1e3 / DEFAULT_COMPUTE_TOKENS_PER_S)
    assert m.gauges() == pytest.approx((DEFAULT_READ_FIXED_MS / 1e3, DEFAULT_READ_GBPS * 1e9,
                                        DEFAULT_COMPUTE_TOKENS_PER_S))


def test_a_zero_fixed_cost_may_be_configured() -> None:
    assert model(read_fixed_ms=0.0).estimate(1, 0).read_ms == pytest.approx(1e6 / 1e10 * 1e3)


def test_bytes_per_token_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bytes_per_token"):
        CostModel(CostSettings(), bytes_per_token=0)


def test_the_report_rounds_to_microseconds() -> None:
    assert ReadCost(128, 1.23456, 7.0, CostSource.CALIBRATED).report() == {
        "tokens": 128, "read_ms": 1.235, "compute_ms": 7.0, "source": "calibrated"}


# Calibration and sources.


def calibrate_compute(m: CostModel, seconds_per_unit: float, times: int) -> None:
    for _ in range(times):
        chunks = [(200, 0), (100, 300)]
        m.observe_step(chunks, seconds_per_unit * sum(m.work(n, c) for n, c in chunks))


def test_compute_is_calibrated_from_steps_after_warmup() -> None:
    m = model(read_fixed_ms=1.0, read_gbps=1.0)
    calibrate_compute(m, 1e-4, COMPUTE_WARMUP - 1)
    assert m.estimate(10, 0).source is CostSource.DEFAULT
    assert m.snapshot()["compute_tokens_per_s"]["calibrated"] is None
    calibrate_compute(m, 1e-4, 1)
    snap = m.snapshot()["compute_tokens_per_s"]
    assert snap == {"value": pytest.approx(1e4), "source": "calibrated",
                    "calibrated": pytest.approx(1e4), "samples": COMPUTE_WARMUP}
    assert m.estimate(10, 0).source is CostSource.CONFIGURED  # the read side is configured


def test_calibration_follows_a_change_with_weight_alpha() -> None:
    m = model()
    plain = round(1 / ALPHA)  # observations averaged with equal weight
    calibrate_compute(m, 1e-4, plain)
    calibrate_compute(m, 2e-4, 1)
    per_unit = 1e-4 + ALPHA * (2e-4 - 1e-4)
    assert m.gauges()[2] == pytest.approx(1 / per_unit)


def test_a_configured_value_wins_over_calibration_which_is_still_shown() -> None:
    m = model(compute_tokens_per_s=50.0)
    calibrate_compute(m, 1e-4, COMPUTE_WARMUP)
    assert m.snapshot()["compute_tokens_per_s"] == {
        "value": 50.0, "source": "configured", "calibrated": pytest.approx(1e4),
        "samples": COMPUTE_WARMUP}
    assert m.estimate(1, 0).compute_ms == pytest.approx(20.0)


def test_bandwidth_is_calibrated_from_nixl_transfers() -> None:
    m = model()
    for _ in range(READ_WARMUP):
        m.observe_transfer(4e9, 2.0)  # 2 GB/s
    assert m.snapshot()["read_gbps"]["calibrated"] == pytest.approx(2.0)
    assert m.gauges()[1] == pytest.approx(2e9)


def test_the_fixed_cost_is_what_the_transfer_does_not_explain() -> None:
    m = model(bytes_per_token=1e6, read_gbps=1.0)  # 1 ms a token
    for wait in (0.012, 0.014, 0.016):
        m.observe_read(tokens=10, seconds=wait)  # 10 ms of transfer in each
    assert m.snapshot()["read_fixed_ms"]["calibrated"] == pytest.approx(4.0)
    m.observe_read(tokens=10, seconds=0.001)  # faster than the bandwidth says: never negative
    assert m.snapshot()["read_fixed_ms"]["calibrated"] == pytest.approx(4.0 * 3 / 4)


def test_degenerate_observations_are_ignored() -> None:
    m = model()
    m.observe_step([], 1.0)
    m.observe_step([(10, 0)], 0.0)
    m.observe_transfer(0, 1.0)
    m.observe_transfer(10, 0.0)
    m.observe_read(0, 1.0)
    m.observe_read(10, -1.0)
    snap = m.snapshot()
    assert [snap[k]["samples"] for k in ("read_fixed_ms", "read_gbps",
                                         "compute_tokens_per_s")] == [0, 0, 0]


def test_the_source_is_calibrated_only_when_every_number_is() -> None:
    m = model()
    calibrate_compute(m, 1e-4, COMPUTE_WARMUP)
    for _ in range(READ_WARMUP):
        m.observe_transfer(1e9, 0.5)
    assert m.estimate(64, 0).source is CostSource.DEFAULT  # fixed cost still a default
    for _ in range(READ_WARMUP):
        m.observe_read(64, 0.05)
    assert m.estimate(64, 0).source is CostSource.CALIBRATED


def test_snapshot_names_every_parameter_like_the_config_keys() -> None:
    snap = pinned().snapshot()
    assert set(snap) == {"read_fixed_ms", "read_gbps", "compute_tokens_per_s",
                         "compute_attention_tokens", "kv_bytes_per_token"}
    assert snap["read_fixed_ms"]["value"] == 5.0 and snap["read_gbps"]["value"] == 1.0
    assert snap["compute_attention_tokens"] == 1000 and snap["kv_bytes_per_token"] == 1e6


# Calibration: timing steps.


@pytest.fixture
def clock() -> Clock:
    return Clock()


def calibration(clock: Clock) -> Calibration:
    return Calibration(model(compute_attention_tokens=10**9), clock=clock)


def compute_rate(cal: Calibration) -> tuple[int, float | None]:
    snap = cal.model.snapshot()["compute_tokens_per_s"]
    return snap["samples"], snap["calibrated"]


def test_a_step_takes_from_its_scheduling_to_its_report(clock: Clock) -> None:
    cal = calibration(clock)
    for _ in range(COMPUTE_WARMUP):
        cal.step_scheduled([(500, 0), (500, 0)])
        clock.now += 0.1
        cal.step_reported()
        clock.now += 5.0  # idle between steps: not charged to anything
    samples, rate = compute_rate(cal)
    assert samples == COMPUTE_WARMUP
    assert rate == pytest.approx(1000 / 0.1, rel=1e-6)


def test_with_two_steps_in_flight_the_second_starts_when_the_first_reports(
        clock: Clock) -> None:
    cal = calibration(clock)
    cal.step_scheduled([(1000, 0)])
    cal.step_scheduled([(1000, 0)])  # async scheduling: queued behind the first
    for _ in range(COMPUTE_WARMUP):
        clock.now += 0.1
        cal.step_reported()
        cal.step_scheduled([(1000, 0)])
    samples, rate = compute_rate(cal)
    assert samples == COMPUTE_WARMUP
    # The first step took 0.1 s from its scheduling; each later one 0.1 s from its
    # predecessor's report, however early it was scheduled.
    assert rate == pytest.approx(1000 / 0.1, rel=1e-6)


def test_steps_with_few_tokens_are_not_observed(clock: Clock) -> None:
    cal = calibration(clock)
    cal.step_scheduled([(MIN_STEP_TOKENS - 1, 0)])
    clock.now += 0.1
    cal.step_reported()
    assert compute_rate(cal)[0] == 0
    cal.step_scheduled([(MIN_STEP_TOKENS // 2, 0), (MIN_STEP_TOKENS // 2, 9)])
    clock.now += 0.1
    cal.step_reported()
    assert compute_rate(cal)[0] == 1


def test_a_report_of_a_step_that_computed_nothing_observes_nothing(clock: Clock) -> None:
    cal = calibration(clock)
    cal.step_scheduled([])  # every request waits for KV
    cal.step_scheduled([(0, 5)])
    clock.now += 0.1
    cal.step_reported()  # a transfer finished in that step
    cal.step_reported()  # a report with nothing in flight (scheduled before we watched)
    assert compute_rate(cal)[0] == 0


def test_a_report_that_may_belong_to_an_idle_step_is_not_observed(clock: Clock) -> None:
    cal = calibration(clock)
    cal.step_scheduled([])  # idle: it reports only if a transfer finished in it
    cal.step_scheduled([(1000, 0)])
    clock.now += 0.05
    cal.step_reported()  # whose? unknown
    assert compute_rate(cal)[0] == 0
    cal.step_scheduled([(1000, 0)])
    clock.now += 0.1
    cal.step_reported()  # after the ambiguity, steps pair again
    assert compute_rate(cal) == (1, None)


def test_steps_whose_reports_never_come_are_forgotten(clock: Clock) -> None:
    cal = calibration(clock)
    for _ in range(3 * MAX_STEPS_IN_FLIGHT):
        cal.step_scheduled([])
    assert len(cal._steps) == MAX_STEPS_IN_FLIGHT


# Calibration: timing reads.


def fixed_ms(cal: Calibration) -> tuple[int, float | None]:
    snap = cal.model.snapshot()["read_fixed_ms"]
    return snap["samples"], snap["calibrated"]


def test_the_first_read_from_each_engine_pays_the_handshake_and_is_not_observed(
        clock: Clock) -> None:
    cal = Calibration(model(bytes_per_token=1e6, read_gbps=1.0), clock=clock)
    cal.read_planned("a", 10, "decode-1")
    clock.now += 2.0  # NIXL handshake with decode-1
    cal.read_finished({"a"})
    assert fixed_ms(cal)[0] == 0
    cal.read_planned("b", 10, "decode-1")
    clock.now += 0.015
    cal.read_finished({"b"})
    assert fixed_ms(cal)[0] == 1
    cal.read_planned("c", 10, "decode-2")  # a new engine (or a restarted one): handshake
    clock.now += 2.0
    cal.read_finished({"c"})
    assert fixed_ms(cal)[0] == 1
    for req in ("d", "e"):
        cal.read_planned(req, 10, "decode-1")
        clock.now += 0.015
        cal.read_finished({req})
    assert fixed_ms(cal) == (3, pytest.approx(5.0))  # 15 ms waited, 10 ms of it transfer


def test_failed_forgotten_and_replanned_reads(clock: Clock) -> None:
    cal = Calibration(model(bytes_per_token=1e6, read_gbps=1.0), clock=clock)
    cal.read_planned("warm", 1, "d")
    cal.read_finished({"warm"})
    cal.read_planned("failed", 10, "d")
    cal.read_planned("gone", 10, "d")
    cal.read_planned("late", 10, "d")
    clock.now += 1.0
    cal.read_planned("late", 10, "d")  # asked again: it could not be allocated before
    cal.read_finished(set(), failed={"failed"})  # failure reported before the finish
    cal.forget("gone")  # re-planned without a read, or finished (aborted)
    clock.now += 0.012
    cal.read_finished({"failed", "gone", "late", "unknown"}, failed=set())
    assert fixed_ms(cal) == (1, None)
    assert cal._reads == {}
    assert cal.model._read_fixed._mean == pytest.approx(0.002)


def test_nixl_transfers_are_summed_per_report(clock: Clock) -> None:
    cal = calibration(clock)
    cal.transfers([1e9, 3e9], [0.5, 1.5])
    cal.transfers([], [])
    cal.transfers([1e9], [0.0])
    snap = cal.model.snapshot()["read_gbps"]
    assert snap["samples"] == 1
    assert cal.model._read_s_per_byte._mean == pytest.approx(2.0 / 4e9)
