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
prompt tokens. The summaries, the comparison and its verdict are in ``_agent_report``; the
agent loop itself (shared with ``kvturn bench fleet``) in ``_agent_loop``: ``off`` runs its
``plain`` client, ``on`` its ``kvturn`` client.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvturn_server.bench import _agent_loop
from kvturn_server.bench._agent_cli import (
    add_output_args,
    bench_client,
    comma_choices,
    token_range,
    write_plot_and_say,
)
from kvturn_server.bench._agent_loop import KVTURN, PLAIN, Live, chunk_gaps_ms, progress
from kvturn_server.bench._agent_report import (
    AgentOutcome,
    ModeRun,
    Sample,
    TurnRecord,
    build_results,
    compare,
    summarize,
    table,
    write_plot,
)
from kvturn_server.bench._agent_workload import (
    DECODES,
    FRAMING_TOKENS,
    MIN_RETENTION_TTL_S,
    MODES,
    PREFILLS,
    PROFILE_TEXT,
    PROFILES,
    TRACE_KEEPALIVE_PER_TTL,
    TRACE_RETENTION_TTL_S,
    AgentBenchSettings,
    AgentScript,
    GapDistribution,
    Message,
    build_scripts,
    mode_order,
)
from kvturn_server.bench._host import describe_cpu, host_info
from kvturn_server.bench._sampling import PeriodicSampler, loadavg, retained_bytes, wait_released
from kvturn_server.bench._stats import distribution, percentile, write_json
from kvturn_server.local._metrics import PromptSources
from kvturn_server.local._progress import ProgressLine

if TYPE_CHECKING:
    import kvturn
    from kvturn_server.local._stack import StackConfig

# Re-exported: the names other benchmarks import from here (bench fleet reuses the workload).
__all__ = ["FRAMING_TOKENS", "MIN_RETENTION_TTL_S", "MODES", "TRACE_KEEPALIVE_PER_TTL",
           "TRACE_RETENTION_TTL_S", "AgentBenchSettings", "AgentOutcome", "AgentScript",
           "GapDistribution", "HttpProbe", "Message", "ModeRun", "Probe", "Sample", "Sampler",
           "TurnRecord", "add_agent_bench_parser", "agent_stack_config", "build_results",
           "build_scripts", "cmd_bench_agent", "compare", "distribution", "measure", "mode_order",
           "percentile", "run_agent", "run_agent_bench", "run_mode", "settings_from_args",
           "summarize", "table", "warm_up", "write_json", "write_plot"]


# One agent: the shared loop (``_agent_loop``) as the mode's client kind.

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

    return await _agent_loop.run_agent(
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


# The command line.

def settings_from_args(args: argparse.Namespace) -> AgentBenchSettings:
    return AgentBenchSettings(
        agents=args.agents, turns=args.turns, time_scale=args.time_scale, seed=args.seed,
        json_path=args.json, plot_path=args.plot, size=args.size, state_dir=args.state_dir,
        modes=args.modes, stagger_s=args.stagger, system_tokens=args.system_tokens,
        message_tokens=args.message_tokens, max_tokens=args.max_tokens, profile=args.profile,
        long_reply_tokens=args.long_reply_tokens, repeats=args.repeats,
        gap_cap_s=args.max_gap if args.max_gap > 0 else None,
        retention_ttl_s=args.retention_ttl, prefill_prefix_cache=args.prefill_prefix_cache,
        kv_cache_gib=args.kv_cache_gib, router_args=tuple(args.router_arg or ()))


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
        "agent", help="concurrent tool-using agents: TTFT, inter-token latency, prompt tokens "
                      "computed and retained memory, with and without kvturn conversations",
        description="Start 1 prefill + 1 decode + router (the prefill's prefix cache on by "
                    "default, as vLLM ships it), then run N concurrent agents of M turns each "
                    "(growing conversations, tool gaps drawn from a log-normal fitted to "
                    "production agent traces, scaled by --time-scale) in two modes: 'off' "
                    "without conversation ids (plain P/D), 'on' as kvturn conversations that "
                    "keep their lease during tool gaps; --repeats times, the order of the "
                    "modes rotated each repeat (off,on / on,off / ...), the same scripts in "
                    "every repeat with new words. Prints the configuration (prefix cache, "
                    "instances, reply profile, host CPU and AMX), then per mode the medians "
                    "over the repeats and their spread of TTFT p50/p90/p99 and turns 2+ p50, "
                    "inter-token latency p50/p99 (and time per output token), prompt "
                    "tokens computed by the prefill, by the decode and their sum, turns per "
                    "second, the decode's retained memory "
                    "and the router's per-turn reports; then the off/on ratios of every "
                    "repeat and whether kvturn was never slower. Writes every turn and sample "
                    "as JSON and a PNG plot. The default run (3 repeats) takes about 7 "
                    "minutes on a 2-core machine; --profile long several times that.")
    add_output_args(p)
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
    p.add_argument("--modes", type=comma_choices(MODES, "modes"), default=d.modes, metavar="off,on",
                   help="which modes to run, in this order in the first repeat; later repeats "
                        "rotate it (default: off,on)")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="how many times to run the modes, order rotated each time; the table "
                        "reports medians and min-max over them (default: %(default)s)")
    p.add_argument("--stagger", type=float, default=d.stagger_s,
                   help="seconds between two agents' starts (default: %(default)s)")
    p.add_argument("--system-tokens", type=int, default=d.system_tokens,
                   help="system prompt length (default: %(default)s)")
    p.add_argument("--message-tokens", type=token_range, default=d.message_tokens,
                   metavar="MIN,MAX",
                   help="size of each turn's new user/tool message (default: 100,300)")
    p.add_argument("--profile", choices=PROFILES, default=d.profile,
                   help="reply profile: " + "; ".join(f"{k}: {v}" for k, v in
                                                      PROFILE_TEXT.items())
                        + " (default: %(default)s). The local models never end a reply "
                          "early (their LM head only picks words), so replies are as long as "
                          "asked. Six long turns may not fit the tiny model's 8k context: "
                          "add --turns 5")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="every reply's length in the tool profile (default: %(default)s)")
    p.add_argument("--long-reply-tokens", type=token_range, default=d.long_reply_tokens,
                   metavar="MIN,MAX",
                   help="the range each reply's length is drawn from in the long profile "
                        "(default: 300,1000)")
    p.add_argument("--max-gap", type=float, default=d.gap_cap_s,
                   help="cap on a tool gap in trace seconds, before scaling; 0: none "
                        "(default: %(default)s, the traces' p99)")
    p.add_argument("--retention-ttl", type=float, default=None,
                   help="the decode's lease in seconds (default: 480 x --time-scale, at least "
                        f"{MIN_RETENTION_TTL_S:g}); the SDK renews every eighth of it during a "
                        "tool gap")
    p.add_argument("--prefill-prefix-cache", action=argparse.BooleanOptionalAction,
                   default=d.prefill_prefix_cache,
                   help="the prefill's own prefix cache: on by default, as vLLM ships it and "
                        "users run it; --no-prefill-prefix-cache stands for a prefill pool "
                        "where a conversation's next turn does not find its prefix locally")
    p.add_argument("--kv-cache-gib", type=float, default=d.kv_cache_gib,
                   help="KV cache per vLLM instance in GiB (default: %(default)s)")
    p.add_argument("--router-arg", action="append", default=None, metavar="ARG",
                   help="one more `kvturn router` argument (repeatable; both modes run on that "
                        "router), e.g. --router-arg=--decode-continue-tokens=256")
    p.set_defaults(func=cmd_bench_agent)
    return p

