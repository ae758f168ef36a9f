"""Running ``kvturn bench trace``: read and scale the traces, start the instances (a
``kvturn_server.local.Fleet`` per instance profile the modes use, ``bench/_profiles.py``: 1
prefill + 1 decode by default, each launched exactly as the local stack launches its own; the
offload modes' beside the plain ones, with a host tier), warm them up, then every repeat of
every mode through a router started for that run on its profile's instances, and write the
results.

One run is one mode with the instances to themselves (every counter read is instance-wide):
every conversation of the plan, concurrently, each as the mode's client kind sends it (the
agent benchmarks' loop, ``bench/agent/_loop.py``, through ``bench/_fleet_agents.run_mode``: the
same per-turn records, samplers and counters as ``kvturn bench fleet``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvturn_server._cli_common import write_json
from kvturn_server.bench._cli import say_results
from kvturn_server.bench._fleet import run_on_router, warm_up
from kvturn_server.bench._fleet_agents import HttpFleetProbe, ModeRun
from kvturn_server.bench._host import describe_cpu, host_info
from kvturn_server.bench._profiles import (
    CPU_BLOCK_SIZE,
    ProfileFleets,
    describe_host_tier,
    host_tier,
    needed,
    profile_config,
)
from kvturn_server.bench._sampling import loadavg
from kvturn_server.bench.trace._plan import (
    MODES,
    TraceBenchSettings,
    instance_blocks,
    kv_statement,
    max_model_len,
    run_order,
)
from kvturn_server.bench.trace._plot import write_plot
from kvturn_server.bench.trace._report import table
from kvturn_server.bench.trace._scale import ReplayPlan, plan_replay
from kvturn_server.bench.trace._summary import build_results
from kvturn_server.bench.trace._text import scripts
from kvturn_server.local import ProgressLine

if TYPE_CHECKING:
    from kvturn_server.local import FleetConfig

SCENARIO = "trace"


def load_plan(settings: TraceBenchSettings) -> ReplayPlan:
    """The traces read and scaled; raises ValueError where they cannot run on the model."""
    from kvturn_server.local import SIZES
    from kvturn_server.traces import read_traces

    if not settings.traces:
        raise ValueError("no trace given: name trace files or folders (e.g. "
                         "../shared/traces/claude-code)")
    plan = plan_replay(read_traces(settings.traces), settings.scaling)
    limit = SIZES[settings.size].max_positions
    if max_model_len(plan) > limit:
        raise ValueError(
            f"the longest request needs about {plan.context_tokens()} tokens at 1/"
            f"{settings.scaling.token_divisor:g}, more than the {settings.size} model's context "
            f"of {limit}: raise --token-divisor or lower --max-requests")
    return plan


def fleet_config(settings: TraceBenchSettings, plan: ReplayPlan) -> FleetConfig:
    from kvturn_server.local import FleetConfig

    blocks = instance_blocks(settings, plan)
    return FleetConfig(
        state_dir=settings.state_dir, model_dir=settings.state_dir / "models" / settings.size,
        prefills=settings.prefills, decodes=settings.decodes, model_size=settings.size,
        kv_cache_gib=settings.kv_cache_gib, max_model_len=max_model_len(plan),
        prefill_prefix_caching=True, prefill_num_blocks=blocks, decode_num_blocks=blocks,
        decoder_kv_blocks_ttl=settings.retention_ttl,
        kv_buffer_device=None if settings.gpu else "cpu", extra_vllm_args=settings.vllm_args)


def instance_profiles(settings: TraceBenchSettings, plan: ReplayPlan) -> dict[str, Any]:
    """Per instance profile the modes use: its modes and its host tier (None: none)."""
    base = fleet_config(settings, plan)
    return {p: {"modes": [m for m in settings.modes if MODES[m].profile == p],
                "host_tier": host_tier(profile_config(base, p, settings.host_tier_multiple),
                                       settings.host_tier_multiple)}
            for p in needed(MODES[m].profile for m in settings.modes)}


def configuration_line(settings: TraceBenchSettings, plan: ReplayPlan,
                       machine: dict[str, Any]) -> str:
    s = settings.scaling
    profiles = instance_profiles(settings, plan)
    return (f"configuration: {len(plan.conversations)} conversations, {plan.requests} requests "
            f"a run; tokens x1/{s.token_divisor:g}, gaps capped at {s.max_gap_s:g} s then "
            f"x{s.time_scale:g}, lease {settings.retention_ttl:g} s; {settings.prefills} "
            f"prefill + {settings.decodes} decode"
            + (" per instance profile, side by side" if len(profiles) > 1 else "")
            + f" ({settings.size} model, prefix caching on), "
            f"{instance_blocks(settings, plan)} blocks of {CPU_BLOCK_SIZE} each ("
            + "; ".join(f"{p} for {', '.join(e['modes'])}: {describe_host_tier(e['host_tier'])}"
                        for p, e in profiles.items())
            + f"); {settings.repeats} repeats, order rotated; host {describe_cpu(machine)}")


def run_trace_bench(settings: TraceBenchSettings,
                    say: Callable[[str], None] = print) -> dict[str, Any]:
    """Plan, start the instances of every profile the modes use, run every repeat of every mode
    on its profile's, stop; print the table, write the JSON (after every run, so a late failure
    keeps the earlier ones) and the plot."""
    plan = load_plan(settings)
    machine = host_info()
    cfg = fleet_config(settings, plan)
    say(configuration_line(settings, plan, machine))
    for cid, why in plan.left_out.items():
        say(f"left out: {cid}: {why}")
    runs: list[ModeRun] = []
    load_start = loadavg()
    results: dict[str, Any] = {}
    profiles = instance_profiles(settings, plan)
    with ProfileFleets(cfg, profiles, settings.host_tier_multiple) as fleets:
        fleets.start(progress=ProgressLine, say=say)
        probes = {p: HttpFleetProbe([(i.name, i.url) for i in fleet.instances],
                                    [(d.name, d.control_url) for d in fleet.decodes])
                  for p, fleet in fleets.fleets.items()}
        first = next(iter(fleets.fleets))
        info = probes[first].cache_info()
        reported = next((int(v["num_gpu_blocks"]) for v in info.values()
                         if v and "num_gpu_blocks" in v), cfg.decode_num_blocks or 0)
        block_size = next((int(v["block_size"]) for v in info.values()
                           if v and "block_size" in v), CPU_BLOCK_SIZE)
        kv = kv_statement(settings, plan, reported, block_size)
        say(f"KV: each instance {kv['blocks']} blocks x {kv['block_size']} = "
            f"{kv['capacity_tokens']} tokens; stands for {kv['stands_for']}")
        warm = {p: warm_up(f, settings, say, f"{p} instances: ")
                for p, f in fleets.fleets.items()} if settings.warmup else {}
        order = run_order(settings)
        total = len(order) * len(settings.modes)
        for repeat, modes in order:
            for position, name in enumerate(modes):
                args = settings.router_args(name)
                profile = MODES[name].profile
                say(f"run {len(runs) + 1}/{total}: repeat {repeat} {name} (router "
                    f"{' '.join(args) or 'defaults'}; {profile} instances)")
                runs.append(run_on_router(
                    fleets.fleets[profile], MODES[name], args, SCENARIO, repeat, position,
                    scripts(plan, name, repeat, settings.seed), probes[profile], settings, say,
                    "kvturn_server/bench/trace/_plan.py"))
                results = build_results(settings, plan, runs, kv, machine, extra={
                    "fleet": {**cfg.describe(),
                              "startup_s": fleets.fleets[first].startup_seconds,
                              "profiles": fleets.describe()},
                    "instances": profiles,
                    "cache_info": info, "warmup_ttft_ms": warm.get(first, {}),
                    "warmup_ttft_ms_by_profile": warm,
                    "order": [list(m) for _, m in order],
                    "load_average": {"start": list(load_start), "end": list(loadavg())}})
                if settings.json_path is not None:
                    write_json(results, settings.json_path)
    say_results(results, table, settings.json_path, settings.plot_path, write_plot, say)
    return results
