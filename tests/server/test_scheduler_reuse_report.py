"""The prefill's reuse report: what a prefill leg did with the retention it was given.

The scheduler is built with ``__new__`` and only the attributes the reuse path reads; vLLM's
own constructor needs a whole engine config. Where the path calls into vLLM's NIXL scheduler,
the real method runs over the minimal state it reads, except ``request_finished`` on a prefill,
which is replaced by a stub returning the P->D params vLLM would.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.v1.outputs import KVConnectorOutput

from kvturn_server.connector._hashing import block_hashes
from kvturn_server.connector._reuse import ReuseReason
from kvturn_server.connector._scheduler import (
    FORMAT,
    KVTURN_FIELD,
    KVTurnPullScheduler,
    ReuseRecord,
)
from kvturn_server.connector._stats import KVTurnStats

BS = 4
RETAINED = list(range(100, 118))  # 4 full blocks + 2 tokens on the decode
D_BLOCKS = [40, 41, 42, 43]


@dataclass
class FakeRequest:
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any]
    request_id: str = "req-1"


def scheduler(threshold: int = 0, enabled: bool = True) -> KVTurnPullScheduler:
    sched = KVTurnPullScheduler.__new__(KVTurnPullScheduler)
    sched.block_size = BS
    sched.kv_recompute_threshold = threshold
    sched.is_bidirectional_kv_xfer_enabled = enabled
    sched._reuse = {}
    sched._local_hits = {}
    sched.is_decode = False
    sched.calibration = None
    sched._stats = KVTurnStats()
    sched._gauges = (0, 0, 0)
    sched.keeper = None
    # What vLLM's update_connector_output reads (heartbeats of reads in flight).
    sched._heartbeat_req_engine = {}
    sched._heartbeat_by_engine = {}
    return sched


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
    sched._plan_reuse(request, local, params)
    return request


# _plan_reuse: one record per request.


def test_the_null_template_is_recorded_as_a_miss_with_the_local_hit() -> None:
    sched = scheduler()
    plan(sched, [*RETAINED, 1], 8, null_template())
    assert sched._reuse == {"req-1": ReuseRecord(ReuseReason.MISS, 0, 8)}
    assert sched._reuse["req-1"].report() == {"reason": "miss", "reused_tokens": 0,
                                              "local_tokens": 8}


def test_a_verified_retention_is_recorded_with_its_decision() -> None:
    sched = scheduler()
    params = retention_params()
    plan(sched, [*RETAINED, 7, 8], 4, params)
    record = sched._reuse["req-1"]
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
    assert sched._reuse["req-1"] == ReuseRecord(reason, reused, 0)


def test_reuse_turned_off_is_recorded_as_disabled() -> None:
    sched = scheduler(enabled=False)
    params = retention_params()
    plan(sched, [*RETAINED, 1], 0, params)
    assert sched._reuse["req-1"].reason is ReuseReason.DISABLED
    assert params["remote_block_ids"] == [[]]


def test_a_retention_without_hashes_reads_nothing_and_is_unverified() -> None:
    sched = scheduler()
    params = retention_params()
    del params[KVTURN_FIELD]
    plan(sched, [*RETAINED, 1], 0, params)
    assert sched._reuse["req-1"] == ReuseRecord(ReuseReason.UNVERIFIED, 0, 0)
    assert (params["remote_block_ids"], params["remote_num_tokens"]) == ([[]], 0)


def test_after_the_one_transfer_is_used_up_nothing_loads_and_the_first_record_stays() -> None:
    sched = scheduler()
    params = retention_params()
    plan(sched, [*RETAINED, 1], 0, params)
    first = sched._reuse["req-1"]
    # vLLM marks the request's one transfer as done once it allocated blocks for it.
    params["_remote_blocks_processed"] = True
    params["do_remote_prefill"] = False
    plan(sched, [*RETAINED, 1], 0, params)  # retry after a failed read, or re-admission
    assert params["remote_block_ids"] == [[]]
    assert params["remote_num_tokens"] == 0
    assert sched._reuse["req-1"] is first
    assert first == ReuseRecord(ReuseReason.HIT, 16, 0)


def test_planning_again_before_the_transfer_gives_the_same_record() -> None:
    sched = scheduler()
    params = retention_params()
    plan(sched, [*RETAINED, 7], 4, params)
    first_params = copy.deepcopy(params)
    first = sched._reuse["req-1"]
    plan(sched, [*RETAINED, 7], 4, params)
    assert sched._reuse["req-1"] == first
    assert params == first_params


# Failed reads, reported by the workers through vLLM's connector output.


def test_a_failed_read_turns_the_report_into_stale_with_nothing_reused() -> None:
    sched = scheduler()
    plan(sched, [*RETAINED, 1], 0, retention_params())
    sched.update_connector_output(KVConnectorOutput(failed_recving={"req-1"}))
    record = sched._reuse["req-1"]
    assert record.read_failed
    assert record.report() == {"reason": "stale", "reused_tokens": 0, "local_tokens": 0,
                               "read_failed": True}
    sched._record_outcome(record)
    assert sched._stats.data["kvturn_reuse"] == ["stale"]
    assert sched._stats.data["kvturn_reused_tokens"] == [0]
    assert sched._stats.data["kvturn_fallbacks"] == ["read-failed"]


def test_a_failed_read_of_a_request_that_read_nothing_from_a_decode_changes_nothing() -> None:
    sched = scheduler()
    plan(sched, [*RETAINED, 1], 0, null_template(), request_id="miss")
    plan(sched, [*RETAINED, 1], 0, retention_params(), request_id="hit")
    sched.update_connector_output(KVConnectorOutput(failed_recving={"miss", "unknown"}))
    assert not sched._reuse["miss"].read_failed
    assert not sched._reuse["hit"].read_failed
    assert "unknown" not in sched._reuse


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
    sched = scheduler()
    sched._record_outcome(ReuseRecord(reason, 8 if reason is ReuseReason.HIT else 0, 4))
    assert sched._stats.data["kvturn_reuse"] == [reason.value]
    assert sched._stats.data["kvturn_reused_tokens"] == [8 if reason is ReuseReason.HIT else 0]
    assert sched._stats.data["kvturn_fallbacks"] == ([] if fallback is None else [fallback])


def test_a_failed_read_is_the_fallback_whatever_the_decision_was() -> None:
    sched = scheduler()
    sched._record_outcome(ReuseRecord(ReuseReason.PARTIAL, 8, 0, read_failed=True))
    assert sched._stats.data["kvturn_fallbacks"] == ["read-failed"]
    assert sched._stats.data["kvturn_reuse"] == ["stale"]


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
    assert sched._reuse == {}
    assert sched._stats.data["kvturn_reuse"] == ["hit"]
    assert sched._stats.data["kvturn_reused_tokens"] == [12]


def test_request_finished_after_a_failed_read_reports_stale(
        vllm_finish: dict[str, Any]) -> None:
    sched = scheduler()
    request = plan(sched, [*RETAINED, 7, 8], 4, retention_params())
    sched.update_connector_output(KVConnectorOutput(failed_recving={"req-1"}))
    _, out = sched.request_finished(request, ([1, 2, 3, 4, 5],))
    assert out is not None
    assert out[KVTURN_FIELD]["reuse"] == {"reason": "stale", "reused_tokens": 0,
                                          "local_tokens": 4, "read_failed": True}
    assert sched._stats.data["kvturn_fallbacks"] == ["read-failed"]


def test_request_finished_without_vllm_params_still_counts_the_outcome(
        vllm_finish: dict[str, Any]) -> None:
    vllm_finish.clear()  # vLLM returns None (the prefill was aborted)
    sched = scheduler()
    request = plan(sched, [*RETAINED, 1], 0, null_template())
    assert sched.request_finished(request, ([1],)) == (True, None)
    assert sched._stats.data["kvturn_reuse"] == ["miss"]
    assert sched._reuse == {}


# Stats handed to vLLM every step.


def test_take_stats_is_none_until_something_happened_then_hands_over_once() -> None:
    sched = scheduler()
    assert sched.take_stats() is None
    sched._record_outcome(ReuseRecord(ReuseReason.MISS, 0, 0))
    stats = sched.take_stats()
    assert stats is not None
    assert stats.data["kvturn_reuse"] == ["miss"]
    assert sched.take_stats() is None
