"""The agents of one ``kvturn bench fleet`` run and what the instances say meanwhile.

One run is one mode with the fleet to itself: every agent of the scenario, concurrently, through
that mode's router. Per turn: TTFT (request start to the first content chunk), the gaps between
streamed content chunks (inter-token latency as a client sees it), usage, and the router's
``X-KVTurn-*`` report. Around the run: every instance's prompt-token counters (computed, local
cache hit, transferred, loaded from a host tier) and the prefills'
``kvturn:reused_tokens_total``; during it, every decode's retained bytes (control endpoint
``/kvturn/v1/stats``) in a background thread.

The agent loop is ``kvturn bench agent``'s (``bench/agent/_loop.py``), run as the mode's
client kind, every reply exactly its planned length (``ignore_eos``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvturn_server.bench._fleet_plan import AgentPlan, FleetMode
from kvturn_server.bench._sampling import PeriodicSampler, loadavg, retained_bytes, wait_released
from kvturn_server.bench._stats import fmt, percentile, rounded
from kvturn_server.bench.agent._kinds import IDS
from kvturn_server.bench.agent._loop import Live, chunk_gaps_ms, progress
from kvturn_server.bench.agent._loop import run_agent as run_as_client
from kvturn_server.bench.agent._records import AgentOutcome

if TYPE_CHECKING:
    import kvturn

# What the results keep of vllm:cache_config_info (it has some forty labels).
CACHE_INFO_KEYS = frozenset({"block_size", "num_gpu_blocks", "num_gpu_blocks_override",
                             "enable_prefix_caching", "kv_cache_size_tokens", "cache_dtype",
                             "kv_cache_max_concurrency"})


# Per-turn records.

@dataclass
class FleetTurn:
    scenario: str
    mode: str
    repeat: int
    agent: int
    turn: int
    conversation_id: str | None
    started_s: float
    """Seconds after the run started."""
    message_words: int
    reply_tokens: int
    """What the turn asked for (``max_tokens``, with ``ignore_eos``)."""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens`` where vLLM reports it (see
    ``bench.agent.TurnRecord``)."""
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    itl_n: int = 0
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    itl_max_ms: float | None = None
    reuse: str | None = None
    reused_tokens: int = 0
    route: str | None = None
    prefill_choice: str | None = None
    finish_reason: str | None = None
    gap_after_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def itl(self, gaps_ms: Sequence[float]) -> None:
        """Record the gaps (ms) between the reply's content chunks: their count, p50, p99, max."""
        self.itl_n = len(gaps_ms)
        self.itl_p50_ms = rounded(percentile(gaps_ms, 0.5))
        self.itl_p99_ms = rounded(percentile(gaps_ms, 0.99))
        self.itl_max_ms = rounded(max(gaps_ms)) if gaps_ms else None


def conversation_id(mode: str, repeat: int, agent: int, nonce: str) -> str:
    """An ``ids`` mode's conversation id: unique per run, printable ASCII."""
    return f"fleet-{mode}-r{repeat}-a{agent}-{nonce}"


async def run_agent(plan: AgentPlan, mode: FleetMode, scenario: str, repeat: int,
                    client: kvturn.AsyncOpenAI, model: str, keepalive_interval: float,
                    t0: float, records: list[FleetTurn], gaps_ms: list[float], live: Live, *,
                    nonce: str, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                    clock: Callable[[], float] = time.perf_counter) -> AgentOutcome:
    """One agent's turns and tool gaps as ``mode``'s client sends them, every reply exactly
    its planned length (``ignore_eos``: the same work in every mode, whatever the words); a
    record per turn, the gaps between its content chunks (ms) appended to ``gaps_ms``."""
    script = plan.script

    def new_record(turn: int, cid: str | None, started_s: float) -> FleetTurn:
        return FleetTurn(
            scenario=scenario, mode=mode.name, repeat=repeat, agent=script.agent,
            turn=turn + 1, conversation_id=cid, started_s=started_s,
            message_words=script.message_words[turn], reply_tokens=plan.reply_tokens[turn],
            gap_after_s=script.gap_after(turn))

    def timed(record: FleetTurn, chunks: list[float], info: kvturn.TurnInfo | None) -> None:
        if record.ok:
            gaps = chunk_gaps_ms(chunks)
            record.itl(gaps)
            gaps_ms.extend(gaps)

    return await run_as_client(
        script, mode.client, client, model, t0=t0, live=live, records=records,
        new_record=new_record, timed=timed, keepalive_interval=keepalive_interval,
        reply_tokens=plan.reply_tokens,
        conversation_id=conversation_id(mode.name, repeat, script.agent, nonce)
        if mode.client == IDS else None,
        extra_body={"ignore_eos": True}, sleep=sleep, clock=clock)


# What the instances say.

@dataclass(frozen=True)
class Counters:
    """One instance's cumulative prompt-token counters (None: not readable)."""

    computed: float
    local_cache: float
    transferred: float
    reused: float
    """``kvturn:reused_tokens_total``: prompt tokens this instance read from a decode."""
    host: float = 0.0
    """Prompt tokens vLLM's CPU offloading loaded from this instance's host tier
    (``vllm:prompt_tokens_cached_by_source_total{source="host"}``; 0 without one)."""


Snapshot = dict[str, Counters | None]


class FleetProbe(Protocol):
    """Reads the fleet's instance-wide numbers; any of them may be unavailable (None)."""

    def counters(self) -> Snapshot: ...

    def retained(self) -> dict[str, int | None]: ...

    def cache_info(self) -> dict[str, dict[str, Any] | None]: ...


class HttpFleetProbe:
    """The real fleet: every instance's ``/metrics``, every decode's control endpoint."""

    def __init__(self, instances: Sequence[tuple[str, str]],
                 decode_controls: Sequence[tuple[str, str]]) -> None:
        self.instances = list(instances)  # (name, url)
        self.decode_controls = list(decode_controls)  # (name, control url)

    def _scrape_all(self) -> dict[str, Any]:
        from kvturn_server.local import scrape

        out: dict[str, Any] = {}
        for instance, url in self.instances:
            try:
                out[instance] = scrape(url)
            except (OSError, ValueError):
                out[instance] = None
        return out

    def counters(self) -> Snapshot:
        from kvturn_server.local import host_tokens, total

        name = "vllm:prompt_tokens_by_source_total"
        return {instance: None if s is None else Counters(
            computed=total(s, name, source="local_compute"),
            local_cache=total(s, name, source="local_cache_hit"),
            transferred=total(s, name, source="external_kv_transfer"),
            reused=total(s, "kvturn:reused_tokens_total"), host=host_tokens(s))
            for instance, s in self._scrape_all().items()}

    def retained(self) -> dict[str, int | None]:
        return {instance: retained_bytes(url) for instance, url in self.decode_controls}

    def cache_info(self) -> dict[str, dict[str, Any] | None]:
        """Each instance's ``vllm:cache_config_info`` labels (block size, number of blocks,
        prefix caching), as the instance itself reports them."""
        out: dict[str, dict[str, Any] | None] = {}
        for instance, s in self._scrape_all().items():
            labels = None if s is None else next(
                (dict(ls) for (n, ls) in s if n == "vllm:cache_config_info"), None)
            out[instance] = None if labels is None else {
                k: v for k, v in sorted(labels.items()) if k in CACHE_INFO_KEYS}
        return out


def total_retained(by_decode: dict[str, int | None]) -> int | None:
    """What the decodes retain in all (None: none of them could be read)."""
    values = [v for v in by_decode.values() if v is not None]
    return sum(values) if values else None


@dataclass
class Sample:
    t_s: float
    retained_bytes: dict[str, int | None]

    @property
    def total_retained(self) -> int | None:
        return total_retained(self.retained_bytes)


class Sampler(PeriodicSampler[Sample]):
    """Every decode's retained bytes every ``interval`` seconds in a daemon thread, once at
    ``start()`` and once more at ``stop()``."""

    def __init__(self, probe: FleetProbe, interval: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(interval, clock, name="kvturn-bench-fleet")
        self.probe = probe

    def read(self) -> Sample:
        return Sample(self.elapsed(), self.probe.retained())


# One run.

@dataclass
class ModeRun:
    """Everything measured in one mode's run."""

    scenario: str
    mode: str
    repeat: int
    position: int
    wall_s: float
    records: list[FleetTurn]
    agents: list[AgentOutcome]
    samples: list[Sample]
    itl_ms: list[float]
    before: Snapshot
    after: Snapshot
    turns_planned: int = 0
    router_args: tuple[str, ...] = ()
    load_before: tuple[float, ...] = ()
    load_after: tuple[float, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


async def run_mode(mode: FleetMode, scenario: str, repeat: int, position: int,
                   plans: Sequence[AgentPlan], client: kvturn.AsyncOpenAI, model: str,
                   probe: FleetProbe, *, keepalive_interval: float, sample_interval: float,
                   progress_interval: float, settle_s: float, drain_timeout: float,
                   router_args: tuple[str, ...] = (), say: Callable[[str], None] = print,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                   clock: Callable[[], float] = time.perf_counter) -> ModeRun:
    """Every agent of ``plans``, concurrently, through ``client``; the sampler runs meanwhile.
    Before: the decodes' retentions drain and the machine settles for ``settle_s``."""
    held = await wait_released(lambda: total_retained(probe.retained()), drain_timeout,
                               sleep, clock)
    if settle_s > 0:
        await sleep(settle_s)
    tag = f"{scenario} r{repeat} {mode.name}"
    turns = sum(len(p.script.messages) for p in plans)
    live = Live(len(plans), turns)
    records: list[FleetTurn] = []
    itl: list[float] = []
    load_before = loadavg()
    before = await asyncio.to_thread(probe.counters)
    sampler = Sampler(probe, sample_interval, clock)
    nonce = uuid.uuid4().hex[:8]
    t0 = clock()
    sampler.start(t0)
    say(f"[{tag}] {len(plans)} agents, {turns} turns: {mode.stands_for}")

    def held_now() -> int | None:
        latest = sampler.latest()
        return None if latest is None else latest.total_retained

    async with progress(f"[{tag}]", live, held_now, "decodes retain", t0, progress_interval,
                        say, clock):
        agents = await asyncio.gather(*(
            run_agent(plan, mode, scenario, repeat, client, model, keepalive_interval, t0,
                      records, itl, live, nonce=nonce, sleep=sleep, clock=clock)
            for plan in plans))
    wall = clock() - t0
    samples = await asyncio.to_thread(sampler.stop)
    after = await asyncio.to_thread(probe.counters)
    records.sort(key=lambda r: (r.agent, r.turn))
    failed = [a for a in agents if a.error is not None]
    say(f"[{tag}] done in {wall:.1f} s: {live.done_turns}/{turns} turns, TTFT p50 "
        f"{fmt(percentile(live.ttfts, 0.5))} ms"
        + (f"; {len(failed)} agents stopped early: {failed[0].error}" if failed else ""))
    return ModeRun(scenario=scenario, mode=mode.name, repeat=repeat, position=position,
                   wall_s=wall, records=records, agents=list(agents), samples=samples,
                   itl_ms=itl, before=before, after=after, turns_planned=turns,
                   router_args=router_args,
                   load_before=load_before, load_after=loadavg(),
                   extra={"retained_bytes_at_start": held})
