"""``kvturn bench agent``: N concurrent tool-using agents x M turns through the router, with
retention ("on") and without ("off"), repeated with the order of the modes rotated.

Each agent is a conversation that grows turn by turn: a long system prompt, then per turn one
new message (the task as a ``user`` message first, ``tool`` results after) and the model's
streamed reply. Between two turns the agent "runs a tool" for a gap drawn from a log-normal
fitted to production agent traces (Claude Code: p50 2 s, p90 24 s), times ``time_scale`` so that
a run takes minutes on a small machine. Replies follow a profile: ``tool`` (every reply
``max_tokens`` long, 64 by default) or ``long`` (answers or code, 300-1000 tokens drawn per
turn).

- **on**: each agent is a ``kvturn`` conversation (``client.conversation()``); during a gap it
  holds ``pause("tool")``, so the SDK renews the lease, and it releases the retention at the
  end. The router pins the decode's retained KV and the prefill reads it back.
- **off**: the same requests without a conversation id: the router neither pins nor retains
  (plain prefill/decode disaggregation).

The baseline is what users run: the prefill's prefix cache is on by default (vLLM's default;
``--no-prefill-prefix-cache`` stands for a prefill pool where the next turn lands elsewhere).
Both modes run the same scripts (sizes, gaps, reply lengths, start offsets; the words differ
per mode and per repeat so that no cache carries over) on the same stack, one mode after the
other (``ORDER_RATIONALE``), ``repeats`` times with the order rotated (off,on / on,off / ...).
A short warm-up conversation (NIXL handshakes, first-request costs) runs before the first
repeat, and the load average is recorded around each mode.

Recorded per turn: prompt tokens (``usage``), TTFT (request start to the first content chunk),
the gaps between later content chunks (inter-token latency as the client sees it), total time,
the router's ``X-KVTurn-Reuse`` / ``X-KVTurn-Reused-Tokens`` and, where the router sends them,
``X-KVTurn-Route`` / ``X-KVTurn-Prefill-Choice``. Per mode: both instances' computed prompt
tokens (``vllm:prompt_tokens_by_source_total{source="local_compute"}``) before and after.
Sampled every ``sample_interval`` seconds in a background thread: the decode's retained bytes
(control endpoint ``/kvturn/v1/stats``, ``retention.held_bytes``) and the prefill's computed
prompt tokens. The records are in ``_records``, the summaries, the comparison and its verdict
in ``_summary``, the table in ``_report``, the plot in ``_plot``, the command line in ``_cli``;
the agent loop itself (shared with ``kvturn bench fleet``) in ``_loop``: ``off`` runs its
``plain`` client, ``on`` its ``kvturn`` client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from kvturn_server._cli_common import write_json
from kvturn_server.bench._cli import bench_client, write_plot_and_say
from kvturn_server.bench._host import describe_cpu, host_info
from kvturn_server.bench._sampling import PeriodicSampler, loadavg, retained_bytes, wait_released
from kvturn_server.bench.agent._loop import KVTURN, PLAIN, Live, chunk_gaps_ms, progress
from kvturn_server.bench.agent._loop import run_agent as run_as_client
from kvturn_server.bench.agent._plot import write_plot
from kvturn_server.bench.agent._records import AgentOutcome, ModeRun, Sample, TurnRecord
from kvturn_server.bench.agent._report import table
from kvturn_server.bench.agent._summary import build_results
from kvturn_server.bench.agent._workload import (
    DECODES,
    PREFILLS,
    AgentBenchSettings,
    AgentScript,
    build_scripts,
    mode_order,
)
from kvturn_server.local._metrics import PromptSources
from kvturn_server.local._progress import ProgressLine

if TYPE_CHECKING:
    import kvturn
    from kvturn_server.local._stack import StackConfig

# One agent: the shared loop (``_loop``) as the mode's client kind.

CLIENTS = {"off": PLAIN, "on": KVTURN}
"""Each mode's client: ``off`` sends no conversation id, ``on`` is a kvturn conversation."""


def _timed(record: TurnRecord, chunks: list[float], info: kvturn.TurnInfo | None) -> None:
    record.content_chunks = len(chunks)
    record.itl_gaps_ms = [round(gap, 3) for gap in chunk_gaps_ms(chunks)]
    if info is not None:
        record.no_reuse_reason = info.no_reuse_reason


async def run_agent(script: AgentScript, client: kvturn.AsyncOpenAI, model: str,
                    settings: AgentBenchSettings, t0: float, records: list[TurnRecord],
                    live: Live, *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                    clock: Callable[[], float] = time.perf_counter) -> AgentOutcome:
    """One agent's turns (and tool gaps) in ``script.mode``; a record per turn."""

    def new_record(turn: int, conversation_id: str | None, started_s: float) -> TurnRecord:
        return TurnRecord(
            mode=script.mode, agent=script.agent, turn=turn + 1,
            conversation_id=conversation_id, started_s=started_s,
            message_role=script.messages[turn]["role"],
            message_words=script.message_words[turn], gap_after_s=script.gap_after(turn),
            repeat=script.repeat, max_tokens=script.reply_tokens[turn])

    return await run_as_client(
        script, CLIENTS[script.mode], client, model, t0=t0, live=live, records=records,
        new_record=new_record, timed=_timed, keepalive_interval=settings.keepalive_interval,
        sleep=sleep, clock=clock)


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
        return retained_bytes(self.decode_control_url)

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


# Running the modes.

def _tag(mode: str, repeat: int, repeats: int) -> str:
    return f"[{mode} {repeat + 1}/{repeats}]"


async def run_mode(mode: str, settings: AgentBenchSettings, client: kvturn.AsyncOpenAI,
                   model: str, probe: Probe, *, repeat: int = 0,
                   say: Callable[[str], None] = print,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                   clock: Callable[[], float] = time.perf_counter) -> ModeRun:
    """All agents of one mode in one repeat, concurrently; the sampler runs meanwhile."""
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
    say(f"{tag} {settings.agents} agents x {settings.turns} turns, starting "
        f"{settings.stagger_s:g} s apart"
        + ("; each a kvturn conversation, paused during tool gaps" if mode == "on"
           else "; no conversation ids (plain P/D)"))

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
                    stagger_s=0.0, modes=("on",), profile="tool",
                    max_tokens=min(settings.max_tokens, 64))
    script = build_scripts(small, "warm-up")[0]
    script = replace(script, mode="on", gaps_s=(0.0,))
    records: list[TurnRecord] = []
    outcome = await run_agent(script, client, model, small, clock(), records,
                              Live(1, 2), sleep=lambda s: asyncio.sleep(0), clock=clock)
    if outcome.error is not None:
        raise RuntimeError(f"the warm-up conversation failed: {outcome.error}")
    return [r.ttft_ms for r in records if r.ttft_ms is not None]


async def measure(settings: AgentBenchSettings, client: kvturn.AsyncOpenAI, model: str,
                  probe: Probe, *, say: Callable[[str], None] = print,
                  sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                  clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Warm up, then ``settings.repeats`` times every mode, in ``settings.modes`` order
    rotated by the repeat (``mode_order``); the results document."""
    load_start = loadavg()
    warm = await warm_up(client, model, settings, clock) if settings.warmup else []
    runs = []
    for repeat in range(settings.repeats):
        for mode in mode_order(settings.modes, repeat):
            runs.append(await run_mode(mode, settings, client, model, probe, repeat=repeat,
                                       say=say, sleep=sleep, clock=clock))
    held: dict[str, list[int | None]] = {}
    for run in runs:
        held.setdefault(run.mode, []).append(run.extra.get("retained_bytes_at_start"))
    extra = {"warmup_ttft_ms": warm,
             "load_average": {"start": list(load_start), "end": list(loadavg())},
             "retained_bytes_at_mode_start": held}
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
        with_reference=False, router_args=settings.router_args)
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
    from kvturn_server.local._model import SIZES
    from kvturn_server.local._stack import Stack

    settings.check_fits(SIZES[settings.size].max_positions)
    cfg = agent_stack_config(settings, _free_ports())
    gaps = settings.gaps
    say(f"tool gaps: log-normal, p50 {gaps.quantile(0.5):.2f} s, p90 {gaps.quantile(0.9):.2f} s,"
        f" p99 {gaps.quantile(0.99):.2f} s (trace x{settings.time_scale:g}); lease "
        f"{settings.retention_ttl:g} s, keepalive every {settings.keepalive_interval:g} s")
    orders = " / ".join(",".join(mode_order(settings.modes, r)) for r in range(settings.repeats))
    say(f"configuration: prefill prefix cache "
        f"{'ON (vLLM default)' if settings.prefill_prefix_cache else 'OFF'}; {PREFILLS} prefill "
        f"+ {DECODES} decode + router; replies: {settings.reply_text()}; {settings.repeats} "
        f"repeat(s), order {orders}; host: {describe_cpu(host_info())}"
        + (f"; router {' '.join(settings.router_args)}" if settings.router_args else ""))
    say(f"starting the benchmark stack ({settings.size} model)")
    with Stack(cfg, die_with_parent=True) as stack:
        stack.start(progress=ProgressLine())
        probe = HttpProbe(cfg.prefill_url, cfg.decode_url, cfg.decode_control_url)

        async def main() -> dict[str, Any]:
            client = bench_client(cfg.router_url, settings.request_timeout_s,
                                  settings.max_retries)
            try:
                return await measure(settings, client, cfg.served_model_name, probe, say=say)
            finally:
                await client.close()

        results = asyncio.run(main())
        results["stack"] = {"model": settings.size, "served_model_name": cfg.served_model_name,
                            "max_model_len": cfg.max_model_len,
                            "kv_cache_gib": cfg.kv_cache_gib,
                            "prefill_prefix_caching": cfg.prefill_prefix_caching,
                            "prefills": PREFILLS, "decodes": DECODES,
                            "decoder_kv_blocks_ttl": cfg.decoder_kv_blocks_ttl,
                            "retention_budget": cfg.retention_budget,
                            "startup_s": stack.startup_seconds}
    say(table(results))
    if settings.json_path is not None:
        write_json(results, settings.json_path)
        write_plot_and_say(results, settings.json_path, settings.plot_path, write_plot, say)
    return results
