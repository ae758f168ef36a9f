"""``kvturn bench fleet``: several prefills and decodes, prefix caching on everywhere, concurrent
tool-using agents, and several ways to run them, side by side in one run.

The modes (``MODE_TABLE`` in ``_fleet_plan.py``: the router's flags and what the client sends):

- ``stock-rr``: stock P/D (``--no-kv-reuse``) without conversation ids, prefill chosen
  round-robin: vLLM's example disaggregation proxy.
- ``stock-affinity``: stock P/D with session affinity to a prefill (the client sends
  ``X-Conversation-ID``; the router uses it for placement only): what Dynamo, llm-d and
  production-stack offer.
- ``stock-cond`` (and ``stock-cond-2k`` on request): stock conditional disaggregation
  (``--no-kv-reuse --conditional-disagg 512``, or 2048): a short follow-up runs on the decode
  that served the conversation, alone, on its plain prefix cache (llm-d's
  prefix-based-pd-decider, NVIDIA Dynamo's conditional disaggregation); the client sends
  ``X-Conversation-ID``.
- ``stock-cond-offload`` (on request): stock-cond on instances with vLLM's CPU KV offloading, a
  host tier on every instance (llm-d's P2P KV sharing / CPU offloading tier, LMCache).
- ``kvturn-ll``: kvturn conversations (the SDK, paused during tool gaps), least-loaded prefill.
- ``kvturn-kv``: kvturn conversations with the router's defaults (kv-aware placement).
- ``kvturn-offload`` (on request): kvturn-kv on the offloading instances.

Modes that need other instance settings run on instances of their own (``bench/_profiles.py``:
the offload modes on a second fleet of the same shape, started after the first and kept up
beside it), so that every mode still runs in rotated order on warm instances.

A scenario is a reply profile (``tool``: 64-token replies; ``long``: 300-1000) on a KV sizing
(``tight``: each prefill's cache holds a few of the active conversations, set with vLLM's
``--num-gpu-blocks-override``; ``roomy``: it holds all of them). Each scenario gets a fresh
fleet, a warm-up conversation on every prefill/decode pair, then ``repeats`` rounds of every
mode (same seed, other words, order rotated), each run through a router started for it.

Measured per run: TTFT p50/p90/p99, inter-token latency p50/p99 (gaps between streamed content
chunks), prompt tokens computed (``vllm:prompt_tokens_by_source_total{source="local_compute"}``
summed over every instance, and per instance), tokens the prefills read from decodes
(``kvturn:reused_tokens_total``, and the ``X-KVTurn-Reused-Tokens`` headers), tokens loaded from
a host tier (``vllm:prompt_tokens_cached_by_source_total{source="host"}``), the decodes'
retained memory (``/kvturn/v1/stats``), turns per second; the routers' ``X-KVTurn-Route`` and
``X-KVTurn-Prefill-Choice`` per turn. Reported per mode as the median and range over repeats,
and each kvturn mode against the strongest stock mode (the lowest TTFT p50 of turns 2+, the rule
of every agent benchmark) and against every stock mode that ran.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any, Protocol

from kvturn_server._cli_common import (
    add_device_args,
    comma_choices,
    int_range,
    settings_or_exit,
    write_json,
)
from kvturn_server.bench._cli import (
    add_agents_args,
    add_host_tier_arg,
    bench_client,
    say_results,
)
from kvturn_server.bench._fleet_agents import (
    FleetProbe,
    FleetTurn,
    HttpFleetProbe,
    ModeRun,
    run_agent,
    run_mode,
)
from kvturn_server.bench._fleet_plan import (
    KVTURN,
    MODE_TABLE,
    MODES,
    PROFILES,
    SIZINGS,
    AgentPlan,
    FleetBenchSettings,
    FleetMode,
    Scenario,
    run_order,
    scenarios,
)
from kvturn_server.bench._fleet_report import build_results, scenario_result, table, write_plot
from kvturn_server.bench._profiles import CPU_BLOCK_SIZE, ProfileFleets
from kvturn_server.bench._sampling import loadavg
from kvturn_server.bench.agent._kinds import PROMPT_DETAILS_ARGS
from kvturn_server.bench.agent._loop import Live
from kvturn_server.bench.agent._records import AgentOutcome
from kvturn_server.bench.agent._workload import AgentBenchSettings, GapDistribution, build_scripts
from kvturn_server.local import ProgressLine

if TYPE_CHECKING:
    import kvturn
    from kvturn_server.local import Fleet

WARM_UP = FleetMode("warm-up", (), KVTURN, "warm-up conversation (not counted)")


def fleet_config(settings: FleetBenchSettings, scenario: Scenario) -> Any:
    """The fleet of one scenario: its context, its prefills' blocks, the scaled lease."""
    from kvturn_server.local import FleetConfig

    slug = scenario.name.replace("/", "-")
    return FleetConfig(
        state_dir=settings.state_dir / slug,
        model_dir=settings.state_dir / "models" / settings.size,
        prefills=settings.prefills, decodes=settings.decodes, model_size=settings.size,
        kv_cache_gib=settings.kv_cache_gib, max_model_len=scenario.max_model_len,
        prefill_prefix_caching=True, prefill_num_blocks=scenario.prefill_num_blocks,
        decoder_kv_blocks_ttl=settings.retention_ttl,
        # On a GPU vLLM's default (the accelerator's memory): the connector refuses a host
        # buffer there (docs/connector.md).
        kv_buffer_device=None if settings.gpu else "cpu",
        extra_vllm_args=(*PROMPT_DETAILS_ARGS, *settings.vllm_args))


class ClientSettings(Protocol):
    """What the warm-up reads of a benchmark's settings (the fleet's, the trace bench's)."""

    @property
    def seed(self) -> int: ...

    @property
    def request_timeout_s(self) -> float: ...

    @property
    def max_retries(self) -> int: ...


def _client(url: str, settings: ClientSettings) -> kvturn.AsyncOpenAI:
    return bench_client(url, settings.request_timeout_s, settings.max_retries)


def warm_up_plan(settings: ClientSettings) -> AgentPlan:
    """A two-turn conversation long enough that its second turn reads from the decode."""
    small = AgentBenchSettings(agents=1, turns=2, system_tokens=600, message_tokens=(50, 50),
                               stagger_s=0.0, seed=settings.seed)
    script = replace(build_scripts(small, "fleet-warm-up")[0], mode=WARM_UP.name,
                     gaps_s=(0.0,))
    return AgentPlan(script, (8, 8))


async def _warm_pair(url: str, plan: AgentPlan, settings: ClientSettings,
                     model: str) -> tuple[AgentOutcome, list[FleetTurn]]:
    records: list[FleetTurn] = []
    client = _client(url, settings)
    try:
        result = await run_agent(plan, WARM_UP, "warm-up", 0, client, model, 60.0,
                                 time.perf_counter(), records, [], Live(1, 2), nonce="warmup")
    finally:
        await client.close()
    return result, records


def warm_up(fleet: Fleet, settings: ClientSettings, say: Callable[[str], None],
            label: str = "") -> dict[str, Any]:
    """One kvturn conversation on every prefill/decode pair, each through a router of its own
    that knows only that pair: NIXL handshakes both ways and first-request costs, before any
    measured run. Returns each pair's TTFTs (ms), not counted anywhere else; ``label`` starts
    the line that says so."""
    args = ("--decode-continue-tokens", "0")
    out: dict[str, Any] = {}
    plan = warm_up_plan(settings)
    for p in fleet.prefills:
        for d in fleet.decodes:
            name = f"warmup-{p.name}-{d.name}"
            router = fleet.start_router(name, args, prefills=[p], decodes=[d])
            try:
                result, records = asyncio.run(_warm_pair(router.url, plan, settings,
                                                         fleet.config.model_name))
            finally:
                fleet.stop_router(name)
            if result.error is not None:
                raise RuntimeError(f"the warm-up conversation on {p.name}/{d.name} failed: "
                                   f"{result.error} (logs: {fleet.config.state_dir / 'logs'})")
            out[f"{p.name}/{d.name}"] = [r.ttft_ms for r in records]
    say(f"{label}warm-up done: " + "; ".join(f"{k} TTFT {v} ms" for k, v in out.items()))
    return out


class RunSettings(ClientSettings, Protocol):
    """What one run reads of a benchmark's settings (the fleet's, the trace bench's)."""

    @property
    def keepalive_interval(self) -> float: ...

    @property
    def sample_interval_s(self) -> float: ...

    @property
    def progress_interval_s(self) -> float: ...

    @property
    def settle_s(self) -> float: ...

    @property
    def drain_timeout_s(self) -> float: ...


def run_on_router(fleet: Fleet, mode: FleetMode, args: tuple[str, ...], scenario: str,
                  repeat: int, position: int, plans: list[AgentPlan], probe: FleetProbe,
                  settings: RunSettings, say: Callable[[str], None], table: str) -> ModeRun:
    """One run: a router started for it on every instance with ``args``, every plan sent
    through it as ``mode``'s client (``run_mode``), the router stopped. ``table``: the module
    whose mode table gave the flags, named where the router does not start."""
    from kvturn_server.local import StackError

    try:
        router = fleet.start_router(f"router-{mode.name}-r{repeat}", args)
    except StackError as error:
        raise StackError(f"{error}\n(the {mode.name} mode starts its router with "
                         f"{' '.join(args) or 'no flags'}; see MODE_TABLE in {table})") from error

    async def main() -> ModeRun:
        client = _client(router.url, settings)
        try:
            return await run_mode(
                mode, scenario, repeat, position, plans, client, fleet.config.model_name, probe,
                keepalive_interval=settings.keepalive_interval,
                sample_interval=settings.sample_interval_s,
                progress_interval=settings.progress_interval_s, settle_s=settings.settle_s,
                drain_timeout=settings.drain_timeout_s, router_args=args, say=say)
        finally:
            await client.close()

    try:
        run = asyncio.run(main())
    finally:
        fleet.stop_router(router.name)
    run.extra["router_startup_s"] = round(router.startup_s, 3)
    return run


def _instance_blocks(info: dict[str, dict[str, Any] | None]) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for name, labels in info.items():
        try:
            out[name] = int(labels["num_gpu_blocks"]) if labels else None
        except (KeyError, ValueError, TypeError):
            out[name] = None
    return out


def run_scenario(scenario: Scenario, settings: FleetBenchSettings, counter: list[int],
                 total_runs: int, say: Callable[[str], None]) -> tuple[dict[str, Any],
                                                                       list[ModeRun]]:
    """Start the scenario's fleet (one per instance profile the modes use, side by side), warm
    each up, run every repeat of every mode on its profile's fleet, stop them."""
    cfg = fleet_config(settings, scenario)
    say(f"[{scenario.name}] {cfg.prefills} prefill(s) + {cfg.decodes} decode(s) per instance "
        f"profile ({cfg.model_size} model, max_model_len {cfg.context}, prefill blocks "
        f"{cfg.prefill_num_blocks or 'from --kv-cache-gib'})")
    runs: list[ModeRun] = []
    profiles = [MODES[m].profile for m in settings.modes]
    with ProfileFleets(cfg, profiles, settings.host_tier_multiple) as fleets:
        fleets.start(progress=ProgressLine, say=lambda line: say(f"[{scenario.name}] {line}"))
        probes = {p: HttpFleetProbe([(i.name, i.url) for i in fleet.instances],
                                    [(d.name, d.control_url) for d in fleet.decodes])
                  for p, fleet in fleets.fleets.items()}
        first = next(iter(fleets.fleets))
        fleet = fleets.fleets[first]
        info = probes[first].cache_info()
        blocks = _instance_blocks(info)
        block_size = next((int(v["block_size"]) for v in info.values()
                           if v and "block_size" in v), CPU_BLOCK_SIZE)
        prefill_blocks = blocks.get(fleet.prefills[0].name) or cfg.prefill_num_blocks or 0
        kv = scenario.kv_statement(prefill_blocks, block_size)
        say(f"[{scenario.name}] each prefill holds {kv['conversations_a_prefill_holds']:g} "
            f"conversations of {kv['active_per_prefill']:g} active per prefill; stands for "
            f"{kv['stands_for']}")
        warm = {p: warm_up(f, settings, say, f"{p} instances: ")
                for p, f in fleets.fleets.items()} if settings.warmup else {}
        order = run_order(settings)
        for repeat, modes in order:
            for position, mode_name in enumerate(modes):
                counter[0] += 1
                mode = MODES[mode_name]
                args = settings.router_args(mode_name)
                say(f"run {counter[0]}/{total_runs}: {scenario.name} repeat {repeat} "
                    f"{mode_name} (router {' '.join(args) or 'defaults'}; {mode.profile} "
                    "instances)")
                runs.append(run_on_router(
                    fleets.fleets[mode.profile], mode, args, scenario.name, repeat, position,
                    scenario.agents(mode_name, repeat), probes[mode.profile], settings, say,
                    "kvturn_server/bench/_fleet_plan.py"))
        doc = scenario_result(
            scenario.name, asdict(scenario.profile), scenario.sizing, kv,
            {**cfg.describe(), "startup_s": fleet.startup_seconds,
             "profiles": fleets.describe()},
            [list(m) for _, m in order], runs,
            extra={"instance_blocks": blocks, "cache_info": info,
                   "warmup_ttft_ms": warm.get(first, {}), "warmup_ttft_ms_by_profile": warm})
    return doc, runs


def run_fleet_bench(settings: FleetBenchSettings,
                    say: Callable[[str], None] = print) -> dict[str, Any]:
    """Every scenario, one fresh fleet each; print the table, write the JSON (after every
    scenario, so a late failure keeps the earlier ones) and the plot."""
    plans = scenarios(settings)
    gaps = GapDistribution(time_scale=settings.time_scale)
    total_runs = len(plans) * settings.repeats * len(settings.modes)
    say(f"kvturn bench fleet: {len(plans)} scenario(s) ({', '.join(s.name for s in plans)}) x "
        f"{settings.repeats} repeats x {len(settings.modes)} modes = {total_runs} runs; tool "
        f"gaps p50 {gaps.quantile(0.5):.2f} s, p90 {gaps.quantile(0.9):.2f} s; lease "
        f"{settings.retention_ttl:g} s")
    load_start = loadavg()
    counter = [0]
    docs: list[dict[str, Any]] = []
    all_runs: list[ModeRun] = []
    results: dict[str, Any] = {}
    for scenario in plans:
        doc, runs = run_scenario(scenario, settings, counter, total_runs, say)
        docs.append(doc)
        all_runs.extend(runs)
        results = build_results(settings, docs, all_runs, {
            "gaps": gaps.describe(),
            "load_average": {"start": list(load_start), "end": list(loadavg())}})
        if settings.json_path is not None:
            write_json(results, settings.json_path)
    say_results(results, table, settings.json_path, settings.plot_path, write_plot, say)
    return results


# The command line.

def settings_from_args(args: argparse.Namespace) -> FleetBenchSettings:
    return FleetBenchSettings(
        prefills=args.prefills, decodes=args.decodes, modes=args.modes,
        profiles=args.profiles, sizings=args.kv, repeats=args.repeats, agents=args.agents,
        turns=args.turns, system_tokens=args.system_tokens,
        message_tokens=args.message_tokens, prefill_holds=args.prefill_holds,
        time_scale=args.time_scale, seed=args.seed, stagger_s=args.stagger, size=args.size,
        state_dir=args.state_dir, kv_cache_gib=args.kv_cache_gib,
        retention_ttl_s=args.retention_ttl,
        decode_continue_tokens=args.decode_continue_tokens, gpu=args.gpu,
        vllm_args=tuple(args.vllm_arg or ()), host_tier_multiple=args.host_tier,
        json_path=args.json, plot_path=args.plot)


def cmd_bench_fleet(args: argparse.Namespace) -> int:
    def checked() -> FleetBenchSettings:
        settings = settings_from_args(args)
        scenarios(settings)  # every scenario fits the model's context
        return settings

    settings = settings_or_exit("bench fleet", checked)
    # Flushed: a run takes many minutes and is often followed in a log file.
    run_fleet_bench(settings, say=functools.partial(print, flush=True))
    return 0


def add_fleet_bench_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Add ``fleet`` to ``kvturn bench``'s subcommands (sets ``func``)."""
    d = FleetBenchSettings()
    modes = "; ".join(f"{m.name}: {m.stands_for} (router "
                      f"{' '.join(m.router_args) or 'with no flags'}; {m.profile} instances"
                      f"{'' if m.by_default else '; on request'})" for m in MODE_TABLE)
    p: argparse.ArgumentParser = bench_subparsers.add_parser(
        "fleet", help="several prefills and decodes, prefix caching on: stock P/D "
                      "(round-robin, session affinity) and stock conditional disaggregation "
                      "against kvturn (least-loaded, kv-aware)",
        description="Start N prefills + M decodes on 127.0.0.1 (prefix caching on everywhere) "
                    "and run concurrent tool-using agents (tool gaps from production traces, "
                    "scaled by --time-scale) in each mode, each through a router of its own, "
                    "same seed, order rotated, --repeats times; modes on other instance "
                    "profiles (offload: vLLM's CPU KV offloading beside the kvturn connector, a "
                    "host tier of --host-tier times each instance's device KV) run on a fleet "
                    "of their own of the same shape, kept up beside the first. Modes: " + modes
                    + ". "
                    "Scenarios: every --profiles (tool: 64-token replies; long: 300-1000) on "
                    "every --kv sizing (tight: each prefill's KV cache holds --prefill-holds "
                    "conversations while many more are active; roomy: it holds all of them), a "
                    "fresh fleet each. Prints per mode TTFT p50/p90/p99, inter-token latency "
                    "p50/p99, prompt tokens computed (all instances), tokens read from decodes, "
                    "retained memory and turns/s (median and range over repeats) with the "
                    "configuration, tokens loaded from a host tier, and each kvturn mode "
                    "against the strongest stock mode (the lowest TTFT p50 of turns 2+, all "
                    "repeats pooled) and against every stock mode; writes JSON and a "
                    "PNG. The defaults (" + ",".join(d.modes) + "; tool and long on tight, 2 "
                    "repeats: 20 runs) take about 24 minutes on a 2-core machine; each "
                    "scenario adds about 9 (tool) or 12 (long) minutes per 2 repeats.")
    add_agents_args(p, d, seeded="sizes, gaps, reply lengths and words",
                    state="model, logs (per scenario) of the fleet")
    p.add_argument("--prefills", type=int, default=d.prefills,
                   help="prefill instances (default: %(default)s)")
    p.add_argument("--decodes", type=int, default=d.decodes,
                   help="decode instances (default: %(default)s)")
    p.add_argument("--modes", type=comma_choices(MODES, "modes"), default=d.modes,
                   metavar="MODE,...",
                   help=f"which modes, in this order for the first repeat (default: "
                        f"{','.join(d.modes)})")
    p.add_argument("--profiles", type=comma_choices(PROFILES, "profiles"), default=d.profiles,
                   metavar="tool,long",
                   help=f"reply profiles (default: {','.join(d.profiles)})")
    p.add_argument("--kv", type=comma_choices(SIZINGS, "KV sizings"), default=d.sizings,
                   metavar="tight,roomy",
                   help=f"prefill KV sizings (default: {','.join(d.sizings)})")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="rounds of every mode, the order rotated by one each round; as many as "
                        "modes puts every mode in every position (default: %(default)s)")
    p.add_argument("--turns", type=int, default=None,
                   help="turns per agent (default: the profile's, tool 6, long 4)")
    p.add_argument("--system-tokens", type=int, default=None,
                   help="system prompt length (default: the profile's, tool 2500, long 1500)")
    p.add_argument("--message-tokens", type=int_range, default=None, metavar="MIN,MAX",
                   help="each turn's new user/tool message (default: 100,300)")
    p.add_argument("--prefill-holds", type=float, default=d.prefill_holds,
                   help="tight sizing: how many average conversations each prefill's KV cache "
                        "holds (at least one longest request) (default: %(default)s)")
    p.add_argument("--kv-cache-gib", type=float, default=d.kv_cache_gib,
                   help="KV cache per vLLM instance in GiB where no block count is set: the "
                        "decodes, and the prefills when roomy (default: %(default)s)")
    p.add_argument("--decode-continue-tokens", type=int, default=None,
                   help="passed to the kvturn modes' routers (default: the router's, 2048; 0: "
                        "the decode never continues a turn itself)")
    add_host_tier_arg(p, d.host_tier_multiple)
    add_device_args(p, instances="every instance",
                    example="--gpu-memory-utilization=0.28 for three instances on one GPU")
    p.set_defaults(func=cmd_bench_fleet)
    return p
