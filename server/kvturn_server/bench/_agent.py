"""``kvturn bench agent``: N concurrent tool-using agents x M turns through the router, with
retention ("on") and without ("off").

Each agent is a conversation that grows turn by turn: a long system prompt, then per turn one
new message (the task as a ``user`` message first, ``tool`` results after) and the model's
streamed reply. Between two turns the agent "runs a tool" for a gap drawn from a log-normal
fitted to production agent traces (Claude Code: p50 2 s, p90 24 s), times ``time_scale`` so that
a run takes minutes on a small machine.

- **on**: each agent is a ``kvturn`` conversation (``client.conversation()``); during a gap it
  holds ``pause("tool")``, so the SDK renews the lease, and it releases the retention at the
  end. The router pins the decode's retained KV and the prefill reads it back.
- **off**: the same requests without a conversation id: the router neither pins nor retains
  (plain prefill/decode disaggregation).

Both modes run the same scripts (sizes, gaps, start offsets; the words differ per mode so that
no cache carries over from one mode to the other) on the same stack, one mode after the other:
the prefill's computed-token counter and the decode's retained memory are instance-wide, so
only a mode that has the stack to itself can be measured by them, and each mode's turns per
second is then its own. A short warm-up conversation (NIXL handshakes, first-request costs) runs
before the first mode, and the load average is recorded around each mode; ``--modes on,off``
reverses the order to check for drift.

Recorded per turn: prompt tokens (``usage``), TTFT (request start to the first content chunk),
total time, and the router's ``X-KVTurn-Reuse`` / ``X-KVTurn-Reused-Tokens``. Sampled every
``sample_interval`` seconds in a background thread: the decode's retained bytes (control
endpoint ``/kvturn/v1/stats``, ``retention.held_bytes``) and the prefill's computed prompt
tokens (``vllm:prompt_tokens_by_source_total{source="local_compute"}``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvturn_server._plot import pyplot, save
from kvturn_server.local._corpus import _WORDS
from kvturn_server.local._metrics import PromptSources

if TYPE_CHECKING:
    import kvturn
    from kvturn_server.local._stack import StackConfig

MODES = ("off", "on")
Z90 = 1.2815515655446004  # NormalDist().inv_cdf(0.9)
Z99 = 2.3263478740408408  # NormalDist().inv_cdf(0.99)
MIB = 1024 * 1024
# The lease and its renewal, as deployed (connector and SDK defaults), before time scaling.
TRACE_RETENTION_TTL_S = 480.0
TRACE_KEEPALIVE_PER_TTL = 8  # the SDK renews every 60 s of a 480 s lease
MIN_RETENTION_TTL_S = 30.0
# Template framing per message (ChatML: <|im_start|>role\n ... <|im_end|>\n, tool tags).
FRAMING_TOKENS = 12

ORDER_RATIONALE = (
    "modes run one after the other on the same stack, with the same scripts: the prefill's "
    "computed-token counter and the decode's retained bytes are instance-wide, so a mode can "
    "only be measured by them while it has the stack to itself (interleaved agents would mix "
    "both modes in every sample and share the prefill's time, so neither mode's turns per "
    "second would be its own); a warm-up conversation runs first and the load average is "
    "recorded around each mode (reverse the order with --modes on,off to check for drift)")


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
    modes: tuple[str, ...] = MODES
    stagger_s: float = 1.0
    system_tokens: int = 2500
    message_tokens: tuple[int, int] = (100, 300)
    max_tokens: int = 64
    gap_p50_s: float = 2.0
    gap_p90_s: float = 24.0
    gap_cap_s: float | None = 660.0
    retention_ttl_s: float | None = None
    keepalive_interval_s: float | None = None
    prefill_prefix_cache: bool = False
    kv_cache_gib: float = 1.0
    sample_interval_s: float = 0.5
    progress_interval_s: float = 5.0
    warmup: bool = True
    max_retries: int = 2
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.agents < 1 or self.turns < 1:
            raise ValueError("--agents and --turns must be at least 1")
        if not self.modes or any(m not in MODES for m in self.modes) or len(
                set(self.modes)) != len(self.modes):
            raise ValueError(f"modes must be distinct values of {MODES}, got {self.modes}")
        low, high = self.message_tokens
        if not 1 <= low <= high:
            raise ValueError(f"message tokens need 1 <= min <= max, got {self.message_tokens}")
        if self.system_tokens < 1 or self.max_tokens < 1:
            raise ValueError("--system-tokens and --max-tokens must be at least 1")
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

    def max_prompt_tokens(self) -> int:
        """An upper estimate of the last turn's prompt (words are one token each)."""
        per_turn = self.message_tokens[1] + self.max_tokens + 2 * FRAMING_TOKENS
        return self.system_tokens + FRAMING_TOKENS + self.turns * per_turn + 64

    def check_fits(self, max_model_len: int) -> None:
        need = self.max_prompt_tokens() + self.max_tokens
        if need > max_model_len:
            raise ValueError(
                f"the last turn may need about {need} tokens, more than the {self.size} model's "
                f"context of {max_model_len}: lower --turns, --system-tokens or "
                "--message-tokens, or use --size bench (32k)")

    def describe(self) -> dict[str, Any]:
        data = asdict(self)
        data["json_path"] = None if self.json_path is None else str(self.json_path)
        data["plot_path"] = None if self.plot_path is None else str(self.plot_path)
        data["state_dir"] = str(self.state_dir)
        data["modes"] = list(self.modes)
        data["message_tokens"] = list(self.message_tokens)
        data["effective_retention_ttl_s"] = self.retention_ttl
        data["effective_keepalive_interval_s"] = self.keepalive_interval
        data["max_prompt_tokens_estimate"] = self.max_prompt_tokens()
        return data


# The workload.

Message = dict[str, Any]


@dataclass(frozen=True)
class AgentScript:
    """What one agent sends in one mode: its system prompt, one new message per turn, the tool
    gap after each turn but the last, and when it starts (seconds after the mode starts)."""

    agent: int
    mode: str
    start_s: float
    system: str
    messages: tuple[Message, ...]
    gaps_s: tuple[float, ...]
    system_words: int
    message_words: tuple[int, ...]


def _rng(seed: int, *parts: object) -> random.Random:
    # String seeds are hashed with SHA-512 by random.seed: stable across runs and machines.
    return random.Random("/".join(["kvturn-bench-agent", str(seed), *map(str, parts)]))


def _words(rng: random.Random, n: int) -> str:
    """``n`` words of the local tokenizer's training vocabulary: one token each (with the
    leading space), so word counts are token counts to within a token."""
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def build_scripts(settings: AgentBenchSettings, mode: str) -> list[AgentScript]:
    """The agents' scripts for ``mode``. Sizes, gaps and starts depend on the seed and the agent
    only (the same in both modes); the words also on the mode, so that no KV cached in one mode
    can serve the other."""
    gaps = settings.gaps
    low, high = settings.message_tokens
    scripts = []
    for agent in range(settings.agents):
        shape = _rng(settings.seed, "shape", agent)
        sizes = tuple(shape.randint(low, high) for _ in range(settings.turns))
        gap_rng = _rng(settings.seed, "gaps", agent)
        agent_gaps = tuple(gaps.draw(gap_rng) for _ in range(settings.turns - 1))
        text = _rng(settings.seed, "text", mode, agent)
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
                                   system_words=settings.system_tokens, message_words=sizes))
    return scripts


# Per-turn records and the agent loop.

@dataclass
class TurnRecord:
    mode: str
    agent: int
    turn: int
    conversation_id: str | None
    started_s: float
    """Seconds after the mode started."""
    message_role: str
    message_words: int
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    reuse: str | None = None
    reused_tokens: int = 0
    no_reuse_reason: str | None = None
    finish_reason: str | None = None
    gap_after_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class AgentOutcome:
    mode: str
    agent: int
    conversation_id: str | None
    turns_ok: int = 0
    error: str | None = None
    sdk_stats: dict[str, Any] | None = None


class _Live:
    """What the progress line reports, updated by the agents as they go."""

    def __init__(self, agents: int, turns: int) -> None:
        self.agents = agents
        self.turns = agents * turns
        self.done_agents = 0
        self.done_turns = 0
        self.failed_turns = 0
        self.in_turn = 0
        self.in_gap = 0
        self.ttfts: list[float] = []


def _header_int(value: str | None) -> int:
    try:
        return max(int(value), 0) if value is not None else 0
    except ValueError:
        return 0


async def _stream_turn(target: Any, model: str, messages: list[Message], max_tokens: int,
                       clock: Callable[[], float], record: TurnRecord) -> str:
    """One streamed turn: fills ``record``'s timings, usage and reuse report; returns the text."""
    started = clock()
    stream = await target.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    headers = stream.response.headers
    record.reuse = headers.get("x-kvturn-reuse")
    record.reused_tokens = _header_int(headers.get("x-kvturn-reused-tokens"))
    first_content: float | None = None
    first_finish: float | None = None
    parts: list[str] = []
    async for chunk in stream:
        if chunk.usage is not None:
            record.prompt_tokens = chunk.usage.prompt_tokens
            record.completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            content = choice.delta.content
            if content:
                if first_content is None:
                    first_content = clock()
                parts.append(content)
            if choice.finish_reason is not None:
                record.finish_reason = choice.finish_reason
                if first_finish is None:
                    first_finish = clock()
    ended = clock()
    # A reply without text (the model's first token ends it) has its first token at the end.
    first = first_content if first_content is not None else first_finish
    record.ttft_ms = None if first is None else round((first - started) * 1000, 3)
    record.total_ms = round((ended - started) * 1000, 3)
    return "".join(parts)


async def run_agent(script: AgentScript, client: kvturn.AsyncOpenAI, model: str,
                    settings: AgentBenchSettings, t0: float, records: list[TurnRecord],
                    live: _Live, *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                    clock: Callable[[], float] = time.perf_counter) -> AgentOutcome:
    """Run one agent's turns (and tool gaps) in ``script.mode``; append a record per turn."""
    delay = script.start_s - (clock() - t0)
    if delay > 0:
        await sleep(delay)
    conversation = (client.conversation(keepalive_interval=settings.keepalive_interval)
                    if script.mode == "on" else None)
    target: Any = conversation if conversation is not None else client
    outcome = AgentOutcome(script.mode, script.agent,
                           conversation.id if conversation is not None else None)
    messages: list[Message] = [{"role": "system", "content": script.system}]
    try:
        for turn, message in enumerate(script.messages):
            messages.append(message)
            record = TurnRecord(
                mode=script.mode, agent=script.agent, turn=turn + 1,
                conversation_id=outcome.conversation_id, started_s=round(clock() - t0, 4),
                message_role=message["role"], message_words=script.message_words[turn],
                gap_after_s=script.gaps_s[turn] if turn < len(script.gaps_s) else None)
            records.append(record)
            live.in_turn += 1
            try:
                text = await _stream_turn(target, model, messages, settings.max_tokens, clock,
                                          record)
            except Exception as error:
                record.error = f"{type(error).__name__}: {error}"[:500]
                outcome.error = f"turn {turn + 1}: {record.error}"
                live.failed_turns += 1
                return outcome  # the conversation cannot go on without this turn's reply
            finally:
                live.in_turn -= 1
            if conversation is not None and conversation.last_turn is not None:
                record.no_reuse_reason = conversation.last_turn.no_reuse_reason
            if record.ttft_ms is not None:
                live.ttfts.append(record.ttft_ms)
            live.done_turns += 1
            outcome.turns_ok += 1
            # The reply exactly as received: the next prompt extends what the decode retained.
            messages.append({"role": "assistant", "content": text})
            if turn < len(script.gaps_s):
                live.in_gap += 1
                try:
                    if conversation is not None:
                        async with conversation.pause("tool"):
                            await sleep(script.gaps_s[turn])
                    else:
                        await sleep(script.gaps_s[turn])
                finally:
                    live.in_gap -= 1
        return outcome
    finally:
        live.done_agents += 1
        if conversation is not None:
            await conversation.close()
            stats = conversation.stats
            outcome.sdk_stats = {
                "turns": stats.turns, "reused_tokens": stats.reused_tokens,
                "hits": stats.hits, "outcomes": dict(stats.outcomes),
                "no_reuse": dict(stats.no_reuse), "retries": stats.retries,
                "keepalives": stats.keepalives, "keepalive_failures": stats.keepalive_failures,
                "release_failures": stats.release_failures}


# What the instances say over time.

class Probe(Protocol):
    """Reads the stack's instance-wide numbers; any of them may be unavailable (None)."""

    def retained_bytes(self) -> int | None: ...

    def prefill_sources(self) -> PromptSources | None: ...

    def decode_sources(self) -> PromptSources | None: ...


class HttpProbe:
    """The real stack: the decode's control endpoint and both instances' ``/metrics``."""

    def __init__(self, prefill_url: str, decode_url: str, decode_control_url: str) -> None:
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.decode_control_url = decode_control_url

    def retained_bytes(self) -> int | None:
        from kvturn_server.local._direct import control

        try:
            status, stats = control(self.decode_control_url, "GET", "/kvturn/v1/stats",
                                    timeout=5.0)
        except (OSError, ValueError):
            return None
        retention = stats.get("retention") if status == 200 else None
        if not isinstance(retention, dict) or "held_bytes" not in retention:
            return None
        return int(retention["held_bytes"])

    @staticmethod
    def _sources(url: str) -> PromptSources | None:
        from kvturn_server.local._metrics import prompt_sources

        try:
            return prompt_sources(url)
        except (OSError, ValueError):
            return None

    def prefill_sources(self) -> PromptSources | None:
        return self._sources(self.prefill_url)

    def decode_sources(self) -> PromptSources | None:
        return self._sources(self.decode_url)


@dataclass
class Sample:
    mode: str
    t_s: float
    retained_bytes: int | None
    prefill_computed_tokens: float | None


class Sampler:
    """Samples the probe every ``interval`` seconds in a daemon thread, once at ``start()``
    and once more at ``stop()`` (so a run always has its first and last point)."""

    def __init__(self, probe: Probe, mode: str, interval: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.probe = probe
        self.mode = mode
        self.interval = interval
        self.clock = clock
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = 0.0

    def sample(self) -> Sample:
        retained = self.probe.retained_bytes()
        sources = self.probe.prefill_sources()
        point = Sample(self.mode, round(self.clock() - self.t0, 4), retained,
                       None if sources is None else sources.computed)
        with self._lock:
            self.samples.append(point)
        return point

    def latest(self) -> Sample | None:
        with self._lock:
            return self.samples[-1] if self.samples else None

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.sample()
        self._thread = threading.Thread(target=self._run, name=f"kvturn-bench-{self.mode}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> list[Sample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.sample()
        with self._lock:
            return sorted(self.samples, key=lambda s: s.t_s)


# Summaries.

def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) with linear interpolation between order statistics (numpy's
    default); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    if not 0 <= q <= 1:
        raise ValueError(f"q must be within [0, 1], got {q}")
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    def r(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    return {"n": len(values), "p50": r(percentile(values, 0.5)),
            "p90": r(percentile(values, 0.9)), "p99": r(percentile(values, 0.99)),
            "mean": r(statistics.fmean(values)) if values else None,
            "max": r(max(values)) if values else None}


def _delta(after: PromptSources | None, before: PromptSources | None) -> dict[str, float] | None:
    if after is None or before is None:
        return None
    d = after - before
    return {"computed": d.computed, "local_cache": d.local_cache, "transferred": d.transferred}


@dataclass
class ModeRun:
    """Everything measured in one mode."""

    mode: str
    wall_s: float
    records: list[TurnRecord]
    samples: list[Sample]
    agents: list[AgentOutcome]
    prefill_before: PromptSources | None = None
    prefill_after: PromptSources | None = None
    decode_before: PromptSources | None = None
    decode_after: PromptSources | None = None
    load_before: tuple[float, ...] = ()
    load_after: tuple[float, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


def summarize(run: ModeRun, planned_turns: int) -> dict[str, Any]:
    ok = [r for r in run.records if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    later = [r.ttft_ms for r in ok if r.ttft_ms is not None and r.turn > 1]
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    retained = [s.retained_bytes / MIB for s in run.samples if s.retained_bytes is not None]
    outcomes = Counter(r.reuse or "unreported" for r in ok)
    prefill = _delta(run.prefill_after, run.prefill_before)
    return {
        "mode": run.mode,
        "agents": len(run.agents),
        "turns_planned": planned_turns,
        "turns_ok": len(ok),
        "errors": len(run.records) - len(ok),
        "wall_s": round(run.wall_s, 3),
        "turns_per_s": round(len(ok) / run.wall_s, 4) if run.wall_s > 0 else None,
        "ttft_ms": distribution(ttft),
        "ttft_ms_turn2plus": distribution(later),
        "total_ms": distribution([r.total_ms for r in ok if r.total_ms is not None]),
        "prompt_tokens": {"total": sum(prompts), "mean": round(statistics.fmean(prompts), 1)
                          if prompts else None, "max": max(prompts) if prompts else None},
        "completion_tokens": sum(r.completion_tokens or 0 for r in ok),
        "prefill_computed_tokens": None if prefill is None else prefill["computed"],
        "prefill_tokens": prefill,
        "decode_tokens": _delta(run.decode_after, run.decode_before),
        "reuse": {"outcomes": dict(sorted(outcomes.items())),
                  "reused_tokens": sum(r.reused_tokens for r in ok)},
        "retained_mib": {
            "max": round(max(retained), 3) if retained else None,
            "mean": round(statistics.fmean(retained), 3) if retained else None,
            "samples": len(retained)},
        "load_average": {"before": list(run.load_before), "after": list(run.load_after)},
    }


def _ratio(a: float | int | None, b: float | int | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def compare(summaries: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """off / on ratios (above 1: the "on" mode is better, for turns per second below 1)."""
    if "off" not in summaries or "on" not in summaries:
        return None
    off, on = summaries["off"], summaries["on"]
    out: dict[str, Any] = {}
    for key in ("ttft_ms", "ttft_ms_turn2plus"):
        for q in ("p50", "p90", "p99"):
            out[f"{key}_{q}_off_over_on"] = _ratio(off[key][q], on[key][q])
    out["prefill_computed_off_over_on"] = _ratio(off["prefill_computed_tokens"],
                                                 on["prefill_computed_tokens"])
    out["turns_per_s_on_over_off"] = _ratio(on["turns_per_s"], off["turns_per_s"])
    return out


def build_results(settings: AgentBenchSettings, runs: Sequence[ModeRun],
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document: settings, seed, gaps, per-mode summaries, every record and sample."""
    planned = settings.agents * settings.turns
    summaries = {run.mode: summarize(run, planned) for run in runs}
    gaps = settings.gaps
    drawn = {script.agent: list(script.gaps_s) for script in build_scripts(settings, MODES[0])}
    all_gaps = [g for agent in drawn.values() for g in agent]
    return {
        "benchmark": "agent",
        "seed": settings.seed,
        "settings": settings.describe(),
        "order": [run.mode for run in runs],
        "order_rationale": ORDER_RATIONALE,
        "gaps": {**gaps.describe(),
                 "drawn_s": {str(agent): [round(g, 4) for g in values]
                             for agent, values in drawn.items()},
                 "drawn_quantiles_s": distribution(all_gaps)},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        **(extra or {}),
        "modes": summaries,
        "comparison": compare(summaries),
        "agents": [asdict(a) for run in runs for a in run.agents],
        "turns": [asdict(r) for run in runs for r in run.records],
        "samples": [asdict(s) for run in runs for s in run.samples],
    }


def _fmt(value: float | int | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict[str, Any]) -> str:
    header = (f"{'mode':<5}{'turns':>7}{'err':>5}{'TTFT p50':>10}{'p90':>8}{'p99':>8}"
              f"{'t2+ p50':>9}{'prompt tok':>12}{'P computed':>12}{'turns/s':>9}"
              f"{'ret MiB max':>13}{'mean':>8}  reuse outcomes; reused tokens")
    rows = [header]
    for mode, s in results["modes"].items():
        outcomes = ", ".join(f"{k} {v}" for k, v in s["reuse"]["outcomes"].items())
        rows.append(
            f"{mode:<5}{s['turns_ok']:>7}{s['errors']:>5}{_fmt(s['ttft_ms']['p50']):>10}"
            f"{_fmt(s['ttft_ms']['p90']):>8}{_fmt(s['ttft_ms']['p99']):>8}"
            f"{_fmt(s['ttft_ms_turn2plus']['p50']):>9}{s['prompt_tokens']['total']:>12}"
            f"{_fmt(s['prefill_computed_tokens']):>12}{_fmt(s['turns_per_s'], '.3f'):>9}"
            f"{_fmt(s['retained_mib']['max'], '.1f'):>13}"
            f"{_fmt(s['retained_mib']['mean'], '.1f'):>8}  {outcomes}; reused "
            f"{s['reuse']['reused_tokens']}")
    cmp = results.get("comparison")
    if cmp:
        rows.append(
            f"off/on: TTFT p50 {_fmt(cmp['ttft_ms_p50_off_over_on'], '.2f')}x, p90 "
            f"{_fmt(cmp['ttft_ms_p90_off_over_on'], '.2f')}x, p99 "
            f"{_fmt(cmp['ttft_ms_p99_off_over_on'], '.2f')}x (turns 2+: p50 "
            f"{_fmt(cmp['ttft_ms_turn2plus_p50_off_over_on'], '.2f')}x); prefill computed "
            f"{_fmt(cmp['prefill_computed_off_over_on'], '.2f')}x; turns/s on/off "
            f"{_fmt(cmp['turns_per_s_on_over_off'], '.2f')}")
    return "\n".join(rows)


def write_json(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


def write_plot(results: dict[str, Any], path: Path) -> bool:
    """PNG: TTFT distribution (CDF) per mode, retained MiB over time, prefill computed tokens
    over time; False when matplotlib (extra ``[bench]``) is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    colors = {"off": "tab:red", "on": "tab:blue"}
    labels = {"off": "off (plain P/D)", "on": "on (kvturn conversations)"}
    fig, (ax_ttft, ax_mem, ax_tok) = plt.subplots(1, 3, figsize=(16, 4.8))
    for mode in results["modes"]:
        ttft = sorted(t["ttft_ms"] for t in results["turns"]
                      if t["mode"] == mode and t["error"] is None and t["ttft_ms"] is not None)
        if ttft:
            ax_ttft.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post",
                         color=colors[mode], label=f"{labels[mode]}, n={len(ttft)}")
        samples = [s for s in results["samples"] if s["mode"] == mode]
        mem = [(s["t_s"], s["retained_bytes"] / MIB) for s in samples
               if s["retained_bytes"] is not None]
        if mem:
            ax_mem.step(*zip(*mem, strict=True), where="post", color=colors[mode],
                        label=labels[mode])
        tok = [(s["t_s"], s["prefill_computed_tokens"]) for s in samples
               if s["prefill_computed_tokens"] is not None]
        if tok:
            base = tok[0][1]
            ax_tok.plot([t for t, _ in tok], [v - base for _, v in tok], color=colors[mode],
                        label=labels[mode])
    settings = results["settings"]
    ax_ttft.set_xscale("log")
    ax_ttft.set_xlabel("TTFT (ms)")
    ax_ttft.set_ylabel("fraction of turns")
    ax_ttft.set_title("TTFT distribution")
    ax_mem.set_xlabel("seconds since the mode started")
    ax_mem.set_ylabel("decode retained MiB")
    ax_mem.set_title("retained KV over time")
    ax_tok.set_xlabel("seconds since the mode started")
    ax_tok.set_ylabel("prompt tokens computed by the prefill")
    ax_tok.set_title("prefill compute (cumulative)")
    for ax in (ax_ttft, ax_mem, ax_tok):
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"kvturn bench agent: {settings['agents']} agents x {settings['turns']} turns, "
                 f"{settings['size']} model, tool gaps x{settings['time_scale']:g}")
    save(plt, fig, path)
    return True


# Running the modes.

def _loadavg() -> tuple[float, ...]:
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        return ()


async def _progress(mode: str, live: _Live, sampler: Sampler, t0: float, interval: float,
                    say: Callable[[str], None], clock: Callable[[], float]) -> None:
    while True:
        await asyncio.sleep(interval)
        latest = sampler.latest()
        retained = ("-" if latest is None or latest.retained_bytes is None
                    else f"{latest.retained_bytes / MIB:.1f}")
        p50 = percentile(live.ttfts, 0.5)
        say(f"[{mode}] {clock() - t0:6.1f} s: agents {live.done_agents}/{live.agents} done, "
            f"{live.in_turn} in a turn, {live.in_gap} in a tool gap; turns "
            f"{live.done_turns}/{live.turns}"
            + (f" ({live.failed_turns} failed)" if live.failed_turns else "")
            + f"; TTFT p50 so far {_fmt(p50)} ms; decode retains {retained} MiB")


async def _wait_released(probe: Probe, timeout: float, sleep: Callable[[float], Awaitable[None]],
                         clock: Callable[[], float]) -> int | None:
    """Wait (up to ``timeout``) until the decode retains nothing, so that one mode's leases
    do not show in the next mode's samples; returns what it still holds."""
    deadline = clock() + timeout
    while True:
        held = await asyncio.to_thread(probe.retained_bytes)
        if not held or clock() >= deadline:
            return held
        await sleep(0.25)


async def run_mode(mode: str, settings: AgentBenchSettings, client: kvturn.AsyncOpenAI,
                   model: str, probe: Probe, *, say: Callable[[str], None] = print,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                   clock: Callable[[], float] = time.perf_counter) -> ModeRun:
    """All agents of one mode, concurrently; the sampler runs meanwhile."""
    scripts = build_scripts(settings, mode)
    held = await _wait_released(probe, 15.0, sleep, clock)
    live = _Live(settings.agents, settings.turns)
    records: list[TurnRecord] = []
    load_before = _loadavg()
    prefill_before, decode_before = await asyncio.to_thread(
        lambda: (probe.prefill_sources(), probe.decode_sources()))
    sampler = Sampler(probe, mode, settings.sample_interval_s, clock)
    t0 = clock()
    sampler.start(t0)
    say(f"[{mode}] {settings.agents} agents x {settings.turns} turns, starting "
        f"{settings.stagger_s:g} s apart"
        + ("; each a kvturn conversation, paused during tool gaps" if mode == "on"
           else "; no conversation ids (plain P/D)"))
    ticker = (asyncio.create_task(_progress(mode, live, sampler, t0,
                                            settings.progress_interval_s, say, clock))
              if settings.progress_interval_s > 0 else None)
    try:
        agents = await asyncio.gather(*(
            run_agent(script, client, model, settings, t0, records, live, sleep=sleep,
                      clock=clock) for script in scripts))
    finally:
        if ticker is not None:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
    wall = clock() - t0
    samples = await asyncio.to_thread(sampler.stop)
    prefill_after, decode_after = await asyncio.to_thread(
        lambda: (probe.prefill_sources(), probe.decode_sources()))
    records.sort(key=lambda r: (r.agent, r.turn))
    failed = [a for a in agents if a.error is not None]
    say(f"[{mode}] done in {wall:.1f} s: {live.done_turns}/{live.turns} turns"
        + (f"; {len(failed)} agents stopped early: {failed[0].error}" if failed else ""))
    return ModeRun(mode=mode, wall_s=wall, records=records, samples=samples, agents=agents,
                   prefill_before=prefill_before, prefill_after=prefill_after,
                   decode_before=decode_before, decode_after=decode_after,
                   load_before=load_before, load_after=_loadavg(),
                   extra={"retained_bytes_at_start": held})


async def warm_up(client: kvturn.AsyncOpenAI, model: str, settings: AgentBenchSettings,
                  clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """A short kvturn conversation before the first mode (NIXL handshakes in both directions,
    first-request costs); its TTFTs (ms) are returned, not counted."""
    small = replace(settings, agents=1, turns=2, system_tokens=min(settings.system_tokens, 300),
                    stagger_s=0.0, modes=("on",))
    script = build_scripts(small, "warm-up")[0]
    script = replace(script, mode="on", gaps_s=(0.0,))
    records: list[TurnRecord] = []
    outcome = await run_agent(script, client, model, small, clock(), records,
                              _Live(1, 2), sleep=lambda s: asyncio.sleep(0), clock=clock)
    if outcome.error is not None:
        raise RuntimeError(f"the warm-up conversation failed: {outcome.error}")
    return [r.ttft_ms for r in records if r.ttft_ms is not None]


async def measure(settings: AgentBenchSettings, client: kvturn.AsyncOpenAI, model: str,
                  probe: Probe, *, say: Callable[[str], None] = print,
                  sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                  clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Warm up, run every mode in ``settings.modes`` order; the results document."""
    load_start = _loadavg()
    warm = await warm_up(client, model, settings, clock) if settings.warmup else []
    runs = []
    for mode in settings.modes:
        runs.append(await run_mode(mode, settings, client, model, probe, say=say, sleep=sleep,
                                   clock=clock))
    extra = {"warmup_ttft_ms": warm,
             "load_average": {"start": list(load_start), "end": list(_loadavg())},
             "retained_bytes_at_mode_start": {r.mode: r.extra.get("retained_bytes_at_start")
                                              for r in runs}}
    return build_results(settings, runs, extra)


# The stack.

def agent_stack_config(settings: AgentBenchSettings, ports: dict[str, Any]) -> StackConfig:
    """Prefill + decode + router on the chosen model, leases scaled like the tool gaps."""
    from kvturn_server.local._model import SIZES
    from kvturn_server.local._stack import StackConfig

    cfg = StackConfig(
        state_dir=settings.state_dir, model_size=settings.size,
        served_model_name=f"kvturn-{settings.size}",
        max_model_len=SIZES[settings.size].max_positions, kv_cache_gib=settings.kv_cache_gib,
        decoder_kv_blocks_ttl=settings.retention_ttl,
        prefill_prefix_caching=settings.prefill_prefix_cache, with_router=True,
        with_reference=False)
    return replace(cfg, **ports)


PORT_FIELDS = ("router_port", "prefill_port", "decode_port", "prefill_side_channel_port",
               "decode_side_channel_port", "prefill_control_port", "decode_control_port")


def _free_ports() -> dict[str, int]:
    from kvturn_server.local import free_port

    return {name: free_port() for name in PORT_FIELDS}


def run_agent_bench(settings: AgentBenchSettings,
                    say: Callable[[str], None] = print) -> dict[str, Any]:
    """Start the stack, run the modes, stop the stack; print a table, write the JSON and the
    plot when their paths are set; return the results."""
    import httpx2

    import kvturn
    from kvturn_server.cli import ProgressLine
    from kvturn_server.local._model import SIZES
    from kvturn_server.local._stack import Stack

    settings.check_fits(SIZES[settings.size].max_positions)
    cfg = agent_stack_config(settings, _free_ports())
    gaps = settings.gaps
    say(f"tool gaps: log-normal, p50 {gaps.quantile(0.5):.2f} s, p90 {gaps.quantile(0.9):.2f} s,"
        f" p99 {gaps.quantile(0.99):.2f} s (trace x{settings.time_scale:g}); lease "
        f"{settings.retention_ttl:g} s, keepalive every {settings.keepalive_interval:g} s")
    say(f"starting the benchmark stack ({settings.size} model; prefill, decode, router; prefill "
        f"prefix cache {'on' if settings.prefill_prefix_cache else 'off'})")
    with Stack(cfg, die_with_parent=True) as stack:
        stack.start(progress=ProgressLine())
        probe = HttpProbe(cfg.prefill_url, cfg.decode_url, cfg.decode_control_url)

        async def main() -> dict[str, Any]:
            http = httpx2.AsyncClient(timeout=settings.request_timeout_s)
            client = kvturn.AsyncOpenAI(base_url=f"{cfg.router_url}/v1", api_key="kvturn-bench",
                                        max_retries=settings.max_retries,
                                        timeout=settings.request_timeout_s, http_client=http)
            try:
                return await measure(settings, client, cfg.served_model_name, probe, say=say)
            finally:
                await client.close()

        results = asyncio.run(main())
        results["stack"] = {"model": settings.size, "served_model_name": cfg.served_model_name,
                            "max_model_len": cfg.max_model_len,
                            "kv_cache_gib": cfg.kv_cache_gib,
                            "prefill_prefix_caching": cfg.prefill_prefix_caching,
                            "decoder_kv_blocks_ttl": cfg.decoder_kv_blocks_ttl,
                            "retention_budget": cfg.retention_budget,
                            "startup_s": stack.startup_seconds}
    say(table(results))
    if settings.json_path is not None:
        write_json(results, settings.json_path)
        plot = settings.plot_path or settings.json_path.with_suffix(".png")
        if write_plot(results, plot):
            say(f"wrote {settings.json_path} and {plot}")
        else:
            say(f"wrote {settings.json_path}; no plot: matplotlib is not installed (extra "
                "[bench])")
    return results


# The command line.

def _message_tokens(text: str) -> tuple[int, int]:
    try:
        low, _, high = text.partition(",")
        return int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX token counts, got {text!r}") from None


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"expected a comma list of off and on, got {text!r}")
    return modes


def settings_from_args(args: argparse.Namespace) -> AgentBenchSettings:
    return AgentBenchSettings(
        agents=args.agents, turns=args.turns, time_scale=args.time_scale, seed=args.seed,
        json_path=args.json, plot_path=args.plot, size=args.size, state_dir=args.state_dir,
        modes=args.modes, stagger_s=args.stagger, system_tokens=args.system_tokens,
        message_tokens=args.message_tokens, max_tokens=args.max_tokens,
        gap_cap_s=args.max_gap if args.max_gap > 0 else None,
        retention_ttl_s=args.retention_ttl, prefill_prefix_cache=args.prefill_prefix_cache,
        kv_cache_gib=args.kv_cache_gib)


def cmd_bench_agent(args: argparse.Namespace) -> int:
    from kvturn_server.local._model import SIZES

    try:
        settings = settings_from_args(args)
        settings.check_fits(SIZES[settings.size].max_positions)
    except ValueError as error:
        raise SystemExit(f"kvturn bench agent: {error}") from None
    run_agent_bench(settings)
    return 0


def add_agent_bench_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``agent`` to ``kvturn bench``'s subcommands (sets ``func``)."""
    from kvturn_server.local._model import SIZES

    d = AgentBenchSettings()
    p: argparse.ArgumentParser = bench_subparsers.add_parser(
        "agent", help="concurrent tool-using agents: TTFT, prefill work and retained memory, "
                      "with and without kvturn conversations",
        description="Start prefill + decode + router, then run N concurrent agents of M turns "
                    "each (growing conversations, tool gaps drawn from a log-normal fitted to "
                    "production agent traces, scaled by --time-scale) twice: 'off' without "
                    "conversation ids (plain P/D), 'on' as kvturn conversations that keep "
                    "their lease during tool gaps. Prints TTFT p50/p90/p99, prompt tokens the "
                    "prefill computed, turns per second and the decode's retained memory per "
                    "mode; writes every turn and sample as JSON and a PNG plot. The default "
                    "run takes a few minutes on a 2-core machine.")
    p.add_argument("--json", type=Path, required=True, help="where to write the results")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG path (default: the JSON path with .png)")
    p.add_argument("--agents", type=int, default=d.agents,
                   help="concurrent agents (default: %(default)s)")
    p.add_argument("--turns", type=int, default=d.turns,
                   help="turns per agent (default: %(default)s)")
    p.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="factor on the traces' tool gaps (p50 2 s, p90 24 s) and on the 480 s "
                        "lease; 0.1 gives gaps of p50 0.2 s (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the gaps and the generated text (default: %(default)s)")
    p.add_argument("--size", choices=sorted(SIZES), default=d.size,
                   help="model (default: %(default)s)")
    p.add_argument("--state-dir", type=Path, default=d.state_dir,
                   help="model, logs and state of the benchmark stack (default: %(default)s)")
    p.add_argument("--modes", type=_modes, default=d.modes, metavar="off,on",
                   help="which modes to run, in this order (default: off,on)")
    p.add_argument("--stagger", type=float, default=d.stagger_s,
                   help="seconds between two agents' starts (default: %(default)s)")
    p.add_argument("--system-tokens", type=int, default=d.system_tokens,
                   help="system prompt length (default: %(default)s)")
    p.add_argument("--message-tokens", type=_message_tokens, default=d.message_tokens,
                   metavar="MIN,MAX",
                   help="size of each turn's new user/tool message (default: 100,300)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="reply length limit (default: %(default)s)")
    p.add_argument("--max-gap", type=float, default=d.gap_cap_s,
                   help="cap on a tool gap in trace seconds, before scaling; 0: none "
                        "(default: %(default)s, the traces' p99)")
    p.add_argument("--retention-ttl", type=float, default=None,
                   help="the decode's lease in seconds (default: 480 x --time-scale, at least "
                        f"{MIN_RETENTION_TTL_S:g}); the SDK renews every eighth of it during a "
                        "tool gap")
    p.add_argument("--prefill-prefix-cache", action=argparse.BooleanOptionalAction,
                   default=d.prefill_prefix_cache,
                   help="the prefill's own prefix cache; off (default, as in bench reuse) "
                        "stands for a prefill pool where a conversation's next turn does not "
                        "find its prefix locally")
    p.add_argument("--kv-cache-gib", type=float, default=d.kv_cache_gib,
                   help="KV cache per vLLM instance in GiB (default: %(default)s)")
    p.set_defaults(func=cmd_bench_agent)
    return p
