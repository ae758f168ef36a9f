"""What a simulation runs: the fleet, its costs, the router's settings and the retention policy.

Config is data: one frozen dataclass per part, validated on construction, printed into the
JSON. Defaults describe the fleet ``docs/simulate.md`` discusses (Qwen3-32B on H200s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from kvturn_server._defaults import (
    KEEPALIVES_PER_TTL,
    RETENTION_BUDGET,
    RETENTION_MAX_HOLD,
    RETENTION_TTL,
    VLLM_DECODER_KV_BLOCKS_TTL,
)
from kvturn_server.router import RouterConfig
from kvturn_server.sim._roofline import (
    H100_SXM,
    H200,
    QWEN3_32B,
    Accelerator,
    Efficiency,
    ModelShape,
    itl_seconds,
    prefill_seconds,
    prefill_tokens_per_s,
)

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
    A host tier (the offload policies, ``kvturn-host``) reads back at ``host_read_gbps``. The
    same form is what the connector's ``CostModel`` is configured with, so a profile can be
    given to it as is.
    """

    name: str
    compute_tokens_per_s: float
    attention_tokens: int
    read_fixed_ms: float
    read_gbps: float
    itl_ms: float
    leg_overhead_ms: float
    source: str
    host_read_gbps: float | None = None
    """Host-to-device bandwidth of a host KV tier; None: the profile states none."""
    memory_gib: float | None = None
    """Accelerator memory of one instance (all its GPUs): the fleet's default."""
    gpus: int = 1
    """GPUs one instance runs on (tensor parallel)."""

    def __post_init__(self) -> None:
        for name in ("compute_tokens_per_s", "read_gbps", "itl_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cost profile {name} must be positive, got {getattr(self, name)}")
        for name in ("read_fixed_ms", "leg_overhead_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost profile {name} must be >= 0, got {getattr(self, name)}")
        if self.attention_tokens < 1:
            raise ValueError(f"attention_tokens must be >= 1, got {self.attention_tokens}")
        if self.host_read_gbps is not None and not self.host_read_gbps > 0:
            raise ValueError(f"host_read_gbps must be positive, got {self.host_read_gbps}")
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")


def roofline_profile(name: str, model: ModelShape, gpu: Accelerator, gpus: int = 1,
                     eff: Efficiency | None = None) -> CostProfile:
    """The profile of ``model`` on ``gpus`` x ``gpu`` (tensor parallel), derived from their
    specifications at the stated efficiencies (``sim/_roofline.py``); ``source`` says how."""
    eff = eff or Efficiency()
    rate = prefill_tokens_per_s(model, gpu, gpus, eff)
    itl = itl_seconds(model, gpu, gpus, eff, eff.decode_batch_tokens)
    read = eff.link * gpu.nic_gbps * gpus
    host = eff.pcie * gpu.pcie_gbps * gpus
    ten_k = prefill_seconds(model, gpu, gpus, eff, 10000)
    source = (
        f"roofline: {model.name} bf16 on {gpus} x {gpu.name} ({gpu.bf16_tflops:g} TFLOPS, "
        f"{gpu.hbm_tbps:g} TB/s, {gpu.memory_gib:g} GiB each); prefill "
        f"{2 * model.matmul_params / 1e9:.1f} GFLOP/token + attention "
        f"(A = {model.attention_tokens:,}) at MFU {eff.mfu:g}: "
        f"{rate:,.0f} tokens/s at context 0, a 10k-token prompt {ten_k:.2f} s; decode: "
        f"{model.step_read_bytes / 1e9:.1f} GB of weights + {eff.decode_batch_tokens:,} tokens "
        f"of KV per step at {eff.hbm:g} of HBM: ITL {itl * 1e3:.1f} ms; KV reads over the NIC "
        f"({gpu.nic_gbps:g} GB/s per GPU) at {eff.link:g}: {read:g} GB/s + "
        f"{eff.read_fixed_ms:g} ms (assumed); host tier over PCIe ({gpu.pcie_gbps:g} GB/s) at "
        f"{eff.pcie:g}: {host:g} GB/s; leg overhead {eff.leg_overhead_ms:g} ms (assumed). "
        "Checked against published measurements: docs/simulate.md")
    return CostProfile(
        name=name, compute_tokens_per_s=round(rate, 1), attention_tokens=model.attention_tokens,
        read_fixed_ms=eff.read_fixed_ms, read_gbps=read, itl_ms=round(itl * 1e3, 2),
        leg_overhead_ms=eff.leg_overhead_ms, source=source, host_read_gbps=host,
        memory_gib=round(gpu.memory_gib * gpus, 1), gpus=gpus)


QWEN3_32B_H200 = roofline_profile("qwen3-32b-h200", QWEN3_32B, H200)
"""The default: one H200 per instance (61 GiB of weights leave 65 GiB of KV at 0.9)."""
QWEN3_32B_H100 = roofline_profile("qwen3-32b-h100-tp2", QWEN3_32B, H100_SXM, gpus=2)
"""Two H100s per instance (tensor parallel): one H100's 80 GB holds the 61 GiB of weights with
10 GiB of KV, less than one 100k-token agent context."""

THIS_MACHINE = CostProfile(
    name="this-machine-cpu",
    # Fitted to docs/bench/reuse.json's recompute rows (2112, 4160, 8256 prompt tokens:
    # 305, 758, 2028 ms of prefill step): see cost_from_reuse_json, checked by a test.
    compute_tokens_per_s=9100.0, attention_tokens=3340,
    read_fixed_ms=4.0, read_gbps=5.0, itl_ms=36.0, leg_overhead_ms=40.0,
    source="kvturn bench reuse on this 2-core machine (docs/bench/reuse.json), bench model")

PROFILES = {p.name: p for p in (QWEN3_32B_H200, QWEN3_32B_H100, THIS_MACHINE)}


@dataclass(frozen=True)
class FleetSpec:
    """N prefills and M decodes of one model on one kind of accelerator.

    Each instance's KV capacity is ``(memory_gib * memory_utilization - weights_gib)`` GiB over
    ``kv_bytes_per_token`` (the model's layers x KV heads x head size x 2 x dtype bytes), in
    blocks of ``block_size`` tokens, unless ``*_blocks`` sets it.
    """

    prefills: int = 8
    decodes: int = 8
    memory_gib: float = H200.memory_gib
    memory_utilization: float = 0.9
    weights_gib: float = round(QWEN3_32B.weight_bytes / GIB, 1)
    kv_bytes_per_token: int = QWEN3_32B.kv_bytes_per_token  # 64 layers x 8 KV heads x 128 x 2 x 2
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
    decode_continue_host_tokens: int = _ROUTER["decode_continue_host_tokens"]
    """A longer turn whose retention its decode keeps in the host tier alone continues there
    up to this many tokens to compute (``plan_host_route``; 0: a prefill recomputes it)."""
    min_read_tokens: int = _ROUTER["min_read_tokens"]
    pin_ttl_s: float = 30.0
    recompute_threshold: int = 0
    record_ttl_s: float = _ROUTER["retention_ttl"]
    """A stock record's lifetime (the router's ``retention_ttl``)."""
    remember_expired_s: float = _ROUTER["remember_expired"]
    """The router forgets a record this long after it expired (then no affinity, no
    continuation)."""
    follow_evictions: bool = _ROUTER["follow_evictions"]
    """The router follows the decodes' lost logs (``router/_lost.py``): records of evicted or
    expired retentions are marked lost at once."""


@dataclass(frozen=True)
class Policy:
    """How decodes retain a finished turn's KV, how the router places turns, and what clients
    do about it.

    Attributes:
        name: the label in tables.
        retain: kvturn's retention (router ``kv_reuse`` on); False is stock: no retention, no
            pins, no continuation by kvturn's rules (every instance's plain prefix cache, LRU,
            still works).
        ttl_s: the lease; ``max_hold_s`` caps renewals.
        keepalive_s: clients renew every this many seconds of a tool gap (None: never).
        release: clients release the lease when the conversation ends.
        budget: fraction of each decode's blocks retentions may hold (live requests evict
            retentions whatever the budget: the connector never starves live decoding).
        conversation_ids: clients name the conversation (``X-Conversation-ID``); without, the
            router keeps no record and gives no affinity (stock P/D).
        conditional_disagg: stock conditional disaggregation (``kvturn router --no-kv-reuse
            --conditional-disagg N``): a follow-up whose estimated uncached part on the decode
            that served the conversation is at most this many tokens runs on that decode alone
            (``router/_placement.py`` ``conditional_decode``); 0: off.
        host_gib: a host KV tier of this many GiB on every instance (vLLM's CPU offloading):
            copies of finished requests' blocks, least recently used first, read back over
            PCIe at the profile's ``host_read_gbps``; 0: none.
        peer: the peer configuration the policy stands for, with sources.
    """

    name: str
    retain: bool = True
    ttl_s: float = RETENTION_TTL
    max_hold_s: float = RETENTION_MAX_HOLD
    keepalive_s: float | None = None
    release: bool = False
    budget: float = RETENTION_BUDGET
    conversation_ids: bool = True
    conditional_disagg: int = 0
    host_gib: float = 0.0
    peer: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.budget <= 1:
            raise ValueError(f"policy {self.name}: budget must be in [0, 1], got {self.budget}")
        if not 0 < self.ttl_s <= self.max_hold_s:
            raise ValueError(f"policy {self.name}: need 0 < ttl <= max_hold")
        if self.keepalive_s is not None and not self.keepalive_s > 0:
            raise ValueError(f"policy {self.name}: keepalive interval must be positive")
        if self.conditional_disagg < 0 or self.host_gib < 0:
            raise ValueError(f"policy {self.name}: conditional_disagg and host_gib must be >= 0")
        if self.conditional_disagg and (self.retain or not self.conversation_ids):
            raise ValueError(f"policy {self.name}: conditional disaggregation is the stock "
                             "baseline: no retention, and clients that name the conversation")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "retain": self.retain, "ttl_s": self.ttl_s,
                "max_hold_s": self.max_hold_s, "keepalive_s": self.keepalive_s,
                "release": self.release, "budget": self.budget,
                "conversation_ids": self.conversation_ids,
                "conditional_disagg": self.conditional_disagg, "host_gib": self.host_gib,
                "peer": self.peer}


LLMD_THRESHOLD = 512
"""stock-cond's N: llm-d's prefix-based-pd-decider at the nonCachedTokens its docs use."""
DYNAMO_THRESHOLD = 2048
"""Dynamo's conditional disaggregation default (``isl_bounding``)."""
HOST_GIB = 128.0
"""The offload policies' host tier per instance: llm-d's guides give each rank 100-150 GiB."""

_STOCK_COND = ("llm-d's prefix-based-pd-decider (llm-d-router pkg/epp/framework/plugins/"
               "scheduling/profilehandler/disagg/prefix_based_pd_decider.go, nonCachedTokens) "
               "with approximate prefix matching, and NVIDIA Dynamo's --router-conditional-disagg "
               "(docs/components/router/router-disaggregated-serving.md, isl_bounding): "
               "decode-only below the threshold, vLLM's LRU prefix cache on the decode, nothing "
               "held through tool gaps")


def standard_policies(*, budget: float = RETENTION_BUDGET, ttl_s: float = RETENTION_TTL,
                      host_gib: float = HOST_GIB) -> dict[str, Policy]:
    """The policies every comparison runs (``budget``/``ttl_s``: kvturn's lease; ``host_gib``:
    the host tier per instance of the offload policies and kvturn-host)."""
    return {p.name: p for p in (
        Policy("vllm-ttl-480", ttl_s=VLLM_DECODER_KV_BLOCKS_TTL,
               max_hold_s=VLLM_DECODER_KV_BLOCKS_TTL, budget=1.0,
               peer="vLLM's multi-turn P/D proxy: retained decode blocks with a fixed 480 s "
                    "TTL (decoder_kv_blocks_ttl), not renewable"),
        Policy("kvturn-lease", ttl_s=ttl_s, max_hold_s=max(RETENTION_MAX_HOLD, ttl_s),
               keepalive_s=ttl_s / KEEPALIVES_PER_TTL, release=True, budget=budget,
               peer="kvturn: leases the SDK renews during tool gaps and releases at the end"),
        Policy("kvturn-host", ttl_s=ttl_s, max_hold_s=max(RETENTION_MAX_HOLD, ttl_s),
               keepalive_s=ttl_s / KEEPALIVES_PER_TTL, release=True, budget=budget,
               host_gib=host_gib,
               peer="kvturn with its host tier (docs/connector.md, \"The host tier\"): "
                    "kvturn-lease, and a decode's evicted retentions kept in host memory (the "
                    "same size as stock-cond-offload's), loaded back for the next turn; "
                    "simulated least recently used there, as the leases' order mostly is"),
        Policy("lru-budget", ttl_s=UNLIMITED_S, max_hold_s=UNLIMITED_S, budget=budget,
               peer="retention with no lease, least recently used out past the budget"),
        Policy("evict-before-starve", ttl_s=UNLIMITED_S, max_hold_s=UNLIMITED_S, budget=1.0,
               peer="retain everything; only live requests evict"),
        Policy("stock-pd", retain=False, conversation_ids=False,
               peer="stock P/D: kvturn router --no-kv-reuse, no conversation id (llm-d's "
                    "always-disagg-pd-decider, vLLM's disaggregated proxy); every turn takes "
                    "a prefill leg, least loaded instances, plain LRU prefix caches"),
        Policy("stock-cond", retain=False, conditional_disagg=LLMD_THRESHOLD,
               peer=f"stock conditional disaggregation at N = {LLMD_THRESHOLD} (llm-d's docs use 8 "
                    f"or 512): {_STOCK_COND}"),
        Policy("stock-cond-2k", retain=False, conditional_disagg=DYNAMO_THRESHOLD,
               peer=f"the same at N = {DYNAMO_THRESHOLD}, Dynamo's default: {_STOCK_COND}"),
        Policy("stock-cond-offload", retain=False, conditional_disagg=LLMD_THRESHOLD,
               host_gib=host_gib,
               peer=f"stock-cond with vLLM's CPU KV offloading on every instance, {host_gib:g} "
                    "GiB of host memory each, least recently used out, read back over PCIe "
                    "(llm-d's P2P KV sharing guide: 100-150 GiB of CPU tier per rank; LMCache "
                    "and Dynamo KVBM keep tool-gap KV in host memory the same way)"),
        Policy("stock-cond-2k-offload", retain=False, conditional_disagg=DYNAMO_THRESHOLD,
               host_gib=host_gib,
               peer=f"stock-cond-offload at N = {DYNAMO_THRESHOLD}, Dynamo's default: what a "
                    "Dynamo user with KVBM's host tier switches on"),
    )}


@dataclass(frozen=True)
class SimSettings:
    """One simulation run: the fleet, costs, router, the policy and what to measure."""

    fleet: FleetSpec = field(default_factory=FleetSpec)
    cost: CostProfile = QWEN3_32B_H200
    router: RouterSpec = field(default_factory=RouterSpec)
    policy: Policy = field(default_factory=lambda: standard_policies()["kvturn-lease"])
    ttft_slo_s: float = 2.0
    sample_interval_s: float = 10.0
    connector_compute_tokens_per_s: float | None = None
    """What the prefill connector is configured with (``compute_tokens_per_s`` in
    ``kv_connector_extra_config``) for its read-or-compute decision; None: the profile's rate,
    as a calibrated connector would measure it. Timings always follow the profile."""

    def host_load_s(self, blocks: int) -> float:
        """Reading ``blocks`` back from a host tier (PCIe), one more engine step included."""
        assert self.cost.host_read_gbps is not None
        return self.cost.read_fixed_ms / 1e3 + blocks * self.fleet.block_bytes \
            / (self.cost.host_read_gbps * 1e9)
