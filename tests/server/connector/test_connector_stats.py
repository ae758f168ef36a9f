"""kvturn's connector stats and Prometheus metrics, on vLLM's connector-stats path.

The metrics are built the way vLLM's ``KVConnectorProm`` builds them (prometheus_client classes
keyed by their own type in ``metric_types``), here bound to a fresh ``CollectorRegistry``.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from kvturn_server.connector._connector import KVTurnConnector
from kvturn_server.connector._stats import KVTURN_KEYS, KVTurnPromMetrics, KVTurnStats

NIXL_KEYS = set(NixlKVConnectorStats().data)
LABELS = ["model_name", "engine"]


def nixl_transfer(stats: NixlKVConnectorStats) -> None:
    stats.record_transfer(SimpleNamespace(xferDuration=20_000, postDuration=1_000,
                                          totalBytes=4096, descCount=12))


# KVTurnStats.


def test_a_fresh_stats_object_has_nixls_and_kvturns_keys_all_empty() -> None:
    stats = KVTurnStats()
    assert set(stats.data) == NIXL_KEYS | set(KVTURN_KEYS)
    assert all(v == [] for v in stats.data.values())
    assert stats.is_empty()


def test_reset_empties_kvturns_keys_too() -> None:
    stats = KVTurnStats()
    stats.record("kvturn_reuse", "hit")
    nixl_transfer(stats)
    stats.reset()
    assert set(stats.data) == NIXL_KEYS | set(KVTURN_KEYS)
    assert stats.is_empty()


def test_record_appends_to_a_key_and_makes_the_stats_non_empty() -> None:
    stats = KVTurnStats()
    stats.record("kvturn_reuse", "hit")
    stats.record("kvturn_reuse", "partial")
    stats.record("kvturn_something_new", 1)  # an unknown key is kept, not dropped
    assert stats.data["kvturn_reuse"] == ["hit", "partial"]
    assert stats.data["kvturn_something_new"] == [1]
    assert not stats.is_empty()


@pytest.mark.parametrize("key", KVTURN_KEYS)
def test_any_kvturn_sample_makes_the_stats_non_empty(key: str) -> None:
    stats = KVTurnStats()
    stats.record(key, 1)
    assert not stats.is_empty()


def test_nixl_samples_alone_make_the_stats_non_empty() -> None:
    stats = KVTurnStats()
    stats.record_failed_transfer()
    assert not stats.is_empty()


def test_aggregate_with_plain_nixl_stats_keeps_both_sides() -> None:
    ours = KVTurnStats()
    ours.record("kvturn_reuse", "hit")
    nixl_transfer(ours)
    theirs = NixlKVConnectorStats()
    nixl_transfer(theirs)
    theirs.record_failed_transfer()
    result = ours.aggregate(theirs)
    assert result is ours
    assert ours.data["kvturn_reuse"] == ["hit"]
    assert ours.data["transfer_duration"] == [0.02, 0.02]
    assert ours.data["num_failed_transfers"] == [1]


def test_aggregate_with_data_lacking_kvturns_keys_works_either_way() -> None:
    nixl_only = NixlKVConnectorStats()
    nixl_transfer(nixl_only)
    older = KVTurnStats(data=dict(nixl_only.data))  # an older kvturn, or plain NIXL data
    assert not older.is_empty()
    ours = KVTurnStats()
    ours.record("kvturn_read_timeouts", 1)
    older.aggregate(ours)
    assert older.data["kvturn_read_timeouts"] == [1]
    assert older.data["bytes_transferred"] == [4096]
    ours.aggregate(KVTurnStats(data=dict(nixl_only.data)))
    assert ours.data["bytes_transferred"] == [4096]
    assert ours.data["kvturn_read_timeouts"] == [1]


def test_aggregate_concatenates_kvturn_samples_in_order() -> None:
    a, b = KVTurnStats(), KVTurnStats()
    a.record("kvturn_retention_events", "created")
    b.record("kvturn_retention_events", "pinned")
    b.record("kvturn_retention_events", "released")
    a.aggregate(b)
    assert a.data["kvturn_retention_events"] == ["created", "pinned", "released"]


def test_stats_round_trip_through_the_connectors_builder() -> None:
    stats = KVTurnStats()
    stats.record("kvturn_reuse", "partial")
    stats.record("kvturn_reused_tokens", 48)
    nixl_transfer(stats)
    rebuilt = KVTurnConnector.build_kv_connector_stats(stats.to_dict())
    assert isinstance(rebuilt, KVTurnStats)
    assert rebuilt.data == stats.data
    assert not rebuilt.is_empty()
    fresh = KVTurnConnector.build_kv_connector_stats()
    assert isinstance(fresh, KVTurnStats) and fresh.is_empty()
    assert set(KVTurnConnector.build_kv_connector_stats({}).data) == set(fresh.data)


def test_nixls_reduce_still_works_on_kvturn_stats() -> None:
    stats = KVTurnStats()
    stats.record("kvturn_reuse", "hit")
    nixl_transfer(stats)
    assert stats.reduce()["Num successful transfers"] == 1


# KVTurnPromMetrics.


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> KVTurnPromMetrics:
    metric_types: dict[Any, Any] = {
        Gauge: partial(Gauge, registry=registry),
        Counter: partial(Counter, registry=registry),
        Histogram: partial(Histogram, registry=registry),
    }
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector="KVTurnConnector", kv_connector_module_path="kvturn_server.connector"))
    return KVTurnConnector.build_prom_metrics(vllm_config, metric_types, LABELS,
                                              {0: ["m", "0"], 1: ["m", "1"]})


def value(registry: CollectorRegistry, name: str, engine: str = "0",
          **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", "engine": engine, **labels})


def test_observe_counts_kvturn_samples(metrics: KVTurnPromMetrics,
                                       registry: CollectorRegistry) -> None:
    stats = KVTurnStats()
    for event in ("created", "created", "pinned", "evicted"):
        stats.record("kvturn_retention_events", event)
    for reason in ("hit", "partial", "stale", "below-threshold"):
        stats.record("kvturn_reuse", reason)
    for tokens in (64, 16, 0):
        stats.record("kvturn_reused_tokens", tokens)
    stats.record("kvturn_fallbacks", "read_failed")
    stats.record("kvturn_fallbacks", "unverified")
    stats.record("kvturn_fallbacks", "cheaper_to_compute")
    stats.record("kvturn_fallbacks", "below-threshold")
    stats.record("kvturn_read_timeouts", 1)
    for _ in range(3):
        stats.record("kvturn_reads_served", 1)
    metrics.observe(stats.data)
    metrics.observe(stats.data)  # counters add up across observations

    assert value(registry, "kvturn:retention_events_total", event="created") == 4
    assert value(registry, "kvturn:retention_events_total", event="pinned") == 2
    assert value(registry, "kvturn:retention_events_total", event="evicted") == 2
    assert value(registry, "kvturn:retention_events_total", event="released") is None
    assert value(registry, "kvturn:reuse_outcomes_total", reason="hit") == 2
    assert value(registry, "kvturn:reuse_outcomes_total", reason="stale") == 2
    # Label values are snake_case: the wire's below-threshold is counted as below_threshold.
    assert value(registry, "kvturn:reuse_outcomes_total", reason="below_threshold") == 2
    assert value(registry, "kvturn:reuse_outcomes_total", reason="below-threshold") is None
    assert value(registry, "kvturn:reused_tokens_total") == 160
    assert value(registry, "kvturn:fallbacks_total", reason="read_failed") == 2
    assert value(registry, "kvturn:fallbacks_total", reason="unverified") == 2
    assert value(registry, "kvturn:fallbacks_total", reason="cheaper_to_compute") == 2
    assert value(registry, "kvturn:fallbacks_total", reason="below_threshold") == 2
    assert value(registry, "kvturn:read_timeouts_total") == 2
    assert value(registry, "kvturn:reads_served_total") == 6


def test_observe_counts_the_host_tiers_samples(metrics: KVTurnPromMetrics,
                                              registry: CollectorRegistry) -> None:
    stats = KVTurnStats()
    stats.record("kvturn_host_loaded_tokens", 640)
    stats.record("kvturn_host_loaded_tokens", 128)
    stats.record("kvturn_host_evictions", [["none", 5], ["leased", 1]])
    stats.record("kvturn_host_evictions", [["none", 2]])
    stats.record("kvturn_host_discarded", 4)
    stats.record("kvturn_host_load_failures", 1)
    stats.record("kvturn_host_retentions", 3)
    metrics.observe(stats.data)
    assert value(registry, "kvturn:host_loaded_tokens_total") == 768
    assert value(registry, "kvturn:host_evictions_total", standing="none") == 7
    assert value(registry, "kvturn:host_evictions_total", standing="leased") == 1
    assert value(registry, "kvturn:host_discarded_blocks_total") == 4
    assert value(registry, "kvturn:host_load_failures_total") == 1
    assert value(registry, "kvturn:host_retentions") == 3


def test_gauges_take_the_last_sample(metrics: KVTurnPromMetrics,
                                     registry: CollectorRegistry) -> None:
    stats = KVTurnStats()
    for key, samples in (("kvturn_retentions", [3, 2]), ("kvturn_retained_blocks", [30, 12]),
                         ("kvturn_retained_bytes", [30720, 12288]),
                         ("kvturn_cost_read_fixed_seconds", [0.004, 0.002]),
                         ("kvturn_cost_read_bytes_per_second", [1e9, 5e9]),
                         ("kvturn_cost_compute_tokens_per_second", [900.0, 2500.0])):
        for sample in samples:
            stats.record(key, sample)
    metrics.observe(stats.data)
    assert value(registry, "kvturn:retentions") == 2
    assert value(registry, "kvturn:retained_blocks") == 12
    assert value(registry, "kvturn:retained_bytes") == 12288
    assert value(registry, "kvturn:cost_read_fixed_seconds") == 0.002
    assert value(registry, "kvturn:cost_read_bytes_per_second") == 5e9
    assert value(registry, "kvturn:cost_compute_tokens_per_second") == 2500.0
    metrics.observe(KVTurnStats().data)  # no sample: the gauge keeps its value
    assert value(registry, "kvturn:retentions") == 2


def test_observe_still_feeds_nixls_metrics(metrics: KVTurnPromMetrics,
                                           registry: CollectorRegistry) -> None:
    stats = KVTurnStats()
    nixl_transfer(stats)
    stats.record_failed_transfer()
    stats.record("kvturn_reuse", "hit")
    metrics.observe(stats.data)
    assert value(registry, "vllm:nixl_xfer_time_seconds_count") == 1
    assert value(registry, "vllm:nixl_bytes_transferred_sum") == 4096
    assert value(registry, "vllm:nixl_num_failed_transfers_total") == 1
    assert value(registry, "kvturn:reuse_outcomes_total", reason="hit") == 1


def test_observe_labels_samples_with_their_engine(metrics: KVTurnPromMetrics,
                                                  registry: CollectorRegistry) -> None:
    stats = KVTurnStats()
    stats.record("kvturn_reuse", "miss")
    metrics.observe(stats.data, engine_idx=1)
    assert value(registry, "kvturn:reuse_outcomes_total", engine="1", reason="miss") == 1
    assert value(registry, "kvturn:reuse_outcomes_total", engine="0", reason="miss") is None


def test_data_with_only_kvturn_keys_does_not_crash(metrics: KVTurnPromMetrics,
                                                   registry: CollectorRegistry) -> None:
    metrics.observe({"kvturn_reuse": ["hit"], "kvturn_retentions": [1]})
    metrics.observe({})
    assert value(registry, "kvturn:reuse_outcomes_total", reason="hit") == 1
    assert value(registry, "kvturn:retentions") == 1
    assert value(registry, "vllm:nixl_xfer_time_seconds_count") == 0


def test_plain_nixl_data_is_observed_as_nixl_does(metrics: KVTurnPromMetrics,
                                                  registry: CollectorRegistry) -> None:
    nixl = NixlKVConnectorStats()
    nixl_transfer(nixl)
    metrics.observe(nixl.data)
    assert value(registry, "vllm:nixl_xfer_time_seconds_count") == 1
    assert value(registry, "kvturn:reused_tokens_total") is None
