"""What a simulation runs: the fleet, its costs, the router's settings and the retention policy.

Config is data: one frozen dataclass per part, validated on construction, printed into the
JSON. Defaults describe the fleet ``docs/simulate.md`` discusses (Qwen3-32B on H200s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from kvturn_server.router._config import RouterConfig

GIB = 1024 ** 3
UNLIMITED_S = 1e9
"""A lease no workload outlives: "no TTL" for the policies that evict only by budget."""


@dataclass(frozen=True)
class CostProfile:
    """Seconds a step takes, the model every simulated instance follows (``docs/simulate.md``).

    Compute uses the connector's own work model (:meth:`CostModel.work`: ``1 + c / A`` units per
    token at context ``c``) at ``compute_tokens_per_s`` units per second; a read (prefill reading
    a retention, or a decode pulling a prefill's KV) costs ``read_fixed_ms`` plus its bytes at
    ``read_gbps``; every decoded token ``itl_ms``; every leg ``leg_overhead_ms`` (HTTP, scheduling).
    """

    # Calibrated so that a 10k-token prompt's first token takes 4.3 s cold and 0.6 s warm
    # (the published figures in ``source``): warm = overhead + one ITL, so overhead 575 ms;
    # cold adds 10k tokens of work, 10000 * (1 + 4999.5 / A) = 11,627 units with A = 6 x 5120
    # (Qwen3-32B's hidden size), in 3.7 s: 3,140 units/s. A test checks both.
    name: str = "qwen3-32b-h200"
    compute_tokens_per_s: float = 3140.0
    attention_tokens: int = 30720
    read_fixed_ms: float = 5.0
    read_gbps: float = 25.0
    itl_ms: float = 25.0
    leg_overhead_ms: float = 575.0
    source: str = ("compute and overhead: llm-d talk, Red Hat Summit 2026 (Qwen3-32B, 10k-token "
                   "prompt: 4.3 s cold, 0.6 s warm); ITL: Dynamo Qwen3-32B FP8 on H200 "
                   "(39.9 tok/s per user at concurrency 100); read: EFA share per GPU, assumed")

    def __post_init__(self) -> None:
        for name in ("compute_tokens_per_s", "read_gbps", "itl_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cost profile {name} must be positive, got {getattr(self, name)}")
        for name in ("read_fixed_ms", "leg_overhead_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost profile {name} must be >= 0, got {getattr(self, name)}")
        if self.attention_tokens < 1:
            raise ValueError(f"attention_tokens must be >= 1, got {self.attention_tokens}")


THIS_MACHINE = CostProfile(
    name="this-machine-cpu",
    # Fitted to docs/bench/reuse.json's recompute rows (2112, 4160, 8256 prompt tokens:
    # 305, 758, 2028 ms of prefill step): see cost_from_reuse_json, checked by a test.
    compute_tokens_per_s=9100.0, attention_tokens=3340,
    read_fixed_ms=4.0, read_gbps=5.0, itl_ms=36.0, leg_overhead_ms=40.0,
    source="kvturn bench reuse on this 2-core machine (docs/bench/reuse.json), bench model")

PROFILES = {p.name: p for p in (CostProfile(), THIS_MACHINE)}


@dataclass(frozen=True)
class FleetSpec:
    """N prefills and M decodes of one model on one kind of accelerator.

    Each instance's KV capacity is ``(memory_gib * memory_utilization - weights_gib)`` GiB over
    ``kv_bytes_per_token`` (the model's layers x KV heads x head size x 2 x dtype bytes), in
    blocks of ``block_size`` tokens, unless ``*_blocks`` sets it.
    """

    prefills: int = 8
    decodes: int = 8
    memory_gib: float = 141.0
    memory_utilization: float = 0.9
    weights_gib: float = 61.0
    kv_bytes_per_token: int = 262144  # Qwen3-32B: 64 layers x 8 KV heads x 128 x 2 x 2 bytes
    block_size: int = 64
    max_num_seqs: int = 256
    prefill_blocks: int | None = None
    decode_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.prefills < 1 or self.decodes < 1:
            raise ValueError("a fleet needs at least one prefill and one decode")
        if self.block_size < 1 or self.kv_bytes_per_token < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size, kv_bytes_per_token and max_num_seqs must be >= 1")
        if self.blocks_per_instance(None) < 1:
            raise ValueError(
                f"no KV left: {self.memory_gib} GiB x {self.memory_utilization} holds the "
                f"{self.weights_gib} GiB of weights with nothing to spare")

    def blocks_per_instance(self, override: int | None) -> int:
        if override is not None:
            return override
        kv_bytes = (self.memory_gib * self.memory_utilization - self.weights_gib) * GIB
        return max(0, math.floor(kv_bytes / (self.kv_bytes_per_token * self.block_size)))

    @property
    def prefill_capacity(self) -> int:
        return self.blocks_per_instance(self.prefill_blocks)

    @property
    def decode_capacity(self) -> int:
        return self.blocks_per_instance(self.decode_blocks)

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size


# The router's own defaults, so that a simulation places turns as a default router does.
_ROUTER: dict[str, Any] = {f.name: f.default for f in fields(RouterConfig)}


@dataclass(frozen=True)
class RouterSpec:
    """The router's placement settings (the names and defaults of ``RouterConfig``)."""

    prefill_policy: str = _ROUTER["prefill_policy"]
    prefill_affinity_slack: int = _ROUTER["prefill_affinity_slack"]
    decode_affinity_slack: int = _ROUTER["decode_affinity_slack"]
    decode_continue_tokens: int = _ROUTER["decode_continue_tokens"]
    decode_continue_budget: int = _ROUTER["decode_continue_budget"]
    min_read_tokens: int = _ROUTER["min_read_tokens"]
    pin_ttl_s: float = 30.0
    recompute_threshold: int = 0


@dataclass(frozen=True)
class Policy:
    """How decodes retain a finished turn's KV, and what clients do about it.

    Attributes:
        name: the label in tables.
        retain: False keeps nothing (plain P/D).
        ttl_s: the lease; ``max_hold_s`` caps renewals.
        keepalive_s: clients renew every this many seconds of a tool gap (None: never).
        release: clients release the lease when the conversation ends.
        budget: fraction of each decode's blocks retentions may hold (live requests evict
            retentions whatever the budget: the connector never starves live decoding).
    """

    name: str
    retain: bool = True
    ttl_s: float = 480.0
    max_hold_s: float = 3600.0
    keepalive_s: float | None = None
    release: bool = False
    budget: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.budget <= 1:
            raise ValueError(f"policy {self.name}: budget must be in [0, 1], got {self.budget}")
        if not 0 < self.ttl_s <= self.max_hold_s:
            raise ValueError(f"policy {self.name}: need 0 < ttl <= max_hold")
        if self.keepalive_s is not None and not self.keepalive_s > 0:
            raise ValueError(f"policy {self.name}: keepalive interval must be positive")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "retain": self.retain, "ttl_s": self.ttl_s,
                "max_hold_s": self.max_hold_s, "keepalive_s": self.keepalive_s,
                "release": self.release, "budget": self.budget}


def standard_policies(*, budget: float = 0.5, ttl_s: float = 480.0) -> dict[str, Policy]:
    """The five policies every comparison runs (``budget``/``ttl_s``: kvturn's lease)."""
    return {p.name: p for p in (
        Policy("vllm-ttl-480", ttl_s=480.0, max_hold_s=480.0, budget=1.0),
        Policy("kvturn-lease", ttl_s=ttl_s, max_hold_s=max(3600.0, ttl_s),
               keepalive_s=ttl_s / 8, release=True, budget=budget),
        Policy("lru-budget", ttl_s=UNLIMITED_S, max_hold_s=UNLIMITED_S, budget=budget),
        Policy("evict-before-starve", ttl_s=UNLIMITED_S, max_hold_s=UNLIMITED_S, budget=1.0),
        Policy("none", retain=False),
    )}


@dataclass(frozen=True)
class SimSettings:
    """One simulation run: the fleet, costs, router, the policy and what to measure."""

    fleet: FleetSpec = field(default_factory=FleetSpec)
    cost: CostProfile = field(default_factory=CostProfile)
    router: RouterSpec = field(default_factory=RouterSpec)
    policy: Policy = field(default_factory=lambda: standard_policies()["kvturn-lease"])
    ttft_slo_s: float = 2.0
    sample_interval_s: float = 10.0
    connector_compute_tokens_per_s: float | None = None
    """What the prefill connector is configured with (``compute_tokens_per_s`` in
    ``kv_connector_extra_config``) for its read-or-compute decision; None: the profile's rate,
    as a calibrated connector would measure it. Timings always follow the profile."""
