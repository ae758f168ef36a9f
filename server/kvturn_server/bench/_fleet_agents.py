"""The agents of one ``kvturn bench fleet`` run and what the instances say meanwhile.

One run is one mode with the fleet to itself: every agent of the scenario, concurrently, through
that mode's router. Per turn: TTFT (request start to the first content chunk), the gaps between
streamed content chunks (inter-token latency as a client sees it), usage, and the router's
``X-KVTurn-*`` report. Around the run: every instance's prompt-token counters (computed, local
cache hit, transferred) and the prefills' ``kvturn:reused_tokens_total``; during it, every
decode's retained bytes (control endpoint ``/kvturn/v1/stats``) in a background thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvturn_server.bench._agent import Message, percentile
from kvturn_server.bench._fleet_plan import IDS, KVTURN, AgentPlan, FleetMode

if TYPE_CHECKING:
    import kvturn

MIB = 1024 * 1024
HEADER_CONVERSATION_ID = "X-Conversation-ID"
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


@dataclass
class AgentResult:
    agent: int
    conversation_id: str | None
    turns_ok: int = 0
    error: str | None = None
    sdk_stats: dict[str, Any] | None = None


class Live:
    """What the progress line reports, updated by the agents as they go."""

    def __init__(self, agents: int, turns: int) -> None:
        self.agents = agents
        self.turns = turns
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


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


async def stream_turn(target: Any, model: str, messages: list[Message], max_tokens: int,
                      clock: Callable[[], float], record: FleetTurn,
                      headers: dict[str, str] | None = None) -> tuple[str, list[float]]:
    """One streamed turn of exactly ``max_tokens`` tokens (``ignore_eos``: the same work in
    every mode, whatever the words). Fills ``record``; returns the text and the gaps (ms)
    between consecutive content chunks."""
    started = clock()
    stream = await target.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        extra_headers=headers)
    got = stream.response.headers
    record.reuse = got.get("x-kvturn-reuse")
    record.reused_tokens = _header_int(got.get("x-kvturn-reused-tokens"))
    record.route = got.get("x-kvturn-route")
    record.prefill_choice = got.get("x-kvturn-prefill-choice")
    chunks: list[float] = []
    first_finish: float | None = None
    parts: list[str] = []
    async for chunk in stream:
        if chunk.usage is not None:
            record.prompt_tokens = chunk.usage.prompt_tokens
            record.completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                chunks.append(clock())
                parts.append(choice.delta.content)
            if choice.finish_reason is not None:
                record.finish_reason = choice.finish_reason
                if first_finish is None:
                    first_finish = clock()
    ended = clock()
    first = chunks[0] if chunks else first_finish
    record.ttft_ms = None if first is None else round((first - started) * 1000, 3)
    record.total_ms = round((ended - started) * 1000, 3)
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(chunks)]
    record.itl_n = len(gaps)
    record.itl_p50_ms = _ms(percentile(gaps, 0.5))
    record.itl_p99_ms = _ms(percentile(gaps, 0.99))
    record.itl_max_ms = _ms(max(gaps)) if gaps else None
    return "".join(parts), gaps


def conversation_id(mode: str, repeat: int, agent: int, nonce: str) -> str:
    """An ``ids`` mode's conversation id: unique per run, printable ASCII."""
    return f"fleet-{mode}-r{repeat}-a{agent}-{nonce}"


async def run_agent(plan: AgentPlan, mode: FleetMode, scenario: str, repeat: int,
                    client: kvturn.AsyncOpenAI, model: str, keepalive_interval: float,
                    t0: float, records: list[FleetTurn], gaps_ms: list[float], live: Live, *,
                    nonce: str, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                    clock: Callable[[], float] = time.perf_counter) -> AgentResult:
    """One agent's turns and tool gaps as ``mode``'s client sends them; a record per turn."""
    script = plan.script
    delay = script.start_s - (clock() - t0)
    if delay > 0:
        await sleep(delay)
    conversation = (client.conversation(keepalive_interval=keepalive_interval)
                    if mode.client == KVTURN else None)
    cid = (conversation.id if conversation is not None
           else conversation_id(mode.name, repeat, script.agent, nonce) if mode.client == IDS
           else None)
    headers = {HEADER_CONVERSATION_ID: cid} if mode.client == IDS and cid is not None else None
    target: Any = conversation if conversation is not None else client
    result = AgentResult(script.agent, cid)
    messages: list[Message] = [{"role": "system", "content": script.system}]
    try:
        for turn, message in enumerate(script.messages):
            messages.append(message)
            record = FleetTurn(
                scenario=scenario, mode=mode.name, repeat=repeat, agent=script.agent,
                turn=turn + 1, conversation_id=cid, started_s=round(clock() - t0, 4),
                message_words=script.message_words[turn], reply_tokens=plan.reply_tokens[turn],
                gap_after_s=script.gaps_s[turn] if turn < len(script.gaps_s) else None)
            records.append(record)
            live.in_turn += 1
            try:
                text, gaps = await stream_turn(target, model, messages,
                                               plan.reply_tokens[turn], clock, record, headers)
            except Exception as error:
                record.error = f"{type(error).__name__}: {error}"[:500]
                result.error = f"turn {turn + 1}: {record.error}"
                live.failed_turns += 1
                return result  # the conversation cannot go on without this turn's reply
            finally:
                live.in_turn -= 1
            gaps_ms.extend(gaps)
            if record.ttft_ms is not None:
                live.ttfts.append(record.ttft_ms)
            live.done_turns += 1
            result.turns_ok += 1
            # The reply exactly as received: the next prompt extends what the decode holds.
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
        return result
    finally:
        live.done_agents += 1
        if conversation is not None:
            await conversation.close()
            stats = conversation.stats
            result.sdk_stats = {
                "turns": stats.turns, "reused_tokens": stats.reused_tokens, "hits": stats.hits,
                "outcomes": dict(stats.outcomes), "retries": stats.retries,
                "keepalives": stats.keepalives, "keepalive_failures": stats.keepalive_failures,
                "release_failures": stats.release_failures}


# What the instances say.

@dataclass(frozen=True)
class Counters:
    """One instance's cumulative prompt-token counters (None: not readable)."""

    computed: float
    local_cache: float
    transferred: float
    reused: float
    """``kvturn:reused_tokens_total``: prompt tokens this instance read from a decode."""


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
        from kvturn_server.local._metrics import scrape

        out: dict[str, Any] = {}
        for instance, url in self.instances:
            try:
                out[instance] = scrape(url)
            except (OSError, ValueError):
                out[instance] = None
        return out

    def counters(self) -> Snapshot:
        from kvturn_server.local._metrics import total

        name = "vllm:prompt_tokens_by_source_total"
        return {instance: None if s is None else Counters(
            computed=total(s, name, source="local_compute"),
            local_cache=total(s, name, source="local_cache_hit"),
            transferred=total(s, name, source="external_kv_transfer"),
            reused=total(s, "kvturn:reused_tokens_total"))
            for instance, s in self._scrape_all().items()}

    def retained(self) -> dict[str, int | None]:
        from kvturn_server.local._direct import control

        out: dict[str, int | None] = {}
        for instance, url in self.decode_controls:
            try:
                status, stats = control(url, "GET", "/kvturn/v1/stats", timeout=5.0)
            except (OSError, ValueError):
                out[instance] = None
                continue
            retention = stats.get("retention") if status == 200 else None
            out[instance] = (int(retention["held_bytes"]) if isinstance(retention, dict)
                             and "held_bytes" in retention else None)
        return out

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


@dataclass
class Sample:
    t_s: float
    retained_bytes: dict[str, int | None]

    @property
    def total_retained(self) -> int | None:
        values = [v for v in self.retained_bytes.values() if v is not None]
        return sum(values) if values else None


class Sampler:
    """Every decode's retained bytes every ``interval`` seconds in a daemon thread, once at
    ``start()`` and once more at ``stop()`` (a run always has its first and last point)."""

    def __init__(self, probe: FleetProbe, interval: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.probe = probe
        self.interval = interval
        self.clock = clock
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = 0.0

    def sample(self) -> Sample:
        point = Sample(round(self.clock() - self.t0, 4), self.probe.retained())
        with self._lock:
            self.samples.append(point)
        return point

    def latest(self) -> Sample | None:
        with self._lock:
            return self.samples[-1] if self.samples else None

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.sample()
        self._thread = threading.Thread(target=self._run, name="kvturn-bench-fleet",
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
    agents: list[AgentResult]
    samples: list[Sample]
    itl_ms: list[float]
    before: Snapshot
    after: Snapshot
    turns_planned: int = 0
    router_args: tuple[str, ...] = ()
    load_before: tuple[float, ...] = ()
    load_after: tuple[float, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


def loadavg() -> tuple[float, ...]:
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        return ()


def _fmt(value: float | int | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


async def _progress(tag: str, live: Live, sampler: Sampler, t0: float, interval: float,
                    say: Callable[[str], None], clock: Callable[[], float]) -> None:
    while True:
        await asyncio.sleep(interval)
        latest = sampler.latest()
        held = None if latest is None else latest.total_retained
        say(f"[{tag}] {clock() - t0:6.1f} s: agents {live.done_agents}/{live.agents} done, "
            f"{live.in_turn} in a turn, {live.in_gap} in a tool gap; turns "
            f"{live.done_turns}/{live.turns}"
            + (f" ({live.failed_turns} failed)" if live.failed_turns else "")
            + f"; TTFT p50 so far {_fmt(percentile(live.ttfts, 0.5))} ms; decodes retain "
              f"{_fmt(None if held is None else held / MIB, '.1f')} MiB")


async def wait_released(probe: FleetProbe, timeout: float,
                        sleep: Callable[[float], Awaitable[None]],
                        clock: Callable[[], float]) -> int | None:
    """Wait (up to ``timeout``) until no decode retains anything, so that one run's leases do
    not show in the next run's samples; returns what they still hold in all."""
    deadline = clock() + timeout
    while True:
        values = [v for v in (await asyncio.to_thread(probe.retained)).values()
                  if v is not None]
        held = sum(values) if values else None
        if not held or clock() >= deadline:
            return held
        await sleep(0.25)


async def run_mode(mode: FleetMode, scenario: str, repeat: int, position: int,
                   plans: Sequence[AgentPlan], client: kvturn.AsyncOpenAI, model: str,
                   probe: FleetProbe, *, keepalive_interval: float, sample_interval: float,
                   progress_interval: float, settle_s: float, drain_timeout: float,
                   router_args: tuple[str, ...] = (), say: Callable[[str], None] = print,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                   clock: Callable[[], float] = time.perf_counter) -> ModeRun:
    """Every agent of ``plans``, concurrently, through ``client``; the sampler runs meanwhile.
    Before: the decodes' retentions drain and the machine settles for ``settle_s``."""
    held = await wait_released(probe, drain_timeout, sleep, clock)
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
    ticker = (asyncio.create_task(_progress(tag, live, sampler, t0, progress_interval, say,
                                            clock)) if progress_interval > 0 else None)
    try:
        agents = await asyncio.gather(*(
            run_agent(plan, mode, scenario, repeat, client, model, keepalive_interval, t0,
                      records, itl, live, nonce=nonce, sleep=sleep, clock=clock)
            for plan in plans))
    finally:
        if ticker is not None:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
    wall = clock() - t0
    samples = await asyncio.to_thread(sampler.stop)
    after = await asyncio.to_thread(probe.counters)
    records.sort(key=lambda r: (r.agent, r.turn))
    failed = [a for a in agents if a.error is not None]
    say(f"[{tag}] done in {wall:.1f} s: {live.done_turns}/{turns} turns, TTFT p50 "
        f"{_fmt(percentile(live.ttfts, 0.5))} ms"
        + (f"; {len(failed)} agents stopped early: {failed[0].error}" if failed else ""))
    return ModeRun(scenario=scenario, mode=mode.name, repeat=repeat, position=position,
                   wall_s=wall, records=records, agents=list(agents), samples=samples,
                   itl_ms=itl, before=before, after=after, turns_planned=turns,
                   router_args=router_args,
                   load_before=load_before, load_after=loadavg(),
                   extra={"retained_bytes_at_start": held})
