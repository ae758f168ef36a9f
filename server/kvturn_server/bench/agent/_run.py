"""``kvturn bench agent``: N concurrent tool-using agents x M turns, in every mode of the mode
table (``_modes``: stock P/D, stock conditional disaggregation at two thresholds, kvturn), each
run through a router of its own over the same prefill and decode, repeated with the order of the
modes rotated.

Each agent is a conversation that grows turn by turn: a long system prompt, then per turn one
new message (the task as a ``user`` message first, ``tool`` results after) and the model's
streamed reply. Between two turns the agent "runs a tool" for a gap drawn from a log-normal
fitted to production agent traces (Claude Code: p50 2 s, p90 24 s), times ``time_scale`` so that
a run takes minutes on a small machine. Replies follow a profile: ``tool`` (every reply
``max_tokens`` long, 64 by default) or ``long`` (answers or code, 300-1000 tokens drawn per
turn).

- **off** (stock-pd): the requests without a conversation id through a ``--no-kv-reuse``
  router: plain prefill/decode disaggregation.
- **stock-cond**, **stock-cond-2k**: ``X-Conversation-ID`` only, through a ``--no-kv-reuse
  --conditional-disagg N`` router: a short follow-up runs on the decode alone, on whatever its
  plain prefix cache still holds.
- **on** (kvturn): each agent is a ``kvturn`` conversation (``client.conversation()``); during a
  gap it holds ``pause("tool")``, so the SDK renews the lease, and it releases the retention at
  the end.

The baseline is what users run: prefix caching is on on both instances (vLLM's default;
``--no-prefill-prefix-cache`` stands for a prefill pool where the next turn lands elsewhere),
and ``--decode-blocks`` makes the decode short of KV. Every mode runs the same scripts (sizes,
gaps, reply lengths, start offsets; the words differ per mode and per repeat so that no cache
carries over) on the same instances, one mode after the other (``ORDER_RATIONALE``),
``repeats`` times with the order rotated. A short warm-up conversation (NIXL handshakes, first-
request costs) runs before the first repeat, and the load average is recorded around each mode.

Recorded per turn: prompt tokens (``usage``) and the ones the serving instance's cache supplied
(``prompt_tokens_details.cached_tokens``: the instances run with
``--enable-prompt-tokens-details``), TTFT (request start to the first content chunk), the gaps
between later content chunks (inter-token latency as the client sees it), total time, the
router's ``X-KVTurn-Reuse`` / ``X-KVTurn-Reused-Tokens`` / ``X-KVTurn-Route`` /
``X-KVTurn-Prefill-Choice``. Per mode: both instances' computed prompt tokens
(``vllm:prompt_tokens_by_source_total{source="local_compute"}``) before and after. Sampled every
``sample_interval`` seconds in a background thread: the decode's retained bytes (control
endpoint ``/kvturn/v1/stats``, ``retention.held_bytes``) and the prefill's computed prompt
tokens. The records are in ``_records``, the summaries, the comparisons and their verdicts in
``_summary``, the table in ``_report``, the plot in ``_plot``, the command line in ``_cli``;
the agent loop itself (shared with ``kvturn bench fleet``) in ``_loop``, run as each mode's
client kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from kvturn_server._cli_common import write_json
from kvturn_server.bench._cli import bench_client, say_results
from kvturn_server.bench._host import describe_cpu, host_info
from kvturn_server.bench._profiles import (
    CPU_BLOCK_SIZE,
    ProfileFleets,
    describe_host_tier,
    needed,
)
from kvturn_server.bench._profiles import PLAIN as PLAIN_PROFILE
from kvturn_server.bench._sampling import PeriodicSampler, loadavg, retained_bytes, wait_released
from kvturn_server.bench.agent._kinds import IDS
from kvturn_server.bench.agent._loop import Live, chunk_gaps_ms, progress
from kvturn_server.bench.agent._loop import run_agent as run_as_client
from kvturn_server.bench.agent._modes import KVTURN_MODE, MODES_BY_NAME
from kvturn_server.bench.agent._plot import write_plot
from kvturn_server.bench.agent._records import AgentOutcome, ModeRun, Sample, TurnRecord
from kvturn_server.bench.agent._report import table
from kvturn_server.bench.agent._results import build_results
from kvturn_server.bench.agent._workload import (
    DECODES,
    PREFILLS,
    AgentBenchSettings,
    AgentScript,
    agent_fleet_config,
    build_scripts,
    instance_profiles,
    mode_order,
)
from kvturn_server.local import ProgressLine, PromptSources

if TYPE_CHECKING:
    import kvturn
    from kvturn_server.local import Fleet

# One agent: the shared loop (``_loop``) as the mode's client kind.

# The warm-up router reads the second turn into the prefill from the decode instead of
# continuing it there, so that NIXL connects both ways before any measured run.
WARM_UP_ROUTER_ARGS = ("--decode-continue-tokens", "0")


def _timed(record: TurnRecord, chunks: list[float], info: kvturn.TurnInfo | None) -> None:
    record.content_chunks = len(chunks)
    record.itl_gaps_ms = [round(gap, 3) for gap in chunk_gaps_ms(chunks)]
    if info is not None:
        record.no_reuse_reason = info.no_reuse_reason


def conversation_id(script: AgentScript) -> str:
    """The id an ``ids`` client sends (``X-Conversation-ID``): one per agent and run."""
    return f"bench-{script.mode}-r{script.repeat}-a{script.agent}"


async def run_agent(script: AgentScript, client: kvturn.AsyncOpenAI, model: str,
                    settings: AgentBenchSettings, t0: float, records: list[TurnRecord],
                    live: Live, *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                    clock: Callable[[], float] = time.perf_counter) -> AgentOutcome:
    """One agent's turns (and tool gaps) as ``script.mode``'s client; a record per turn."""
    kind = MODES_BY_NAME[script.mode].client

    def new_record(turn: int, conversation_id: str | None, started_s: float) -> TurnRecord:
        return TurnRecord(
            mode=script.mode, agent=script.agent, turn=turn + 1,
            conversation_id=conversation_id, started_s=started_s,
            message_role=script.messages[turn]["role"],
            message_words=script.message_words[turn], gap_after_s=script.gap_after(turn),
            repeat=script.repeat, max_tokens=script.reply_tokens[turn])

    return await run_as_client(
        script, kind, client, model, t0=t0, live=live, records=records,
        new_record=new_record, timed=_timed, keepalive_interval=settings.keepalive_interval,
        conversation_id=conversation_id(script) if kind == IDS else None,
        sleep=sleep, clock=clock)


# What the instances say over time.

class Probe(Protocol):
    """Reads the instances' numbers; any of them may be unavailable (None)."""

    def retained_bytes(self) -> int | None: ...

    def prefill_sources(self) -> PromptSources | None: ...

    def decode_sources(self) -> PromptSources | None: ...

    def decode_block_size(self) -> int | None: ...


class HttpProbe:
    """The real instances: the decode's control endpoint and both instances' ``/metrics``."""

    def __init__(self, prefill_url: str, decode_url: str, decode_control_url: str) -> None:
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.decode_control_url = decode_control_url

    def retained_bytes(self) -> int | None:
        return retained_bytes(self.decode_control_url)

    @staticmethod
    def _sources(url: str) -> PromptSources | None:
        from kvturn_server.local import prompt_sources

        try:
            return prompt_sources(url)
        except (OSError, ValueError):
            return None

    def prefill_sources(self) -> PromptSources | None:
        return self._sources(self.prefill_url)

    def decode_sources(self) -> PromptSources | None:
        return self._sources(self.decode_url)

    def decode_block_size(self) -> int | None:
        """The decode's block size, as its ``vllm:cache_config_info`` states it."""
        from kvturn_server.local import scrape

        try:
            samples = scrape(self.decode_url)
        except (OSError, ValueError):
            return None
        for (name, labels), _ in samples.items():
            if name == "vllm:cache_config_info":
                size = dict(labels).get("block_size")
                return int(size) if size is not None and size.isdigit() else None
        return None


class Sampler(PeriodicSampler[Sample]):
    """The decode's retained bytes and the prefill's computed prompt tokens every ``interval``
    seconds in a daemon thread, once at ``start()`` and once more at ``stop()``."""

    def __init__(self, probe: Probe, mode: str, interval: float,
                 clock: Callable[[], float] = time.perf_counter, repeat: int = 0) -> None:
        super().__init__(interval, clock, name=f"kvturn-bench-{mode}")
        self.probe = probe
        self.mode = mode
        self.repeat = repeat

    def read(self) -> Sample:
        retained = self.probe.retained_bytes()
        sources = self.probe.prefill_sources()
        return Sample(self.mode, self.elapsed(), retained,
                      None if sources is None else sources.computed, self.repeat)


# The routers: one per run.

Connect = Callable[[str, tuple[str, ...]],
                   contextlib.AbstractAsyncContextManager["kvturn.AsyncOpenAI"]]
"""``connect(name, router flags)``: a client of a router started with those flags for one run,
named ``name`` (its log is ``logs/<name>.log``), stopped when the context ends."""


def router_args(mode: str, settings: AgentBenchSettings) -> tuple[str, ...]:
    """The flags ``mode``'s router is started with (beyond the backends and the lease): the
    mode table's, then ``--router-arg``'s."""
    return (*MODES_BY_NAME[mode].router_args, *settings.router_args)


class FleetRouters:
    """``Connect`` on a running fleet: ``Fleet.start_router`` for the run, then a client."""

    def __init__(self, fleet: Fleet, settings: AgentBenchSettings) -> None:
        self.fleet = fleet
        self.settings = settings
        self.startup_s: dict[str, float] = {}

    @contextlib.asynccontextmanager
    async def __call__(self, name: str, args: tuple[str, ...]) -> AsyncIterator[
            kvturn.AsyncOpenAI]:
        router = await asyncio.to_thread(self.fleet.start_router, name, args)
        self.startup_s[name] = round(router.startup_s, 3)
        client = bench_client(router.url, self.settings.request_timeout_s,
                              self.settings.max_retries)
        try:
            yield client
        finally:
            await client.close()
            await asyncio.to_thread(self.fleet.stop_router, name)


# Running the modes.

def _tag(mode: str, repeat: int, repeats: int) -> str:
    return f"[{mode} {repeat + 1}/{repeats}]"


async def run_mode(mode: str, settings: AgentBenchSettings, client: kvturn.AsyncOpenAI,
                   model: str, probe: Probe, *, repeat: int = 0,
                   say: Callable[[str], None] = print,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                   clock: Callable[[], float] = time.perf_counter) -> ModeRun:
    """All agents of one mode in one repeat, concurrently, through ``client`` (the mode's
    router); the sampler runs meanwhile."""
    scripts = build_scripts(settings, mode, repeat)
    tag = _tag(mode, repeat, settings.repeats)
    held = await wait_released(probe.retained_bytes, 15.0, sleep, clock)
    live = Live(settings.agents, settings.agents * settings.turns)
    records: list[TurnRecord] = []
    load_before = loadavg()
    prefill_before, decode_before = await asyncio.to_thread(
        lambda: (probe.prefill_sources(), probe.decode_sources()))
    sampler = Sampler(probe, mode, settings.sample_interval_s, clock, repeat)
    t0 = clock()
    sampler.start(t0)
    table_mode = MODES_BY_NAME[mode]
    say(f"{tag} {settings.agents} agents x {settings.turns} turns, starting "
        f"{settings.stagger_s:g} s apart; {table_mode.label}, router "
        f"{' '.join(router_args(mode, settings)) or '(defaults)'}, client {table_mode.client}, "
        f"{table_mode.profile} instances")

    def held_now() -> int | None:
        latest = sampler.latest()
        return None if latest is None else latest.retained_bytes

    async with progress(tag, live, held_now, "decode retains", t0,
                        settings.progress_interval_s, say, clock):
        agents = await asyncio.gather(*(
            run_agent(script, client, model, settings, t0, records, live, sleep=sleep,
                      clock=clock) for script in scripts))
    wall = clock() - t0
    samples = await asyncio.to_thread(sampler.stop)
    prefill_after, decode_after = await asyncio.to_thread(
        lambda: (probe.prefill_sources(), probe.decode_sources()))
    records.sort(key=lambda r: (r.agent, r.turn))
    failed = [a for a in agents if a.error is not None]
    say(f"{tag} done in {wall:.1f} s: {live.done_turns}/{live.turns} turns"
        + (f"; {len(failed)} agents stopped early: {failed[0].error}" if failed else ""))
    return ModeRun(mode=mode, wall_s=wall, records=records, samples=samples, agents=agents,
                   prefill_before=prefill_before, prefill_after=prefill_after,
                   decode_before=decode_before, decode_after=decode_after,
                   load_before=load_before, load_after=loadavg(),
                   extra={"retained_bytes_at_start": held}, repeat=repeat)


async def warm_up(client: kvturn.AsyncOpenAI, model: str, settings: AgentBenchSettings,
                  clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """A short kvturn conversation before the first repeat (NIXL handshakes in both
    directions, first-request costs), with short replies whatever the profile; its TTFTs (ms)
    are returned, not counted."""
    small = replace(settings, agents=1, turns=2, system_tokens=min(settings.system_tokens, 300),
                    stagger_s=0.0, modes=(KVTURN_MODE,), profile="tool",
                    max_tokens=min(settings.max_tokens, 64))
    script = build_scripts(small, "warm-up")[0]
    script = replace(script, mode=KVTURN_MODE, gaps_s=(0.0,))
    records: list[TurnRecord] = []
    outcome = await run_agent(script, client, model, small, clock(), records,
                              Live(1, 2), sleep=lambda s: asyncio.sleep(0), clock=clock)
    if outcome.error is not None:
        raise RuntimeError(f"the warm-up conversation failed: {outcome.error}")
    return [r.ttft_ms for r in records if r.ttft_ms is not None]


async def measure(settings: AgentBenchSettings, connect: Connect | Mapping[str, Connect],
                  model: str, probe: Probe | Mapping[str, Probe], *,
                  say: Callable[[str], None] = print,
                  sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                  clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Warm up the instances of every profile the modes use, then ``settings.repeats`` times
    every mode, in ``settings.modes`` order rotated by the repeat (``mode_order``), each run
    through a router of its own (``connect``) on its profile's instances (``probe`` reads
    them; either may be one for every profile); the results document."""
    load_start = loadavg()
    profiles = needed(MODES_BY_NAME[m].profile for m in settings.modes)
    connects = connect if isinstance(connect, Mapping) else dict.fromkeys(profiles, connect)
    probes = probe if isinstance(probe, Mapping) else dict.fromkeys(profiles, probe)
    warm: dict[str, list[float]] = {}
    if settings.warmup:
        for profile in profiles:
            name = "router-warm-up" + ("" if profile == PLAIN_PROFILE else f"-{profile}")
            async with connects[profile](name, (
                    *settings.router_args, *WARM_UP_ROUTER_ARGS)) as client:
                warm[profile] = await warm_up(client, model, settings, clock)
    runs = []
    for repeat in range(settings.repeats):
        for mode in mode_order(settings.modes, repeat):
            profile = MODES_BY_NAME[mode].profile
            async with connects[profile](f"router-{mode}-r{repeat}",
                                         router_args(mode, settings)) as client:
                runs.append(await run_mode(mode, settings, client, model, probes[profile],
                                           repeat=repeat, say=say, sleep=sleep, clock=clock))
    held: dict[str, list[int | None]] = {}
    for run in runs:
        held.setdefault(run.mode, []).append(run.extra.get("retained_bytes_at_start"))
    block_size = await asyncio.to_thread(probes[profiles[0]].decode_block_size)
    extra = {"warmup_ttft_ms": warm.get(PLAIN_PROFILE, []),
             "warmup_ttft_ms_by_profile": warm,
             "load_average": {"start": list(load_start), "end": list(loadavg())},
             "retained_bytes_at_mode_start": held}
    return build_results(settings, runs, extra,
                         block_size=CPU_BLOCK_SIZE if block_size is None else block_size)


# The instances.

def run_agent_bench(settings: AgentBenchSettings,
                    say: Callable[[str], None] = print) -> dict[str, Any]:
    """Start the prefill and the decode of every instance profile the modes use, run the modes
    (a router each run, on its profile's instances), stop everything; print a table, write the
    JSON and the plot when their paths are set; return the results."""
    from kvturn_server.local import SIZES

    settings.check_fits(SIZES[settings.size].max_positions)
    cfg = agent_fleet_config(settings)
    gaps = settings.gaps
    say(f"tool gaps: log-normal, p50 {gaps.quantile(0.5):.2f} s, p90 {gaps.quantile(0.9):.2f} s,"
        f" p99 {gaps.quantile(0.99):.2f} s (trace x{settings.time_scale:g}); lease "
        f"{settings.retention_ttl:g} s, keepalive every {settings.keepalive_interval:g} s")
    orders = " / ".join(",".join(mode_order(settings.modes, r)) for r in range(settings.repeats))
    profiles = instance_profiles(settings)
    say(f"configuration: prefill prefix cache "
        f"{'ON (vLLM default)' if settings.prefill_prefix_cache else 'OFF'}; {PREFILLS} prefill "
        f"+ {DECODES} decode"
        + (f" of {settings.decode_blocks} KV blocks" if settings.decode_blocks else "")
        + (" per instance profile, side by side" if len(profiles) > 1 else "")
        + f" + a router per run; replies: {settings.reply_text()}; {settings.repeats} "
        f"repeat(s), order {orders}; host: {describe_cpu(host_info())}"
        + (f"; every router also {' '.join(settings.router_args)}" if settings.router_args
           else ""))
    for profile, entry in profiles.items():
        say(f"  {profile} instances ({', '.join(entry['modes'])}): "
            f"{describe_host_tier(entry['host_tier'])}")
    for mode in settings.modes:
        say(f"  {MODES_BY_NAME[mode].title}: router "
            f"{' '.join(router_args(mode, settings)) or '(defaults)'}; "
            f"{MODES_BY_NAME[mode].stands_for}")
    with ProfileFleets(cfg, profiles, settings.host_tier_multiple) as fleets:
        fleets.start(progress=ProgressLine, say=say)
        probes: dict[str, Probe] = {}
        routers: dict[str, FleetRouters] = {}
        for profile, fleet in fleets.fleets.items():
            prefill, decode = fleet.prefills[0], fleet.decodes[0]
            probes[profile] = HttpProbe(prefill.url, decode.url, decode.control_url)
            routers[profile] = FleetRouters(fleet, settings)
        results = asyncio.run(measure(settings, routers, cfg.model_name, probes, say=say))
        first = fleets.fleets[next(iter(fleets.fleets))]
        results["stack"] = {**cfg.describe(), "startup_s": first.startup_seconds,
                            "router_startup_s": {name: seconds for r in routers.values()
                                                 for name, seconds in r.startup_s.items()},
                            "profiles": fleets.describe()}
    if settings.json_path is not None:
        write_json(results, settings.json_path)
    say_results(results, table, settings.json_path, settings.plot_path, write_plot, say)
    return results
