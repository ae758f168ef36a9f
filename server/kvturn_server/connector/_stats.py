"""kvturn's metrics, carried on vLLM's connector-stats path into each instance's ``/metrics``.

vLLM collects a connector's stats from its workers and its scheduler side every step, ships
the ``data`` dict to the API server process and hands it to the connector class's Prometheus
object there. kvturn's stats extend NIXL's (same dict, more keys), so NIXL's transfer metrics
keep working unchanged.

Keys (all lists, one item per observation; aggregation concatenates):

- ``kvturn_retention_events``: ``created``, ``renewed``, ``released``, ``expired``,
  ``evicted``, ``replaced``, ``refused``, ``pinned``, ``host_evicted``, ``host_pinned`` (decode).
- ``kvturn_retentions`` / ``kvturn_retained_blocks`` / ``kvturn_retained_bytes`` /
  ``kvturn_host_retentions``: gauge samples, the last one wins (decode).
- ``kvturn_host_loaded_tokens``: prompt tokens a conversation turn the decode served alone loaded
  from its host tier, per turn (decode with a host tier).
- ``kvturn_host_evictions``: ``[standing, blocks]`` pairs, host-tier blocks evicted for room by
  the standing of their conversation (``none``, ``gone``, ``leased``).
- ``kvturn_host_discarded``: host-tier blocks freed because their lease ended or their copy
  failed; ``kvturn_host_load_failures``: host-tier loads whose copy failed (recomputed).
- ``kvturn_reuse``: the reuse outcome of each finished prefill (``X-KVTurn-Reuse`` values).
- ``kvturn_reused_tokens``: prompt tokens read from a decode per finished prefill.
- ``kvturn_fallbacks``: why a prefill recomputed what a retention offered (``expired``,
  ``stale``, ``unverified``, ``below-threshold``, ``cheaper_to_compute``, ``read_failed``).

Label values are snake_case, as every kvturn metric's (``kvturn.wire.metric_label``): a reuse
value with a hyphen is counted under its underscore form (``below_threshold``).
- ``kvturn_cost_read_fixed_seconds`` / ``kvturn_cost_read_bytes_per_second`` /
  ``kvturn_cost_compute_tokens_per_second``: the prefill's cost-model parameters in use, gauge
  samples (at most one a second while the engine steps).
- ``kvturn_read_timeouts``: reads abandoned at ``kv_read_timeout`` (any instance).
- ``kvturn_reads_served``: completed reads of this decode's retentions (decode).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)

from kvturn.wire import metric_label

COST_GAUGES = ("kvturn_cost_read_fixed_seconds", "kvturn_cost_read_bytes_per_second",
               "kvturn_cost_compute_tokens_per_second")
KVTURN_KEYS = ("kvturn_retention_events", "kvturn_retentions", "kvturn_retained_blocks",
               "kvturn_retained_bytes", "kvturn_host_retentions", "kvturn_reuse",
               "kvturn_reused_tokens", "kvturn_fallbacks", "kvturn_read_timeouts",
               "kvturn_reads_served", "kvturn_host_loaded_tokens", "kvturn_host_evictions",
               "kvturn_host_discarded", "kvturn_host_load_failures", *COST_GAUGES)
_NIXL_KEYS = frozenset(NixlKVConnectorStats().data)
_GAUGES = {
    "kvturn:retentions": "Retentions this decode holds.",
    "kvturn:retained_blocks": "KV blocks held by retentions (including draining ones).",
    "kvturn:retained_bytes": "Bytes of KV cache held by retentions.",
    "kvturn:host_retentions":
        "Retentions whose device blocks were evicted, held in the decode's host tier alone.",
    "kvturn:cost_read_fixed_seconds":
        "Prefill cost model: expected fixed cost of one read of retained KV, whatever its size "
        "(in use: calibrated, configured or default).",
    "kvturn:cost_read_bytes_per_second": "Prefill cost model: read bandwidth per worker.",
    "kvturn:cost_compute_tokens_per_second":
        "Prefill cost model: prompt tokens computed per second at context 0.",
}
"""The gauges' Prometheus names and help texts; each samples the stats key ``kvturn_…`` of the
same name (the last sample of a step wins)."""


class KVTurnStats(NixlKVConnectorStats):  # type: ignore[misc]
    """NIXL's transfer stats plus kvturn's keys."""

    def reset(self) -> None:
        super().reset()
        for key in KVTURN_KEYS:
            self.data[key] = []

    def record(self, key: str, value: Any) -> None:
        self.data.setdefault(key, []).append(value)

    def is_empty(self) -> bool:
        return bool(super().is_empty()) and not any(self.data.get(k) for k in KVTURN_KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        # Tolerates either side lacking keys (a plain NIXL stats object, or an older kvturn).
        for key, values in other.data.items():
            self.data.setdefault(key, []).extend(values)
        return self


class KVTurnPromMetrics(NixlPromMetrics):  # type: ignore[misc]
    """NIXL's Prometheus metrics plus ``kvturn:*``."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter, gauge = self._counter_cls, self._gauge_cls
        self._events = counter(
            name="kvturn:retention_events", labelnames=[*labelnames, "event"],
            documentation="Decode retentions by event: created, renewed (keepalive), released, "
                          "expired, evicted (from the device: budget or live requests; with a "
                          "host tier the lease goes on there), replaced (next turn), refused "
                          "(larger than the budget), pinned (for a read), host_evicted (a "
                          "host-only retention lost its host copy too).")
        self._reuse = counter(
            name="kvturn:reuse_outcomes", labelnames=[*labelnames, "reason"],
            documentation="Prefill requests by reuse outcome (the X-KVTurn-Reuse values).")
        self._fallbacks = counter(
            name="kvturn:fallbacks", labelnames=[*labelnames, "reason"],
            documentation="Prefills that recomputed KV a retention offered, by reason.")
        self._reused_tokens = counter(
            name="kvturn:reused_tokens", labelnames=labelnames,
            documentation="Prompt tokens a prefill read from a decode's retention.")
        self._read_timeouts = counter(
            name="kvturn:read_timeouts", labelnames=labelnames,
            documentation="NIXL reads abandoned at kv_read_timeout (then recomputed).")
        self._reads_served = counter(
            name="kvturn:reads_served", labelnames=labelnames,
            documentation="Completed reads of this decode's retentions by a prefill.")
        self._host_loaded = counter(
            name="kvturn:host_loaded_tokens", labelnames=labelnames,
            documentation="Prompt tokens of conversation turns the decode served alone that "
                          "it loaded from its host tier.")
        self._host_evictions = counter(
            name="kvturn:host_evictions", labelnames=[*labelnames, "standing"],
            documentation="Host-tier blocks evicted for room, by their conversation's "
                          "standing: none (no conversation), gone (no live lease), leased.")
        self._host_discarded = counter(
            name="kvturn:host_discarded_blocks", labelnames=labelnames,
            documentation="Host-tier blocks freed because their conversation's lease ended "
                          "(release, expiry) or their copy failed.")
        self._host_load_failures = counter(
            name="kvturn:host_load_failures", labelnames=labelnames,
            documentation="Loads from the host tier whose copy failed (recomputed).")
        self._gauges = {
            name.replace(":", "_", 1): gauge(name=name, labelnames=labelnames,
                                             multiprocess_mode="mostrecent",
                                             documentation=documentation)
            for name, documentation in _GAUGES.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if transfer_stats_data.keys() >= _NIXL_KEYS:
            super().observe(transfer_stats_data, engine_idx)
        labels = self.per_engine_labelvalues[engine_idx]
        data = transfer_stats_data
        for event in data.get("kvturn_retention_events", ()):
            self._events.labels(*labels, event).inc()
        for reason in data.get("kvturn_reuse", ()):
            self._reuse.labels(*labels, metric_label(reason)).inc()
        for reason in data.get("kvturn_fallbacks", ()):
            self._fallbacks.labels(*labels, metric_label(reason)).inc()
        if tokens := sum(data.get("kvturn_reused_tokens", ())):
            self._reused_tokens.labels(*labels).inc(tokens)
        if n := len(data.get("kvturn_read_timeouts", ())):
            self._read_timeouts.labels(*labels).inc(n)
        if n := len(data.get("kvturn_reads_served", ())):
            self._reads_served.labels(*labels).inc(n)
        if tokens := sum(data.get("kvturn_host_loaded_tokens", ())):
            self._host_loaded.labels(*labels).inc(tokens)
        for pairs in data.get("kvturn_host_evictions", ()):
            for standing, blocks in pairs:
                self._host_evictions.labels(*labels, standing).inc(blocks)
        if n := sum(data.get("kvturn_host_discarded", ())):
            self._host_discarded.labels(*labels).inc(n)
        if n := sum(data.get("kvturn_host_load_failures", ())):
            self._host_load_failures.labels(*labels).inc(n)
        for key, gauge in self._gauges.items():
            samples = data.get(key)
            if samples:
                gauge.labels(*labels).set(samples[-1])
