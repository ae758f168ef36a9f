"""The prefill's reuse report: what a prefill leg did with the retention it was given.

The scheduler is built with ``__new__`` and only the attributes the reuse path reads; vLLM's
own constructor needs a whole engine config. Where the path calls into vLLM's NIXL scheduler,
the real method runs over the minimal state it reads, except ``request_finished`` on a prefill,
which is replaced by a stub returning the P->D params vLLM would.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.v1.outputs import KVConnectorOutput

from kvturn.wire import ReuseReason
from kvturn_server.connector._calibration import Calibration
from kvturn_server.connector._config import ConnectorConfig
from kvturn_server.connector._cost import COMPUTE_WARMUP, READ_WARMUP, CostModel, CostSettings
from kvturn_server.connector._hashing import DEFAULT_SEED, block_hashes
from kvturn_server.connector._params import FORMAT, KVTURN_FIELD
from kvturn_server.connector._prefill import (
    COST_GAUGE_INTERVAL,
    PrefillSide,
    ReadRules,
    ReuseRecord,
    _chunks,
    make_calibration,
)
from kvturn_server.connector._scheduler import KVTurnPullScheduler
from kvturn_server.connector._stats import KVTurnStats

BS = 4
RETAINED = list(range(100, 118))  # 4 full blocks + 2 tokens on the decode
D_BLOCKS = [40, 41, 42, 43]


@dataclass
class FakeRequest:
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any]
    request_id: str = "req-1"
    # What vLLM's prefix cache keys on besides token ids: none of it here (plain text).
    lora_request: Any = None
    mm_features: list[Any] = field(default_factory=list)
    cache_salt: str | None = None
    prompt_embeds: Any = None


def scheduler(threshold: int = 0, enabled: bool = True) -> KVTurnPullScheduler:
    """The adapter over a prefill side (no cost model), with the vLLM state its hooks read."""
    sched = KVTurnPullScheduler.__new__(KVTurnPullScheduler)
    sched.block_size = BS
    sched.kv_recompute_threshold = threshold
    sched.is_bidirectional_kv_xfer_enabled = enabled
    sched.is_decode = False
    sched.control = None
    sched.side = PrefillSide(ReadRules(engine_id="prefill-engine", block_size=BS,
                                       hash_seed=DEFAULT_SEED, threshold=threshold,
                                       enabled=enabled))
    # What vLLM's update_connector_output reads (heartbeats of reads in flight).
    sched._heartbeat_req_engine = {}
    sched._heartbeat_by_engine = {}
    return sched


def side(sched: KVTurnPullScheduler) -> PrefillSide:
    assert isinstance(sched.side, PrefillSide)
    return sched.side


def null_template() -> dict[str, Any]:
    """The router's prefill params when it has no retention for the conversation."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def retention_params(retained: list[int] = RETAINED) -> dict[str, Any]:
    """A pinned retention's params, as the router passes them to the prefill leg."""
    return {
        "do_remote_decode": True, "do_remote_prefill": False,
        "remote_engine_id": "decode-engine", "remote_request_id": "kvturn-read/d-req",
        "remote_host": "127.0.0.1", "remote_port": 5600,
        "remote_block_ids": [list(D_BLOCKS)], "remote_num_tokens": 16,
        KVTURN_FIELD: {"format": FORMAT, "block_size": BS, "conversation": "t/k",
                       "block_hashes": [h.hex() for h in block_hashes(retained[:16], BS)]},
    }


def plan(sched: KVTurnPullScheduler, prompt: list[int], local: int,
         params: dict[str, Any], request_id: str = "req-1") -> FakeRequest:
    request = FakeRequest(prompt, params, request_id)
    side(sched).plan(request, local, params)
    return request


# _plan_reuse: one record per request.


def test_the_null_template_is_recorded_as_a_miss_with_the_local_hit() -> None:
    sched = scheduler()
    plan(sched, [*RETAINED, 1], 8, null_template())
    assert side(sched).records == {"req-1": ReuseRecord(ReuseReason.MISS, 0, 8)}
    assert side(sched).records["req-1"].report() == {"reason": "miss", "reused_tokens": 0,
                                              "local_tokens": 8}


def test_a_verified_retention_is_recorded_with_its_decision() -> None:
    sched = scheduler()
    params = retention_params()
    plan(sched, [*RETAINED, 7, 8], 4, params)
    record = side(sched).records["req-1"]
    assert record == ReuseRecord(ReuseReason.HIT, 12, 4)
    assert params["remote_block_ids"] == [[41, 42, 43]]
    assert params[KVTURN_FIELD]["decision"] == "hit"


@pytest.mark.parametrize(("prompt", "threshold", "reason", "reused"), [
    ([*RETAINED[:8], 9, 9, 9, 9, 9, 9, 9, 9, 1], 0, ReuseReason.PARTIAL, 8),
    ([9, *RETAINED], 0, ReuseReason.UNVERIFIED, 0),
    ([*RETAINED, 1], 64, ReuseReason.BELOW_THRESHOLD, 0),
])
def test_each_decision_is_recorded_as_decided(prompt: list[int], threshold: int,
                                              reason: ReuseReason, reused: int) -> None:
    sched = scheduler(threshold)
    plan(sched, prompt, 0, retention_params())
    assert side(sched).records["req-1"] == ReuseRecord(reason, reused, 0)


def test_reuse_turned_off_is_recorded_as_disabled() -> None:
    sched = scheduler(enabled=False)
    params = retention_params()
    plan(sched, [*RETAINED, 1], 0, params)
    assert side(sched).records["req-1"].reason is ReuseReason.DISABLED
    assert params["remote_block_ids"] == [[]]


def test_a_retention_without_hashes_reads_nothing_and_is_unverified() -> None:
    sched = scheduler()
    params = retention_params()
    del params[KVTURN_FIELD]
    plan(sched, [*RETAINED, 1], 0, params)
    assert side(sched).records["req-1"] == ReuseRecord(ReuseReason.UNVERIFIED, 0, 0)
    assert (params["remote_block_ids"], params["remote_num_tokens"]) == ([[]], 0)


def test_after_the_one_transfer_is_used_up_nothing_loads_and_the_first_record_stays() -> None:
    sched = scheduler()
    params = retention_params()
    plan(sched, [*RETAINED, 1], 0, params)
    first = side(sched).records["req-1"]
    # vLLM marks the request's one transfer as done once it allocated blocks for it.
    params["_remote_blocks_processed"] = True
    params["do_remote_prefill"] = False
    plan(sched, [*RETAINED, 1], 0, params)  # retry after a failed read, or re-admission
    assert params["remote_block_ids"] == [[]]
    assert params["remote_num_tokens"] == 0
    assert side(sched).records["req-1"] is first
    assert first == ReuseRecord(ReuseReason.HIT, 16, 0)


def test_planning_again_before_the_transfer_gives_the_same_record() -> None:
    sched = scheduler()
    params = retention_params()
    plan(sched, [*RETAINED, 7], 4, params)
    first_params = copy.deepcopy(params)
    first = side(sched).records["req-1"]
    plan(sched, [*RETAINED, 7], 4, params)
    assert side(sched).records["req-1"] == first
    assert params == first_params


# Failed reads, reported by the workers through vLLM's connector output.


def test_a_failed_read_turns_the_report_into_stale_with_nothing_reused() -> None:
    sched = scheduler()
    plan(sched, [*RETAINED, 1], 0, retention_params())
    sched.update_connector_output(KVConnectorOutput(failed_recving={"req-1"}))
    record = side(sched).records["req-1"]
    assert record.read_failed
    assert record.report() == {"reason": "stale", "reused_tokens": 0, "local_tokens": 0,
                               "read_failed": True}
    side(sched).record_outcome(record)
    assert side(sched)._stats.data["kvturn_reuse"] == ["stale"]
    assert side(sched)._stats.data["kvturn_reused_tokens"] == [0]
    assert side(sched)._stats.data["kvturn_fallbacks"] == ["read_failed"]


def test_a_failed_read_of_a_request_that_read_nothing_from_a_decode_changes_nothing() -> None:
    sched = scheduler()
    plan(sched, [*RETAINED, 1], 0, null_template(), request_id="miss")
    plan(sched, [*RETAINED, 1], 0, retention_params(), request_id="hit")
    sched.update_connector_output(KVConnectorOutput(failed_recving={"miss", "unknown"}))
    assert not side(sched).records["miss"].read_failed
    assert not side(sched).records["hit"].read_failed
    assert "unknown" not in side(sched).records


def test_finished_reads_still_reach_vllms_bookkeeping() -> None:
    sched = scheduler()
    sched._heartbeat_req_engine["req-1"] = ("decode-engine", "kvturn-read/d-req")
    sched.update_connector_output(KVConnectorOutput(finished_recving={"req-1"}))
    assert sched._heartbeat_req_engine == {}


# The outcome, at finish.


@pytest.mark.parametrize(("reason", "fallback"), [
    (ReuseReason.HIT, None),
    (ReuseReason.PARTIAL, None),
    (ReuseReason.MISS, None),
    (ReuseReason.DISABLED, None),
    (ReuseReason.EXPIRED, "expired"),
    (ReuseReason.STALE, "stale"),
    (ReuseReason.UNVERIFIED, "unverified"),
    (ReuseReason.BELOW_THRESHOLD, "below-threshold"),
])
def test_record_outcome_counts_a_fallback_only_when_a_retention_was_not_used(
        reason: ReuseReason, fallback: str | None) -> None:
    prefill = side(scheduler())
    prefill.record_outcome(ReuseRecord(reason, 8 if reason is ReuseReason.HIT else 0, 4))
    assert prefill._stats.data["kvturn_reuse"] == [reason.value]
    assert prefill._stats.data["kvturn_reused_tokens"] == [8 if reason is ReuseReason.HIT else 0]
    assert prefill._stats.data["kvturn_fallbacks"] == ([] if fallback is None else [fallback])


def test_a_failed_read_is_the_fallback_whatever_the_decision_was() -> None:
    sched = scheduler()
    side(sched).record_outcome(ReuseRecord(ReuseReason.PARTIAL, 8, 0, read_failed=True))
    assert side(sched)._stats.data["kvturn_fallbacks"] == ["read_failed"]
    assert side(sched)._stats.data["kvturn_reuse"] == ["stale"]


@pytest.fixture
def vllm_finish(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Stub vLLM's prefill-side request_finished: the P->D params it returns."""
    out: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False,
                           "remote_block_ids": [[7, 8]], "remote_engine_id": "prefill-engine"}

    def request_finished(self: Any, request: Any, block_ids: Any) -> tuple[bool, Any]:
        return True, (dict(out) if out else None)

    monkeypatch.setattr(NixlPullConnectorScheduler, "request_finished", request_finished)
    return out


def test_request_finished_puts_the_report_in_the_prefills_response(
        vllm_finish: dict[str, Any]) -> None:
    sched = scheduler()
    request = plan(sched, [*RETAINED, 7, 8], 4, retention_params())
    delay, out = sched.request_finished(request, ([1, 2, 3, 4, 5],))
    assert delay is True
    assert out is not None
    assert out["remote_engine_id"] == "prefill-engine"
    assert out[KVTURN_FIELD] == {"reuse": {"reason": "hit", "reused_tokens": 12,
                                           "local_tokens": 4}}
    assert side(sched).records == {}
    assert side(sched)._stats.data["kvturn_reuse"] == ["hit"]
    assert side(sched)._stats.data["kvturn_reused_tokens"] == [12]


def test_request_finished_after_a_failed_read_reports_stale(
        vllm_finish: dict[str, Any]) -> None:
    sched = scheduler()
    request = plan(sched, [*RETAINED, 7, 8], 4, retention_params())
    sched.update_connector_output(KVConnectorOutput(failed_recving={"req-1"}))
    _, out = sched.request_finished(request, ([1, 2, 3, 4, 5],))
    assert out is not None
    assert out[KVTURN_FIELD]["reuse"] == {"reason": "stale", "reused_tokens": 0,
                                          "local_tokens": 4, "read_failed": True}
    assert side(sched)._stats.data["kvturn_fallbacks"] == ["read_failed"]


def test_request_finished_without_vllm_params_still_counts_the_outcome(
        vllm_finish: dict[str, Any]) -> None:
    vllm_finish.clear()  # vLLM returns None (the prefill was aborted)
    sched = scheduler()
    request = plan(sched, [*RETAINED, 1], 0, null_template())
    assert sched.request_finished(request, ([1],)) == (True, None)
    assert side(sched)._stats.data["kvturn_reuse"] == ["miss"]
    assert side(sched).records == {}


# Stats handed to vLLM every step.


def test_take_stats_is_none_until_something_happened_then_hands_over_once() -> None:
    sched = scheduler()
    assert sched.take_stats() is None
    side(sched).record_outcome(ReuseRecord(ReuseReason.MISS, 0, 0))
    stats = sched.take_stats()
    assert stats is not None
    assert stats.data["kvturn_reuse"] == ["miss"]
    assert sched.take_stats() is None


# The cost model in the scheduler: the decision, the report, the fallback metric, calibration.

# Per-token KV of the fake instance: 4 tokens a block, 1 MB a block.
BLOCK_BYTES = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def costed(clock: Clock | None = None, threshold: int = 0,
           **settings: float | None) -> KVTurnPullScheduler:
    """A prefill with the cost model on. Reading costs ``read_fixed_ms`` + 0.25 ms a token (1 GB/s
    by default); computing 1 ms a token at 1,000 tokens/s (attention negligible at these
    contexts)."""
    sched = scheduler(threshold)
    values: dict[str, Any] = {"read_fixed_ms": 1.0, "read_gbps": 1.0,
                              "compute_tokens_per_s": 1000.0,
                              "compute_attention_tokens": 10**9}
    values.update(settings)
    model = CostModel(CostSettings(**values), bytes_per_token=BLOCK_BYTES / BS)
    side(sched).calibration = Calibration(model, clock=clock or Clock())
    return sched


def test_a_range_worth_reading_is_read_and_the_report_says_why() -> None:
    sched = costed(read_fixed_ms=2.0)
    params = retention_params()
    plan(sched, [*RETAINED, 7, 8], 4, params)  # 12 tokens: read 5 ms, compute 12 ms
    record = side(sched).records["req-1"]
    assert (record.reason, record.reused_tokens) == (ReuseReason.HIT, 12)
    assert params["remote_block_ids"] == [[41, 42, 43]]
    assert record.report() == {
        "reason": "hit", "reused_tokens": 12, "local_tokens": 4,
        "cost": {"tokens": 12, "read_ms": 5.0, "compute_ms": 12.0, "source": "configured"}}
    side(sched).record_outcome(record)
    assert side(sched)._stats.data["kvturn_fallbacks"] == []


def test_a_range_cheaper_to_compute_is_reported_below_threshold_with_its_costs() -> None:
    sched = costed(read_fixed_ms=20.0)
    params = retention_params()
    plan(sched, [*RETAINED, 7, 8], 4, params)
    assert params["remote_block_ids"] == [[]]
    assert params["remote_num_tokens"] == 0
    assert params[KVTURN_FIELD]["decision"] == "below-threshold"
    record = side(sched).records["req-1"]
    assert record.cheaper_to_compute
    assert record.report() == {
        "reason": "below-threshold", "reused_tokens": 0, "local_tokens": 4,
        "cost": {"tokens": 12, "read_ms": 23.0, "compute_ms": 12.0, "source": "configured"}}
    assert side(sched).calibration is not None and side(sched).calibration._reads == {}
    side(sched).record_outcome(record)
    assert side(sched)._stats.data["kvturn_reuse"] == ["below-threshold"]
    assert side(sched)._stats.data["kvturn_fallbacks"] == ["cheaper_to_compute"]


@pytest.mark.parametrize(("fixed_ms", "loaded"), [(20.0, (0, False)), (2.0, (12, True))])
def test_vllm_loads_exactly_what_the_cost_model_accepted(
        fixed_ms: float, loaded: tuple[int, bool]) -> None:
    sched = costed(read_fixed_ms=fixed_ms)
    prompt = [*RETAINED, 7, 8]
    request: Any = SimpleNamespace(prompt_token_ids=prompt, num_prompt_tokens=len(prompt),
                                   kv_transfer_params=retention_params(), request_id="req-1",
                                   lora_request=None, mm_features=[], cache_salt=None,
                                   prompt_embeds=None)
    assert sched.get_num_new_matched_tokens(request, 4) == loaded


def test_below_the_recompute_threshold_no_cost_is_reported() -> None:
    sched = costed(threshold=64, read_fixed_ms=0.0)
    plan(sched, [*RETAINED, 1], 0, retention_params())
    record = side(sched).records["req-1"]
    assert record == ReuseRecord(ReuseReason.BELOW_THRESHOLD, 0, 0)
    assert "cost" not in record.report()
    side(sched).record_outcome(record)
    assert side(sched)._stats.data["kvturn_fallbacks"] == ["below-threshold"]


def test_with_the_cost_model_off_reports_carry_no_cost() -> None:
    sched = scheduler()  # calibration None: what reuse_cost_model "off" builds
    plan(sched, [*RETAINED, 7, 8], 4, retention_params())
    assert "cost" not in side(sched).records["req-1"].report()


def test_an_uncalibrated_model_reports_default_as_its_source() -> None:
    sched = scheduler()
    side(sched).calibration = Calibration(CostModel(CostSettings(), bytes_per_token=1000.0))
    plan(sched, [*RETAINED, 7, 8], 4, retention_params())
    cost = side(sched).records["req-1"].report()["cost"]
    assert cost["source"] == "default" and cost["tokens"] == 12


def test_a_failed_read_keeps_its_cost_in_the_report() -> None:
    sched = costed(read_fixed_ms=2.0)
    plan(sched, [*RETAINED, 7, 8], 4, retention_params())
    sched.update_connector_output(KVConnectorOutput(failed_recving={"req-1"}))
    report = side(sched).records["req-1"].report()
    assert report["read_failed"] is True and report["reason"] == "stale"
    assert report["cost"]["tokens"] == 12


# Calibration through the hooks vLLM calls.


@dataclass
class FakeNewRequest:
    req_id: str
    num_computed_tokens: int


def scheduler_output(**chunks: tuple[int, int]) -> Any:
    """A SchedulerOutput's fields the calibration reads: ``name=(tokens, context)``; the first
    request is new, the others cached."""
    names = list(chunks)
    return SimpleNamespace(
        num_scheduled_tokens={name: n for name, (n, _) in chunks.items()},
        scheduled_new_reqs=[FakeNewRequest(name, chunks[name][1]) for name in names[:1]],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=names[1:], num_computed_tokens=[chunks[name][1] for name in names[1:]]))


@pytest.fixture
def vllm_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stub vLLM's build_connector_meta (it needs a whole engine's request state)."""
    monkeypatch.setattr(NixlPullConnectorScheduler, "build_connector_meta",
                        lambda self, scheduler_output: "meta")


def test_chunks_are_read_from_the_scheduler_output() -> None:
    out = scheduler_output(a=(100, 0), b=(16, 4000), c=(1, 77))
    assert _chunks(out) == [(100, 0), (16, 4000), (1, 77)]


def test_steps_calibrate_the_compute_rate(vllm_meta: None) -> None:
    clock = Clock()
    sched = costed(clock, compute_tokens_per_s=None)
    assert side(sched).calibration is not None
    for _ in range(COMPUTE_WARMUP):
        assert sched.build_connector_meta(scheduler_output(a=(300, 0), b=(100, 500))) == "meta"
        clock.now += 0.2  # 400 tokens in 0.2 s
        sched.update_connector_output(KVConnectorOutput())
    rate = side(sched).calibration.model.snapshot()["compute_tokens_per_s"]
    assert rate["source"] == "calibrated"
    assert rate["value"] == pytest.approx(2000.0, rel=1e-6)


def test_reads_and_nixl_transfers_calibrate_the_read_cost(vllm_meta: None) -> None:
    clock = Clock()
    sched = costed(clock, read_fixed_ms=None, read_gbps=None)
    assert side(sched).calibration is not None
    for i in range(READ_WARMUP + 1):  # the first read from the decode pays the handshake
        req = f"req-{i}"
        plan(sched, [*RETAINED, 7, 8], 4, retention_params(), request_id=req)
        clock.now += 0.004
        stats = KVTurnStats()
        stats.record_transfer(SimpleNamespace(xferDuration=1500, postDuration=100,
                                              totalBytes=3 * BLOCK_BYTES, descCount=3))
        sched.update_connector_output(KVConnectorOutput(finished_recving={req},
                                                        kv_connector_stats=stats))
    snap = side(sched).calibration.model.snapshot()
    assert snap["read_gbps"]["value"] == pytest.approx(2.0)  # 3 MB in 1.5 ms
    assert snap["read_gbps"]["source"] == "calibrated"
    # 4 ms waited; 1.5 ms of it is the transfer at the bandwidth in use (default at first).
    assert snap["read_fixed_ms"]["samples"] == READ_WARMUP
    assert snap["read_fixed_ms"]["source"] == "calibrated"
    assert 2.0 < snap["read_fixed_ms"]["value"] < 4.0
    plan(sched, [*RETAINED, 7, 8], 4, retention_params(), request_id="next")
    cost = side(sched).records["next"].report()["cost"]
    assert cost["source"] == "configured"  # the read side calibrated, compute configured


def test_a_calibrated_read_cost_turns_the_decision(vllm_meta: None) -> None:
    """Reads turn out slow: the next short range is computed instead."""
    clock = Clock()
    sched = costed(clock, read_fixed_ms=None)
    assert side(sched).calibration is not None
    for i in range(READ_WARMUP + 1):
        plan(sched, [*RETAINED, 7, 8], 4, retention_params(), request_id=f"r{i}")
        assert side(sched).records[f"r{i}"].reused_tokens == 12
        clock.now += 0.050  # each read kept its request waiting 50 ms
        sched.update_connector_output(KVConnectorOutput(finished_recving={f"r{i}"}))
    plan(sched, [*RETAINED, 7, 8], 4, retention_params(), request_id="next")
    record = side(sched).records["next"]
    assert record.cheaper_to_compute
    assert record.report()["cost"]["read_ms"] > 40


def test_a_finished_request_stops_its_read_timing(vllm_finish: dict[str, Any]) -> None:
    sched = costed(read_fixed_ms=2.0)
    request = plan(sched, [*RETAINED, 7, 8], 4, retention_params())
    assert side(sched).calibration is not None and "req-1" in side(sched).calibration._reads
    sched.request_finished(request, ([1, 2, 3, 4, 5],))
    assert side(sched).calibration._reads == {}


def test_control_stats_show_the_cost_model_on_a_prefill_only() -> None:
    assert side(scheduler()).control_stats() == {}
    stats = side(costed()).control_stats()
    assert stats["cost_model"]["read_fixed_ms"] == {"value": 1.0, "source": "configured",
                                                    "calibrated": None, "samples": 0}


def test_cost_gauges_are_sampled_at_most_once_an_interval() -> None:
    sched = costed()
    stats = sched.take_stats()
    assert stats is not None
    assert stats.data["kvturn_cost_read_fixed_seconds"] == [pytest.approx(0.001)]
    assert stats.data["kvturn_cost_read_bytes_per_second"] == [pytest.approx(1e9)]
    assert stats.data["kvturn_cost_compute_tokens_per_second"] == [pytest.approx(1000.0)]
    assert sched.take_stats() is None  # within COST_GAUGE_INTERVAL of the last sample
    side(sched)._cost_gauges_at -= COST_GAUGE_INTERVAL
    assert sched.take_stats() is not None


# Building the cost model from vLLM's configs.


def configs(hidden_size: int = 896) -> tuple[Any, Any]:
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(
        get_hidden_size=lambda: hidden_size))
    kv_cache_config = SimpleNamespace(
        num_blocks=10, kv_cache_tensors=[SimpleNamespace(size=10 * 4096)] * 2)
    return vllm_config, kv_cache_config


def test_the_cost_model_gets_this_instances_kv_bytes_per_token_and_hidden_size() -> None:
    calibration = make_calibration(ConnectorConfig(), *configs(), BS)
    assert calibration is not None
    assert calibration.model.bytes_per_token == 2 * 4096 / BS
    assert calibration.model.attention_tokens == 6 * 896


def test_reuse_cost_model_off_builds_no_cost_model() -> None:
    off = ConnectorConfig(reuse_cost_model="off")
    assert make_calibration(off, *configs(), BS) is None


def test_an_empty_kv_cache_falls_back_to_the_threshold(caplog: pytest.LogCaptureFixture) -> None:
    vllm_config, _ = configs()
    empty = SimpleNamespace(num_blocks=0, kv_cache_tensors=[])
    with caplog.at_level(logging.WARNING, logger="kvturn.connector"):
        assert make_calibration(ConnectorConfig(), vllm_config, empty, BS) is None
    assert "recompute threshold alone decides" in caplog.text
