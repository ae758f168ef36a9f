"""What ``kvturn bench trace`` runs: the modes (one data table, each with the instances it runs
on: ``bench/_profiles.py``), the settings, each instance's KV sizing and the real deployment it
stands for, and the order of the runs.

Nothing here starts a process; ``_run`` runs the plan.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvturn_server.bench._fleet_plan import (
    IDS,
    KVTURN,
    PLAIN,
    REAL_KV_BYTES_PER_TOKEN,
    REAL_MODEL,
    FleetMode,
    kv_bytes_per_token,
    rotated,
)
from kvturn_server.bench._profiles import (
    CPU_BLOCK_SIZE,
    HOST_TIER,
    HOST_TIER_PEERS,
    OFFLOAD,
)
from kvturn_server.bench._run_settings import InstanceRunSettings
from kvturn_server.bench.trace._scale import ReplayPlan, Scaling

# The modes. Router flags (before the thresholds are scaled, see ``router_args``) and the
# client kind of ``bench/agent/_loop.py`` per mode.
MODE_TABLE: tuple[FleetMode, ...] = (
    FleetMode("stock-pd", ("--no-kv-reuse",), PLAIN,
              "stock P/D: every turn through the prefill (its prefix cache on), no "
              "conversation ids (vLLM's disaggregated-serving proxy)"),
    FleetMode("stock-cond", ("--no-kv-reuse", "--conditional-disagg", "512"), IDS,
              "stock conditional disaggregation at kvturn's own threshold: a follow-up whose "
              "part the decode did not serve is at most 512 tokens runs on that decode alone, "
              "which holds the history only in its plain prefix cache (llm-d's "
              "prefix-based-pd-decider; the client sends X-Conversation-ID only)"),
    FleetMode("stock-cond-2k", ("--no-kv-reuse", "--conditional-disagg", "2048"), IDS,
              "the same at 2,048 tokens, NVIDIA Dynamo's default (--router-conditional-disagg, "
              "isl_bounding)"),
    FleetMode("stock-cond-offload", ("--no-kv-reuse", "--conditional-disagg", "512"), IDS,
              "stock-cond on instances with " + HOST_TIER_PEERS + " (sources: vLLM "
              "vllm/v1/kv_offload, OffloadingConnector; llm-d's P2P KV sharing and tiered "
              "prefix cache guides; LMCache's CPU backend)", by_default=False, profile=OFFLOAD),
    FleetMode("stock-cond-2k-offload", ("--no-kv-reuse", "--conditional-disagg", "2048"), IDS,
              "stock-cond-2k on stock-cond-offload's instances: Dynamo's default threshold with "
              "the host tier its KVBM keeps: what a Dynamo user with KVBM runs",
              by_default=False, profile=OFFLOAD),
    FleetMode("kvturn", (), KVTURN,
              "kvturn's reuse with the router's defaults, each conversation a kvturn SDK "
              "conversation (leases kept through tool gaps, released at the end)"),
    FleetMode("kvturn-offload", (), KVTURN,
              "kvturn with its host tier (docs/connector.md \"The host tier\": the same size "
              "as stock-cond-offload's, evicted in the leases' order), on instances of its own",
              by_default=False, profile=HOST_TIER),
    FleetMode("kvturn-512-offload", ("--decode-continue-tokens", "512",
                                     "--decode-continue-budget", "1024"), KVTURN,
              "kvturn-offload continuing follow-ups only up to 512 tokens on the decode (budget "
              "twice that): the router's defaults until session 16, beside stock-cond-offload "
              "at the same threshold", by_default=False, profile=HOST_TIER),
)
MODES: dict[str, FleetMode] = {m.name: m for m in MODE_TABLE}
STOCK_MODES = tuple(m.name for m in MODE_TABLE if not m.kvturn)
DEFAULT_MODES = tuple(m.name for m in MODE_TABLE if m.by_default)
"""What runs unless ``--modes`` says otherwise (the offload modes on request: they start a
second prefill and decode)."""

# The real deployment each instance's KV stands for (issue 25): a 32B model's bf16 KV on one
# H200 (141 GB) after the weights (~65 GB): about 70 GB, 270k tokens, two or three of the
# traces' 100k-token conversations.
REAL_GPU = "an H200 (141 GB)"
REAL_KV_TOKENS = 270_000
REAL_CONVERSATION_TOKENS = 100_000


def _router_default(name: str) -> int:
    """A ``kvturn router`` default, read from its config dataclass (written once there)."""
    from kvturn_server.router import RouterConfig

    value = next(f.default for f in dataclasses.fields(RouterConfig) if f.name == name)
    assert isinstance(value, int)
    return value


@dataclass(frozen=True)
class TraceBenchSettings(InstanceRunSettings):
    """Everything ``kvturn bench trace`` runs with (recorded in the JSON): its own, and how its
    instances start and its runs are driven (``InstanceRunSettings``; progress every 15 s)."""

    traces: tuple[Path, ...] = ()
    modes: tuple[str, ...] = DEFAULT_MODES
    """The first repeat's order; later repeats rotate it."""
    repeats: int = 3
    scaling: Scaling = field(default_factory=Scaling)
    scale_thresholds: bool = True
    real_kv_tokens: int = REAL_KV_TOKENS
    prefills: int = 1
    decodes: int = 1
    seed: int = 0
    size: str = "tiny"
    state_dir: Path = Path(".kvturn/bench-trace")
    kv_cache_gib: float = 1.0
    retention_ttl_s: float | None = None
    extra_router_args: tuple[str, ...] = ()
    progress_interval_s: float = 15.0

    def __post_init__(self) -> None:
        if not self.modes or any(m not in MODES for m in self.modes) or len(
                set(self.modes)) != len(self.modes):
            raise ValueError(f"modes must be distinct values of {', '.join(MODES)}, got "
                             f"{', '.join(self.modes) or 'none'}")
        if self.repeats < 1 or self.prefills < 1 or self.decodes < 1:
            raise ValueError("--repeats, --prefills and --decodes must be at least 1")
        if self.real_kv_tokens < 1:
            raise ValueError("--real-kv-tokens must be at least 1")
        if self.retention_ttl_s is not None and not self.retention_ttl_s > 0:
            raise ValueError("--retention-ttl must be positive")
        self.check_instances(MODES[m].profile for m in self.modes)

    @property
    def retention_ttl(self) -> float:
        """The decodes' lease: the deployed 480 s on the replay's clock (gaps and lease scale
        together, so a gap longer than the lease stays longer), unless set."""
        from kvturn_server.bench.agent._workload import TRACE_RETENTION_TTL_S

        if self.retention_ttl_s is not None:
            return self.retention_ttl_s
        return TRACE_RETENTION_TTL_S * self.scaling.time_scale

    @property
    def keepalive_interval(self) -> float:
        """The SDK's renewal period during a pause: an eighth of the lease, as 60 s of 480 s."""
        from kvturn_server.bench.agent._workload import TRACE_KEEPALIVE_PER_TTL

        return self.retention_ttl / TRACE_KEEPALIVE_PER_TTL

    def threshold(self, deployed: int) -> int:
        """A router's token threshold as the replay runs it: divided like the tokens where
        ``scale_thresholds``, so that the same follow-ups fall under it as in the traces."""
        if not self.scale_thresholds:
            return deployed
        return max(1, round(deployed / self.scaling.token_divisor))

    def router_args(self, mode: str) -> tuple[str, ...]:
        """The flags ``mode``'s router starts with (beyond the backends and the lease): the
        mode table's, with stock conditional disaggregation's threshold and kvturn's
        continuation thresholds (the router's defaults) through ``threshold``."""
        m = MODES[mode]
        args = list(m.router_args)
        if "--conditional-disagg" in args:
            at = args.index("--conditional-disagg") + 1
            args[at] = str(self.threshold(int(args[at])))
        if m.kvturn:
            for flag, name in (("--decode-continue-tokens", "decode_continue_tokens"),
                               ("--decode-continue-budget", "decode_continue_budget"),
                               ("--decode-continue-host-tokens",
                                "decode_continue_host_tokens")):
                if flag in args:
                    at = args.index(flag) + 1
                    args[at] = str(self.threshold(int(args[at])))
                else:
                    args += [flag, str(self.threshold(_router_default(name)))]
        return (*args, *self.extra_router_args)

    def describe(self) -> dict[str, Any]:
        data = super().describe()
        data["scaling"] = self.scaling.describe()
        data["effective_retention_ttl_s"] = self.retention_ttl
        data["effective_keepalive_interval_s"] = self.keepalive_interval
        data["mode_router_args"] = {m: list(self.router_args(m)) for m in self.modes}
        data["mode_profiles"] = {m: MODES[m].profile for m in self.modes}
        return data


def run_order(settings: TraceBenchSettings) -> list[tuple[int, tuple[str, ...]]]:
    """Repeat ``r`` runs the modes starting at the ``r``-th (``rotated``)."""
    return [(r, rotated(settings.modes, r)) for r in range(settings.repeats)]


# Each instance's KV.

def max_model_len(plan: ReplayPlan) -> int:
    """The instances' context: the longest request's prompt and reply with room to spare, in
    whole blocks."""
    return math.ceil((plan.context_tokens() + 64) / CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE


def instance_blocks(settings: TraceBenchSettings, plan: ReplayPlan) -> int:
    """Every instance's KV blocks: the real deployment's tokens scaled like the prompts, never
    fewer than one longest request needs (vLLM refuses to start without)."""
    tokens = settings.real_kv_tokens / settings.scaling.token_divisor
    return max(math.ceil(tokens / CPU_BLOCK_SIZE), max_model_len(plan) // CPU_BLOCK_SIZE + 1)


def kv_statement(settings: TraceBenchSettings, plan: ReplayPlan, blocks: int,
                 block_size: int = CPU_BLOCK_SIZE) -> dict[str, Any]:
    """How many of the replay's conversations an instance holds, against the deployment it
    stands for (``blocks``: what the instances report)."""
    capacity = blocks * block_size
    divisor = settings.scaling.token_divisor
    contexts = [c.context_tokens() for c in plan.conversations]
    mean = sum(contexts) / len(contexts)
    return {
        "blocks": blocks, "block_size": block_size, "capacity_tokens": capacity,
        "kv_bytes_per_token": kv_bytes_per_token(settings.size),
        "kv_mib": round(capacity * kv_bytes_per_token(settings.size) / 2 ** 20, 1),
        "capacity_trace_tokens": round(capacity * divisor),
        "conversation_tokens": {"mean": round(mean), "max": max(contexts)},
        "conversations_an_instance_holds": round(capacity / mean, 2),
        "conversations": len(contexts),
        "real_deployment": {
            "model": REAL_MODEL, "gpu": REAL_GPU, "kv_tokens": settings.real_kv_tokens,
            "kv_gib": round(settings.real_kv_tokens * REAL_KV_BYTES_PER_TOKEN / 2 ** 30, 1),
            "holds_100k_conversations": round(settings.real_kv_tokens
                                              / REAL_CONVERSATION_TOKENS, 2)},
        "stands_for": (
            f"{REAL_MODEL} on {REAL_GPU}: about {settings.real_kv_tokens // 1000}k tokens of "
            f"KV ({settings.real_kv_tokens / REAL_CONVERSATION_TOKENS:.1f} conversations of "
            f"100k); scaled by 1/{divisor:g}, {capacity} tokens hold "
            f"{capacity / mean:.1f} of the replay's conversations (mean {mean:.0f} tokens at "
            f"their longest) of {len(contexts)}"),
    }
