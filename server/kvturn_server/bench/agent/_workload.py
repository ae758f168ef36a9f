"""What ``kvturn bench agent`` sends: the tool-gap distribution, the settings, the reply
profiles and the agents' scripts, and the order the modes run in each repeat."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvturn_server._defaults import KEEPALIVES_PER_TTL, RETENTION_TTL
from kvturn_server.bench._profiles import (
    CPU_BLOCK_SIZE,
    HOST_TIER_MULTIPLE,
    host_tier,
    needed,
    profile_config,
)
from kvturn_server.bench.agent._kinds import PROMPT_DETAILS_ARGS
from kvturn_server.bench.agent._modes import DEFAULT_MODES, MODES, MODES_BY_NAME
from kvturn_server.local import WORDS

if TYPE_CHECKING:
    from kvturn_server.local import FleetConfig

Z90 = 1.2815515655446004  # NormalDist().inv_cdf(0.9)
Z99 = 2.3263478740408408  # NormalDist().inv_cdf(0.99)
# The lease and its renewal, as deployed (connector and SDK defaults), before time scaling.
TRACE_RETENTION_TTL_S = RETENTION_TTL
TRACE_KEEPALIVE_PER_TTL = KEEPALIVES_PER_TTL  # the SDK renews every 60 s of a 480 s lease
MIN_RETENTION_TTL_S = 30.0
# Template framing per message (ChatML: <|im_start|>role\n ... <|im_end|>\n, tool tags).
FRAMING_TOKENS = 12
# What the benchmark runs (a kvturn_server.local.Fleet): one of each, and a router per run.
PREFILLS = 1
DECODES = 1


PROFILES = ("tool", "long")
PROFILE_TEXT = {
    "tool": "tool calls: every reply is --max-tokens long",
    "long": "long answers or code: each turn's reply length is drawn uniformly from "
            "--long-reply-tokens (the same draws in every mode and repeat)",
}
# Why no ignore_eos or min_tokens: the local models cannot end a reply early. Their LM head
# only picks whole words (kvturn_server.local._model: <|im_end|> gets at most a small length
# bonus, below every word's logit), so every reply runs to its max_tokens and finishes with
# "length"; the summary counts replies that came back shorter, should that ever change.
REPLY_LENGTH_NOTE = (
    "replies run to their max_tokens: the local models' LM head only picks whole words, so "
    "<|im_end|> never wins and no ignore_eos/min_tokens is sent; replies_short counts any that "
    "came back shorter")

ORDER_RATIONALE = (
    "modes run one after the other on the same prefill and decode (per instance profile: the "
    "offload modes on a pair of their own, kept up beside the plain pair and idle while the "
    "other runs), each through a router of its own started for its run, with the same "
    "scripts: the prefill's and "
    "the decode's computed-token counters and the decode's retained bytes are instance-wide, "
    "so a mode can only be measured by them while it has the stack to itself (interleaved "
    "agents would mix both modes in every sample and share the instances' time, so neither "
    "mode's turns per second would be its own); a warm-up conversation runs first, the modes "
    "are repeated with their order rotated (off,stock-cond,on / stock-cond,on,off / ...) so "
    "that every mode runs in every position and drift in the "
    "machine shows as spread rather than as a difference between the modes, and every mode "
    "of every repeat has its own words, so no cache carries over")


def mode_order(modes: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """The modes of ``repeat``: ``modes`` rotated left by ``repeat`` (off,stock-cond,on /
    stock-cond,on,off / on,off,stock-cond / ...): over as many repeats as modes, every mode
    runs once in every position."""
    k = repeat % len(modes)
    return modes[k:] + modes[:k]


# The tool-gap distribution.

@dataclass(frozen=True)
class GapDistribution:
    """Log-normal tool gaps fitted to a trace's p50 and p90 (seconds), then scaled.

    ``ln(gap) ~ N(mu, sigma)`` with ``mu = ln p50`` and ``sigma = (ln p90 - ln p50) / z(0.9)``.
    Draws are capped at ``cap_s`` trace seconds (the traces' p99, about 11 min; the fit's own
    p99 is lower, about 3 min: the real tail is heavier than a log-normal) and multiplied by
    ``time_scale``.
    """

    p50_s: float = 2.0
    p90_s: float = 24.0
    time_scale: float = 0.1
    cap_s: float | None = 660.0

    def __post_init__(self) -> None:
        if not 0 < self.p50_s < self.p90_s:
            raise ValueError(f"need 0 < p50 < p90, got p50={self.p50_s} p90={self.p90_s}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        if self.cap_s is not None and not self.cap_s > 0:
            raise ValueError(f"the gap cap must be positive, got {self.cap_s}")

    @property
    def mu(self) -> float:
        return math.log(self.p50_s)

    @property
    def sigma(self) -> float:
        return (math.log(self.p90_s) - math.log(self.p50_s)) / Z90

    def trace_quantile(self, q: float) -> float:
        """The fit's ``q`` quantile in trace seconds (uncapped, unscaled)."""
        z = statistics.NormalDist().inv_cdf(q)
        return math.exp(self.mu + self.sigma * z)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of what ``draw`` returns (capped, scaled)."""
        value = self.trace_quantile(q)
        if self.cap_s is not None:
            value = min(value, self.cap_s)
        return value * self.time_scale

    def draw(self, rng: random.Random) -> float:
        """One gap in (scaled) seconds."""
        value = rng.lognormvariate(self.mu, self.sigma)
        if self.cap_s is not None:
            value = min(value, self.cap_s)
        return value * self.time_scale

    def describe(self) -> dict[str, Any]:
        return {"distribution": "lognormal", "fitted_to": "trace p50 and p90",
                "trace_p50_s": self.p50_s, "trace_p90_s": self.p90_s,
                "trace_p99_target_s": 660.0,
                "fit_trace_p99_s": round(self.trace_quantile(0.99), 1),
                "mu": round(self.mu, 6), "sigma": round(self.sigma, 6),
                "cap_trace_s": self.cap_s, "time_scale": self.time_scale,
                "scaled_p50_s": round(self.quantile(0.5), 4),
                "scaled_p90_s": round(self.quantile(0.9), 4),
                "scaled_p99_s": round(self.quantile(0.99), 4)}


# Settings.

@dataclass(frozen=True)
class AgentBenchSettings:
    agents: int = 8
    turns: int = 6
    time_scale: float = 0.1
    seed: int = 0
    json_path: Path | None = None
    plot_path: Path | None = None
    size: str = "tiny"
    state_dir: Path = Path(".kvturn/bench")
    modes: tuple[str, ...] = DEFAULT_MODES
    """The first repeat's order; later repeats rotate it."""
    repeats: int = 3
    stagger_s: float = 1.0
    system_tokens: int = 2500
    message_tokens: tuple[int, int] = (100, 300)
    profile: str = "tool"
    max_tokens: int = 64
    """Every reply's length in the ``tool`` profile."""
    long_reply_tokens: tuple[int, int] = (300, 1000)
    """The range of a reply's length in the ``long`` profile."""
    gap_p50_s: float = 2.0
    gap_p90_s: float = 24.0
    gap_cap_s: float | None = 660.0
    retention_ttl_s: float | None = None
    keepalive_interval_s: float | None = None
    prefill_prefix_cache: bool = True
    kv_cache_gib: float = 1.0
    decode_blocks: int | None = None
    """The decode's KV blocks (vLLM ``--num-gpu-blocks-override``; None: what
    ``kv_cache_gib`` gives): a decode short of KV for the active conversations."""
    router_args: tuple[str, ...] = ()
    """More ``kvturn router`` flags, for every mode's router."""
    host_tier_multiple: float = HOST_TIER_MULTIPLE
    """The offload modes' host tier, a multiple of each instance's device KV."""
    sample_interval_s: float = 0.5
    progress_interval_s: float = 5.0
    warmup: bool = True
    max_retries: int = 2
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.agents < 1 or self.turns < 1 or self.repeats < 1:
            raise ValueError("--agents, --turns and --repeats must be at least 1")
        if not self.modes or any(m not in MODES for m in self.modes) or len(
                set(self.modes)) != len(self.modes):
            raise ValueError(f"modes must be distinct values of {MODES}, got {self.modes}")
        low, high = self.message_tokens
        if not 1 <= low <= high:
            raise ValueError(f"message tokens need 1 <= min <= max, got {self.message_tokens}")
        if self.profile not in PROFILES:
            raise ValueError(f"the reply profile must be one of {PROFILES}, got {self.profile!r}")
        low, high = self.long_reply_tokens
        if not 1 <= low <= high:
            raise ValueError(f"long reply tokens need 1 <= min <= max, got "
                             f"{self.long_reply_tokens}")
        if self.system_tokens < 1 or self.max_tokens < 1:
            raise ValueError("--system-tokens and --max-tokens must be at least 1")
        if self.decode_blocks is not None and self.decode_blocks < 2:
            raise ValueError(f"--decode-blocks must be at least 2, got {self.decode_blocks}")
        if not self.host_tier_multiple > 0:
            raise ValueError(f"--host-tier must be positive, got {self.host_tier_multiple:g}")
        if self.stagger_s < 0 or not self.sample_interval_s > 0:
            raise ValueError("--stagger must be >= 0 and the sample interval positive")
        _ = self.gaps  # validates the distribution

    @property
    def gaps(self) -> GapDistribution:
        return GapDistribution(self.gap_p50_s, self.gap_p90_s, self.time_scale, self.gap_cap_s)

    @property
    def retention_ttl(self) -> float:
        """The decode's lease: 480 s scaled like the gaps (at least 30 s), unless set."""
        if self.retention_ttl_s is not None:
            return self.retention_ttl_s
        return max(TRACE_RETENTION_TTL_S * self.time_scale, MIN_RETENTION_TTL_S)

    @property
    def keepalive_interval(self) -> float:
        """The SDK's renewal period during a pause: an eighth of the lease, as 60 s of 480 s."""
        if self.keepalive_interval_s is not None:
            return self.keepalive_interval_s
        return self.retention_ttl / TRACE_KEEPALIVE_PER_TTL

    def reply_description(self) -> dict[str, Any]:
        """The reply profile as the JSON's configuration states it."""
        if self.profile == "tool":
            return {"profile": "tool", "max_tokens": self.max_tokens,
                    "text": PROFILE_TEXT["tool"], "note": REPLY_LENGTH_NOTE}
        return {"profile": "long", "max_tokens_range": list(self.long_reply_tokens),
                "text": PROFILE_TEXT["long"], "note": REPLY_LENGTH_NOTE}

    def reply_text(self) -> str:
        """The reply profile in a table's configuration line."""
        if self.profile == "tool":
            return f"tool profile, {self.max_tokens} tokens each"
        low, high = self.long_reply_tokens
        return f"long profile, {low}-{high} tokens each (drawn per turn)"

    def max_prompt_tokens(self) -> int:
        """An upper estimate of the longest last-turn prompt over the agents (words are one
        token each), from the drawn message and reply lengths."""
        worst = 0
        for agent in range(self.agents):
            sizes, _, replies = agent_shape(self, agent)
            history = sum(s + r + 2 * FRAMING_TOKENS for s, r in zip(
                sizes[:-1], replies[:-1], strict=True))
            worst = max(worst, self.system_tokens + FRAMING_TOKENS + history + sizes[-1]
                        + FRAMING_TOKENS + 64)
        return worst

    def context_needed(self) -> int:
        """The most tokens any agent's last turn needs: its prompt and its reply."""
        worst = 0
        for agent in range(self.agents):
            sizes, _, replies = agent_shape(self, agent)
            need = self.system_tokens + FRAMING_TOKENS + 64 + sum(
                s + r + 2 * FRAMING_TOKENS for s, r in zip(sizes, replies, strict=True))
            worst = max(worst, need)
        return worst

    def check_fits(self, max_model_len: int, block_size: int = CPU_BLOCK_SIZE) -> None:
        need = self.context_needed()
        if need > max_model_len:
            raise ValueError(
                f"the last turn may need about {need} tokens, more than the {self.size} model's "
                f"context of {max_model_len}: lower --turns, --system-tokens, --message-tokens "
                "or the replies (--max-tokens, --long-reply-tokens), or use --size bench (32k)")
        # vLLM refuses to start an instance whose blocks, less the null block it holds back,
        # cannot hold one max_model_len request.
        least = -(-max_model_len // block_size) + 1
        if self.decode_blocks is not None and self.decode_blocks < least:
            raise ValueError(
                f"--decode-blocks {self.decode_blocks}: vLLM refuses to start a decode whose "
                f"blocks of {block_size} tokens, less its null block, cannot hold one request "
                f"of the {self.size} model's context ({max_model_len}); at least {least}")

    def describe(self) -> dict[str, Any]:
        data = asdict(self)
        data["json_path"] = None if self.json_path is None else str(self.json_path)
        data["plot_path"] = None if self.plot_path is None else str(self.plot_path)
        data["state_dir"] = str(self.state_dir)
        data["modes"] = list(self.modes)
        data["message_tokens"] = list(self.message_tokens)
        data["long_reply_tokens"] = list(self.long_reply_tokens)
        data["router_args"] = list(self.router_args)
        data["effective_retention_ttl_s"] = self.retention_ttl
        data["effective_keepalive_interval_s"] = self.keepalive_interval
        data["max_prompt_tokens_estimate"] = self.max_prompt_tokens()
        return data


# The workload.

Message = dict[str, Any]


@dataclass(frozen=True)
class HistoryCut:
    """The client compacted or edited its history before a turn: the prompt keeps the first
    ``messages`` messages of the conversation so far (the system prompt, the messages sent and
    the replies as received), the last of them cut to its first ``last_words`` words (None:
    whole), and the turn's own message follows."""

    messages: int
    last_words: int | None = None

    def __post_init__(self) -> None:
        if self.messages < 1 or (self.last_words is not None and self.last_words < 1):
            raise ValueError(f"a cut keeps at least one message and one word, got {self}")

    def apply(self, history: list[Message]) -> list[Message]:
        kept = [dict(m) for m in history[:self.messages]]
        if self.last_words is not None and kept:
            words = str(kept[-1].get("content") or "").split()
            kept[-1]["content"] = " ".join(words[:self.last_words])
        return kept


@dataclass(frozen=True)
class AgentScript:
    """What one agent sends in one mode of one repeat: its system prompt, one new message per
    turn, each turn's reply length, the tool gap after each turn but the last, and when it
    starts (seconds after the mode starts). ``cuts`` (empty: none) gives per turn the
    ``HistoryCut`` applied before its message, or None: the history grows as a chat does."""

    agent: int
    mode: str
    start_s: float
    system: str
    messages: tuple[Message, ...]
    gaps_s: tuple[float, ...]
    system_words: int
    message_words: tuple[int, ...]
    reply_tokens: tuple[int, ...] = ()
    repeat: int = 0
    cuts: tuple[HistoryCut | None, ...] = ()

    def cut_before(self, turn: int) -> HistoryCut | None:
        return self.cuts[turn] if turn < len(self.cuts) else None

    def gap_after(self, turn: int) -> float | None:
        """The tool gap after turn ``turn`` (0-based); None after the last."""
        return self.gaps_s[turn] if turn < len(self.gaps_s) else None


def _rng(seed: int, *parts: object) -> random.Random:
    # String seeds are hashed with SHA-512 by random.seed: stable across runs and machines.
    return random.Random("/".join(["kvturn-bench-agent", str(seed), *map(str, parts)]))


def _words(rng: random.Random, n: int) -> str:
    """``n`` words of the local tokenizer's training vocabulary: one token each (with the
    leading space), so word counts are token counts to within a token."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def agent_shape(settings: AgentBenchSettings, agent: int) -> tuple[
        tuple[int, ...], tuple[float, ...], tuple[int, ...]]:
    """One agent's message sizes, tool gaps and reply lengths: functions of the seed and the
    agent only, the same in every mode and repeat. Reply lengths have their own stream, so the
    two profiles send the same messages after the same gaps."""
    low, high = settings.message_tokens
    shape = _rng(settings.seed, "shape", agent)
    sizes = tuple(shape.randint(low, high) for _ in range(settings.turns))
    gap_rng = _rng(settings.seed, "gaps", agent)
    gaps = tuple(settings.gaps.draw(gap_rng) for _ in range(settings.turns - 1))
    if settings.profile == "tool":
        replies = (settings.max_tokens,) * settings.turns
    else:
        reply_rng = _rng(settings.seed, "replies", agent)
        reply_low, reply_high = settings.long_reply_tokens
        replies = tuple(reply_rng.randint(reply_low, reply_high) for _ in range(settings.turns))
    return sizes, gaps, replies


def build_scripts(settings: AgentBenchSettings, mode: str,
                  repeat: int = 0) -> list[AgentScript]:
    """The agents' scripts for ``mode`` in ``repeat``. Sizes, gaps, reply lengths and starts
    depend on the seed and the agent only (the same in every mode and repeat); the words also
    on the mode and the repeat, so that no KV cached in one run can serve another."""
    scripts = []
    for agent in range(settings.agents):
        sizes, agent_gaps, replies = agent_shape(settings, agent)
        text = _rng(settings.seed, "text", mode, agent) if repeat == 0 else _rng(
            settings.seed, "text", mode, f"repeat-{repeat}", agent)
        system = _words(text, settings.system_tokens)
        messages: list[Message] = []
        for turn, size in enumerate(sizes):
            if turn == 0:
                messages.append({"role": "user", "content": _words(text, size)})
            else:
                messages.append({"role": "tool", "tool_call_id": f"call_{agent}_{turn}",
                                 "content": _words(text, size)})
        scripts.append(AgentScript(agent=agent, mode=mode, start_s=agent * settings.stagger_s,
                                   system=system, messages=tuple(messages), gaps_s=agent_gaps,
                                   system_words=settings.system_tokens, message_words=sizes,
                                   reply_tokens=replies, repeat=repeat))
    return scripts


# The instances.

def agent_fleet_config(settings: AgentBenchSettings) -> FleetConfig:
    """The plain profile's instances: 1 prefill + 1 decode on the chosen model (no router:
    each run starts its own), leases scaled like the tool gaps, the decode's blocks as
    ``--decode-blocks`` sets them. The offload profile's are these with a host tier
    (``bench/_profiles.profile_config``)."""
    from kvturn_server.local import SIZES, FleetConfig

    return FleetConfig(
        state_dir=settings.state_dir, prefills=PREFILLS, decodes=DECODES,
        model_size=settings.size, served_model_name=f"kvturn-{settings.size}",
        max_model_len=SIZES[settings.size].max_positions, kv_cache_gib=settings.kv_cache_gib,
        decoder_kv_blocks_ttl=settings.retention_ttl,
        prefill_prefix_caching=settings.prefill_prefix_cache,
        decode_num_blocks=settings.decode_blocks, extra_vllm_args=PROMPT_DETAILS_ARGS)


def instance_profiles(settings: AgentBenchSettings) -> dict[str, dict[str, Any]]:
    """Per instance profile the modes run: which of ``settings.modes`` run on it and its host
    tier (None: none), as the configuration states them."""
    base = agent_fleet_config(settings)
    return {profile: {
        "modes": [m for m in settings.modes if MODES_BY_NAME[m].profile == profile],
        "host_tier": host_tier(profile_config(base, profile, settings.host_tier_multiple),
                               settings.host_tier_multiple)}
        for profile in needed(MODES_BY_NAME[m].profile for m in settings.modes)}
