"""What ``kvturn bench fleet`` runs: the modes (one data table), the reply profiles, the KV
sizings, the settings, and the plan derived from them (scripts, reply lengths, the order of the
runs, each prefill's KV cache and which real deployment it stands for).

Nothing here starts a process; ``_fleet.py`` runs the plan, ``_fleet_report.py`` reports it.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvturn_server.bench._profiles import (
    CPU_BLOCK_SIZE,
    HOST_TIER,
    HOST_TIER_PEERS,
    OFFLOAD,
)
from kvturn_server.bench._profiles import PLAIN as PLAIN_PROFILE
from kvturn_server.bench._profiles import kv_bytes_per_token as kv_bytes_per_token
from kvturn_server.bench._run_settings import InstanceRunSettings
from kvturn_server.bench.agent._kinds import IDS as IDS
from kvturn_server.bench.agent._kinds import KVTURN as KVTURN
from kvturn_server.bench.agent._kinds import PLAIN as PLAIN
from kvturn_server.bench.agent._modes import DYNAMO_CONDITIONAL_TOKENS, LLMD_CONDITIONAL_TOKENS
from kvturn_server.bench.agent._workload import (
    FRAMING_TOKENS,
    AgentBenchSettings,
    AgentScript,
    GapDistribution,
    build_scripts,
)
from kvturn_server.local import SIZES

GIB = 1024 ** 3


# The modes. How each mode is run is data: the router's flags, what the client sends (one of
# ``bench/agent/_kinds.py``'s client kinds, PLAIN, IDS or KVTURN, imported above) and the
# instances it runs on (``bench/_profiles.py``: plain, or offload with a host tier).

@dataclass(frozen=True)
class FleetMode:
    """One way to run the same fleet.

    ``client``: ``plain`` sends no conversation id; ``ids`` sends ``X-Conversation-ID`` on every
    turn and nothing else (no pause, no release: the router uses the id for affinity only);
    ``kvturn`` runs each agent as a ``kvturn`` SDK conversation, paused during tool gaps (the
    SDK renews the lease) and released at the end, as ``kvturn bench agent`` does.
    """

    name: str
    router_args: tuple[str, ...]
    client: str
    stands_for: str
    by_default: bool = True
    """Whether the mode runs unless ``--modes`` says otherwise."""
    profile: str = PLAIN_PROFILE
    """The instances it runs on: ``plain`` or ``offload`` (``bench/_profiles.py``)."""

    @property
    def kvturn(self) -> bool:
        return self.client == KVTURN

    def describe(self, router_args: tuple[str, ...]) -> dict[str, object]:
        """The mode as the JSON's mode table states it (``router_args``: the flags its router
        started with, from the bench's settings)."""
        return {"mode": self.name, "router_args": list(router_args), "client": self.client,
                "profile": self.profile, "stands_for": self.stands_for}


def _stock_cond(n: int) -> tuple[str, ...]:
    # kv-aware with --no-kv-reuse: the conversation's last prefill unless it is busier than the
    # least loaded one (llm-d's prefix-cache and load scorers); the decode that served it.
    return ("--no-kv-reuse", "--conditional-disagg", str(n), "--prefill-policy", "kv-aware")


MODE_TABLE: tuple[FleetMode, ...] = (
    FleetMode("stock-rr", ("--no-kv-reuse", "--prefill-policy", "round-robin"), PLAIN,
              "stock P/D without conversation ids, prefill chosen round-robin (vLLM's example "
              "disaggregation proxy)"),
    FleetMode("stock-affinity", ("--no-kv-reuse", "--prefill-policy", "affinity"), IDS,
              "stock P/D with session affinity to a prefill (what Dynamo, llm-d and "
              "production-stack offer)"),
    FleetMode("stock-cond", _stock_cond(LLMD_CONDITIONAL_TOKENS), IDS,
              "stock conditional disaggregation: a follow-up whose new messages are estimated "
              f"at most {LLMD_CONDITIONAL_TOKENS} tokens (the value llm-d's docs use) "
              "runs on the decode that served the conversation, alone, on whatever its plain "
              "prefix cache still holds; other turns stock P/D, prefill by load-aware "
              "affinity (llm-d's prefix-based-pd-decider, nonCachedTokens "
              f"{LLMD_CONDITIONAL_TOKENS}; NVIDIA Dynamo's --router-conditional-disagg)"),
    FleetMode("stock-cond-2k", _stock_cond(DYNAMO_CONDITIONAL_TOKENS), IDS,
              "stock conditional disaggregation at NVIDIA Dynamo's default threshold "
              f"({DYNAMO_CONDITIONAL_TOKENS} tokens, isl_bounding), otherwise as stock-cond",
              by_default=False),
    FleetMode("stock-cond-offload", _stock_cond(LLMD_CONDITIONAL_TOKENS), IDS,
              "stock-cond on instances with " + HOST_TIER_PEERS + " (sources: vLLM "
              "vllm/v1/kv_offload, OffloadingConnector; llm-d's P2P KV sharing and tiered "
              "prefix cache guides; LMCache's CPU backend)",
              by_default=False, profile=OFFLOAD),
    FleetMode("kvturn-ll", ("--prefill-policy", "least-loaded"), KVTURN,
              "kvturn reuse from the decode, least-loaded prefill"),
    FleetMode("kvturn-kv", (), KVTURN,
              "kvturn reuse with kv-aware placement (the router's default policy)"),
    FleetMode("kvturn-offload", (), KVTURN,
              "kvturn-kv with its host tier (docs/connector.md \"The host tier\": the same size "
              "as stock-cond-offload's, evicted in the leases' order), on instances of its own",
              by_default=False, profile=HOST_TIER),
)
MODES: dict[str, FleetMode] = {m.name: m for m in MODE_TABLE}
STOCK_MODES = tuple(m.name for m in MODE_TABLE if not m.kvturn)
KVTURN_MODES = tuple(m.name for m in MODE_TABLE if m.kvturn)
DEFAULT_MODES = tuple(m.name for m in MODE_TABLE if m.by_default)


# Reply profiles and KV sizings.

@dataclass(frozen=True)
class ReplyProfile:
    """The shape of every agent's conversation in one scenario."""

    name: str
    reply_tokens: tuple[int, int]
    turns: int
    system_tokens: int
    message_tokens: tuple[int, int]
    what: str


PROFILES: dict[str, ReplyProfile] = {
    "tool": ReplyProfile("tool", (64, 64), turns=6, system_tokens=2500,
                         message_tokens=(100, 300),
                         what="tool calls: 64-token replies, each next message a tool result"),
    "long": ReplyProfile("long", (300, 1000), turns=4, system_tokens=1500,
                         message_tokens=(100, 300),
                         what="long answers or code: 300-1000 tokens per reply"),
}

TIGHT, ROOMY = "tight", "roomy"
SIZINGS: dict[str, str] = {
    TIGHT: "each prefill's KV cache holds the context of only a few of the conversations that "
           "are active (vLLM --num-gpu-blocks-override on the prefills)",
    ROOMY: "each prefill's KV cache holds every active conversation",
}

# The real deployment a sizing stands for: a 32B model's KV per token (Qwen2.5-32B: 64 layers x
# 8 KV heads x 128 dims x K and V x 2 bytes, bfloat16) and a coding agent's context.
REAL_MODEL = "a 32B model (Qwen2.5-32B, bf16 KV: 256 KiB per token)"
REAL_KV_BYTES_PER_TOKEN = 64 * 8 * 128 * 2 * 2
REAL_CONTEXT_TOKENS = 32768


# Settings.

@dataclass(frozen=True)
class FleetBenchSettings(InstanceRunSettings):
    """Everything ``kvturn bench fleet`` is run with (recorded in the JSON): its own, and how
    its instances start and its runs are driven (``InstanceRunSettings``)."""

    prefills: int = 2
    decodes: int = 1
    modes: tuple[str, ...] = DEFAULT_MODES
    profiles: tuple[str, ...] = tuple(PROFILES)
    sizings: tuple[str, ...] = (TIGHT,)
    repeats: int = 2
    agents: int = 12
    turns: int | None = None
    system_tokens: int | None = None
    message_tokens: tuple[int, int] | None = None
    prefill_holds: float = 2.0
    time_scale: float = 0.1
    seed: int = 0
    stagger_s: float = 0.5
    size: str = "tiny"
    state_dir: Path = Path(".kvturn/bench-fleet")
    kv_cache_gib: float = 1.0
    retention_ttl_s: float | None = None
    decode_continue_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.prefills < 1 or self.decodes < 1:
            raise ValueError("--prefills and --decodes must be at least 1")
        for what, values, known in (("modes", self.modes, MODES), ("profiles", self.profiles,
                                                                   PROFILES),
                                    ("KV sizings", self.sizings, SIZINGS)):
            if not values or any(v not in known for v in values) or len(set(values)) != len(
                    values):
                raise ValueError(f"{what} must be distinct values of {', '.join(known)}, got "
                                 f"{', '.join(values) or 'none'}")
        if self.repeats < 1 or self.agents < 1:
            raise ValueError("--repeats and --agents must be at least 1")
        if self.turns is not None and self.turns < 1:
            raise ValueError("--turns must be at least 1")
        if self.system_tokens is not None and self.system_tokens < 1:
            raise ValueError("--system-tokens must be at least 1")
        if self.message_tokens is not None and not 1 <= self.message_tokens[0] <= \
                self.message_tokens[1]:
            raise ValueError(f"message tokens need 1 <= min <= max, got {self.message_tokens}")
        if not self.prefill_holds > 0:
            raise ValueError("--prefill-holds must be positive")
        if self.decode_continue_tokens is not None and self.decode_continue_tokens < 0:
            raise ValueError("--decode-continue-tokens must be >= 0")
        if self.size not in SIZES:
            raise ValueError(f"unknown model size {self.size!r}")
        self.check_instances(MODES[m].profile for m in self.modes)
        _ = GapDistribution(time_scale=self.time_scale)  # validates the scale

    @property
    def retention_ttl(self) -> float:
        """The decodes' lease: 480 s scaled like the tool gaps (at least 30 s), unless set;
        the same rule as ``kvturn bench agent``."""
        return self._agent_lease().retention_ttl

    @property
    def keepalive_interval(self) -> float:
        """The SDK's renewal period during a pause: an eighth of the lease."""
        return self._agent_lease().keepalive_interval

    def _agent_lease(self) -> AgentBenchSettings:
        return AgentBenchSettings(time_scale=self.time_scale, retention_ttl_s=self.retention_ttl_s)

    def profile(self, name: str) -> ReplyProfile:
        """The named profile with this run's overrides applied."""
        p = PROFILES[name]
        return replace(p, turns=self.turns or p.turns,
                       system_tokens=self.system_tokens or p.system_tokens,
                       message_tokens=self.message_tokens or p.message_tokens)

    def router_args(self, mode: str) -> tuple[str, ...]:
        """The flags ``mode``'s router is started with (beyond backends and the lease)."""
        m = MODES[mode]
        extra: tuple[str, ...] = ()
        if m.kvturn and self.decode_continue_tokens is not None:
            extra = ("--decode-continue-tokens", str(self.decode_continue_tokens))
        return (*m.router_args, *extra)

    def describe(self) -> dict[str, Any]:
        data = super().describe()
        data["effective_retention_ttl_s"] = self.retention_ttl
        data["effective_keepalive_interval_s"] = self.keepalive_interval
        return data


# The order of the runs.

def rotated(modes: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """Repeat ``r`` runs the modes starting at the ``r``-th: with as many repeats as modes,
    every mode runs once in every position (first after the warm-up, last, ...)."""
    k = repeat % len(modes)
    return modes[k:] + modes[:k]


def run_order(settings: FleetBenchSettings) -> list[tuple[int, tuple[str, ...]]]:
    return [(r, rotated(settings.modes, r)) for r in range(settings.repeats)]


# One scenario: a profile on a KV sizing.

@dataclass(frozen=True)
class AgentPlan:
    """One agent's conversation in one run: the agent bench's script plus reply lengths."""

    script: AgentScript
    reply_tokens: tuple[int, ...]

    def context_tokens(self) -> int:
        """The last turn's prompt plus its reply, in tokens (words are one token each)."""
        s = self.script
        turns = len(s.messages)
        return (s.system_words + FRAMING_TOKENS + sum(s.message_words) + sum(self.reply_tokens)
                + 2 * FRAMING_TOKENS * turns)


def _rng(seed: int, *parts: object) -> random.Random:
    return random.Random("/".join(["kvturn-bench-fleet", str(seed), *map(str, parts)]))


@dataclass(frozen=True)
class Scenario:
    profile: ReplyProfile
    sizing: str
    settings: FleetBenchSettings

    @property
    def name(self) -> str:
        return f"{self.profile.name}/{self.sizing}"

    def agent_settings(self) -> AgentBenchSettings:
        """The agent bench's settings whose scripts this scenario uses (sizes, gaps, starts)."""
        s, p = self.settings, self.profile
        return AgentBenchSettings(agents=s.agents, turns=p.turns, time_scale=s.time_scale,
                                  seed=s.seed, stagger_s=s.stagger_s,
                                  system_tokens=p.system_tokens,
                                  message_tokens=p.message_tokens,
                                  max_tokens=p.reply_tokens[1], size=s.size)

    def reply_tokens(self, agent: int) -> tuple[int, ...]:
        low, high = self.profile.reply_tokens
        rng = _rng(self.settings.seed, "replies", self.profile.name, agent)
        return tuple(rng.randint(low, high) for _ in range(self.profile.turns))

    def agents(self, mode: str, repeat: int) -> list[AgentPlan]:
        """Every agent's plan for ``mode`` in repeat ``repeat``: sizes, gaps, starts and reply
        lengths depend on the seed and the agent only (the same in every mode and repeat);
        the words also on the mode and the repeat, so that no KV cached in one run can serve
        another."""
        scripts = build_scripts(self.agent_settings(),
                                f"fleet/{self.profile.name}/{mode}/r{repeat}")
        return [AgentPlan(replace(s, mode=mode, repeat=repeat), self.reply_tokens(s.agent))
                for s in scripts]

    @functools.cached_property
    def _contexts(self) -> tuple[int, ...]:
        # Sizes only: the same for every mode and repeat, whatever the words.
        return tuple(a.context_tokens() for a in self.agents("sizing", 0))

    def contexts(self) -> list[int]:
        """Each agent's last prompt plus reply, in tokens."""
        return list(self._contexts)

    @property
    def max_model_len(self) -> int:
        """The fleet's context: the longest conversation with room to spare, in whole blocks."""
        need = max(self.contexts()) + 2 * FRAMING_TOKENS + 64
        return math.ceil(need / CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE

    def check_fits(self) -> None:
        limit = SIZES[self.settings.size].max_positions
        if self.max_model_len > limit:
            raise ValueError(
                f"{self.name}: the longest conversation needs about {self.max_model_len} "
                f"tokens, more than the {self.settings.size} model's context of {limit}: "
                "lower --turns or --system-tokens, or use --size bench")

    @property
    def prefill_num_blocks(self) -> int | None:
        """Tight: ``prefill_holds`` average conversations' blocks (never fewer than one
        ``max_model_len`` request needs, which vLLM refuses to start without); roomy: None
        (what ``kv_cache_gib`` gives)."""
        if self.sizing == ROOMY:
            return None
        mean = sum(self.contexts()) / self.settings.agents
        holds = math.ceil(self.settings.prefill_holds * mean / CPU_BLOCK_SIZE)
        return max(holds, self.max_model_len // CPU_BLOCK_SIZE + 1)

    def kv_statement(self, prefill_blocks: int, block_size: int = CPU_BLOCK_SIZE) -> dict[
            str, Any]:
        """How much of the active work each prefill's cache holds, and which real deployment
        that ratio stands for (``prefill_blocks``: what the instances report)."""
        s = self.settings
        contexts = self.contexts()
        mean = sum(contexts) / len(contexts)
        capacity = prefill_blocks * block_size
        holds = capacity / mean
        per_prefill = s.agents / s.prefills
        ratio = holds / per_prefill

        def real_gib(contexts: float) -> float:
            return contexts * REAL_CONTEXT_TOKENS * REAL_KV_BYTES_PER_TOKEN / GIB

        if ratio < 1:
            stands_for = (
                f"{REAL_MODEL} on a GPU prefill with {real_gib(holds):.0f} GiB free for KV "
                f"({holds:.1f} contexts of {REAL_CONTEXT_TOKENS // 1024}k tokens) serving "
                f"{per_prefill:g} concurrent agents of {REAL_CONTEXT_TOKENS // 1024}k tokens "
                f"(of {s.agents} in all over {s.prefills} prefills)")
        else:
            stands_for = (
                f"{REAL_MODEL} on a prefill with at least {real_gib(s.agents):.0f} GiB free "
                f"for KV: every one of the {s.agents} active agents' "
                f"{REAL_CONTEXT_TOKENS // 1024}k-token contexts fits on each prefill")
        return {
            "prefill_blocks": prefill_blocks, "block_size": block_size,
            "prefill_capacity_tokens": capacity,
            "kv_bytes_per_token": kv_bytes_per_token(s.size),
            "prefill_kv_mib": round(capacity * kv_bytes_per_token(s.size) / 2 ** 20, 1),
            "conversation_tokens": {"mean": round(mean), "max": max(contexts),
                                    "min": min(contexts)},
            "active_conversations": s.agents,
            "active_per_prefill": round(per_prefill, 2),
            "conversations_a_prefill_holds": round(holds, 2),
            "held_over_active_per_prefill": round(ratio, 3),
            "held_over_all_active": round(holds / s.agents, 3),
            "stands_for": stands_for,
        }


def scenarios(settings: FleetBenchSettings) -> list[Scenario]:
    """Every profile on every sizing, sizing-major (one fleet start per scenario)."""
    out = [Scenario(settings.profile(p), z, settings) for z in settings.sizings
           for p in settings.profiles]
    for s in out:
        s.check_fits()
    return out
