"""The router's Prometheus metrics (``GET /metrics``), one registry per router.

Every label value is snake_case (``kvturn.wire.metric_label``): a wire value with a hyphen
(``X-KVTurn-Reuse: below-threshold``, ``X-KVTurn-Prefill-Choice: round-robin``) is counted
under its underscore form (``below_threshold``, ``round_robin``).

- ``kvturn_router_requests_total{endpoint, outcome}``: requests by outcome: ``ok``, ``invalid``
  (the router's 400), ``client_error`` (a backend's 4xx), ``backend_error`` (5xx to the
  client), ``stream_error`` (a stream broken off), ``client_gone``.
- ``kvturn_router_reuse_total{outcome}``: turns by ``X-KVTurn-Reuse`` value; a turn the decode
  continued alone by what its usage said its cache supplied, counted when its answer (a
  stream: when it ended) said so (``pending`` when it never did: a stream broken off, or a
  decode that reports no cached tokens).
- ``kvturn_router_reused_tokens_total``: prompt tokens read from decodes' retentions (or, on
  turns a decode continued itself, supplied by its own prefix cache, as its usage says).
- ``kvturn_router_routes_total{route, choice}``: turns by ``X-KVTurn-Route`` (``decode``,
  ``prefill``, ``fallback``) and, for ``prefill``, ``X-KVTurn-Prefill-Choice`` (``holder``,
  ``affinity``, ``load``, ``round_robin``; empty for the other routes).
- ``kvturn_router_not_continued_total{why}``: turns of a conversation held by a decode that
  took the prefill path instead, by why (``too_long``, ``busy``, ``edited``, ``no_history``,
  ``expired``, ``lost``, ``stale``, ``unhealthy``, ``decode_failed``, ``off``).
- ``kvturn_router_continued_short_total``: turns the decode continued alone whose own cache
  supplied more than a block less than the router's record said it held of the conversation:
  the record outlived the KV (its retention evicted, or expired and its blocks reused), or the
  reply sent back differs from what the decode generated (re-rendered, reasoning stripped).
- ``kvturn_router_ttft_seconds``: streaming requests, arrival to the decode's first byte.
- ``kvturn_router_leg_seconds{leg}``: ``pin``, ``probe`` (what a decode kept of a history
  whose retention is gone), ``prefill``, ``decode`` (to the first byte when streaming),
  ``capture``.
- ``kvturn_router_retries_total{leg}``: legs retried on another backend.
- ``kvturn_router_backend_failures_total{role, backend, kind}``: failed legs and control calls.
- ``kvturn_router_backend_healthy{role, backend}``: 1 in rotation, 0 ejected.
- ``kvturn_router_backend_in_flight{role, backend}``: requests in flight.
- ``kvturn_router_stale_handles_total{reason}``: handles found stale and dropped: ``expired``,
  ``engine_changed``, ``unknown_decode``, ``evicted``, ``released``, ``replaced``,
  ``no_retention``, ``decode_failed`` (the holder failed the decode leg).
- ``kvturn_router_captures_total{outcome}``: ``recorded``, ``not_retained``, ``failed``,
  ``superseded`` (a concurrent turn of the conversation recorded a newer retention).
- ``kvturn_router_lost_entries_total{outcome}``: entries of the decodes' lost logs
  (``_lost.py``): ``evicted`` / ``expired`` (a record marked lost), ``unmatched`` (no record
  names that retention: a newer one, or another router's conversation), ``missed`` (the log
  had dropped entries this router had not read).
- ``kvturn_router_conversations``: conversations in the state table.
- ``kvturn_router_conversation_evictions_total``: conversations the table cap pushed out.
- ``kvturn_router_state_errors_total``: state-store calls that failed (the turn went on).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvturn.wire import metric_label
from kvturn_server.router._pool import Pool

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)


class _PoolCollector(Collector):
    """Backend health and load, read from the pools at scrape time (no per-request cost)."""

    def __init__(self, pools: list[Pool]) -> None:
        self.pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily("kvturn_router_backend_healthy",
                                    "1 when the backend is in rotation, 0 when ejected",
                                    labels=["role", "backend"])
        in_flight = GaugeMetricFamily("kvturn_router_backend_in_flight",
                                      "requests in flight on the backend",
                                      labels=["role", "backend"])
        for pool in self.pools:
            for b in pool.members:
                healthy.add_metric([b.role, b.url], 1.0 if b.healthy else 0.0)
                in_flight.add_metric([b.role, b.url], float(b.in_flight))
        yield healthy
        yield in_flight


class RouterMetrics:
    def __init__(self, pools: list[Pool]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter("kvturn_router_requests", "requests by endpoint and outcome",
                                 ["endpoint", "outcome"], registry=r)
        self._reuse = Counter("kvturn_router_reuse", "turns by X-KVTurn-Reuse outcome",
                              ["outcome"], registry=r)
        self.reused_tokens = Counter("kvturn_router_reused_tokens",
                                     "prompt tokens read from decode retentions", registry=r)
        self._routes = Counter("kvturn_router_routes", "turns by route and prefill choice",
                               ["route", "choice"], registry=r)
        self._not_continued = Counter(
            "kvturn_router_not_continued",
            "turns of a held conversation that the decode did not continue, by why", ["why"],
            registry=r)
        self._continued_short = Counter(
            "kvturn_router_continued_short",
            "continued turns whose decode's cache supplied less than the router's record said",
            registry=r)
        self.ttft = Histogram("kvturn_router_ttft_seconds",
                              "streaming requests: arrival to the decode's first byte",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self._legs = Histogram("kvturn_router_leg_seconds", "backend leg latency", ["leg"],
                               buckets=_LATENCY_BUCKETS, registry=r)
        self._retries = Counter("kvturn_router_retries", "legs retried on another backend",
                                ["leg"], registry=r)
        self._failures = Counter("kvturn_router_backend_failures",
                                 "failed legs and health checks", ["role", "backend", "kind"],
                                 registry=r)
        self._stale = Counter("kvturn_router_stale_handles",
                              "retention handles found stale and dropped", ["reason"],
                              registry=r)
        self._captures = Counter("kvturn_router_captures", "retention captures by outcome",
                                 ["outcome"], registry=r)
        self._lost = Counter("kvturn_router_lost_entries",
                             "entries of the decodes' lost logs, by outcome", ["outcome"],
                             registry=r)
        self.conversations = Gauge("kvturn_router_conversations",
                                   "conversations in the state table", registry=r)
        self.evictions = Counter("kvturn_router_conversation_evictions",
                                 "conversations pushed out by the table cap", registry=r)
        self.state_errors = Counter("kvturn_router_state_errors",
                                    "state-store calls that failed", registry=r)
        r.register(_PoolCollector(pools))
        # labels() takes a lock and builds a key; the router calls these on every request.
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request(self, endpoint: str, outcome: str) -> None:
        self._child(self._requests, endpoint, outcome).inc()

    def reuse(self, outcome: str, reused_tokens: int) -> None:
        self._child(self._reuse, metric_label(outcome)).inc()
        if reused_tokens:
            self.reused_tokens.inc(reused_tokens)

    def route(self, route: str, choice: str | None) -> None:
        self._child(self._routes, route, metric_label(choice or "")).inc()

    def not_continued(self, why: str) -> None:
        self._child(self._not_continued, why).inc()

    def continued_short(self) -> None:
        self._continued_short.inc()

    def leg(self, leg: str, seconds: float) -> None:
        self._child(self._legs, leg).observe(seconds)

    def retry(self, leg: str) -> None:
        self._child(self._retries, leg).inc()

    def failure(self, role: str, backend: str, kind: str) -> None:
        self._child(self._failures, role, backend, kind).inc()

    def lost_entries(self, outcome: str) -> None:
        self._child(self._lost, outcome).inc()

    def stale(self, reason: str) -> None:
        self._child(self._stale, reason).inc()

    def capture(self, outcome: str) -> None:
        self._child(self._captures, outcome).inc()
