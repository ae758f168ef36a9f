"""The agent benchmark without servers: the mode table, the gap distribution, the workload
(profiles, repeats, rotation, the decode's blocks), the summary math (inter-token latency,
computed tokens on both instances, the router's route reports, the later turns the decode
served alone, medians and spreads over repeats, the verdicts, the comparison with every stock
mode and the strongest), the host, the JSON (and the committed one of before), the table and
the plot, and the agent loop against an in-process fake router, a router per run."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from kvturn_server._cli_common import write_json
from kvturn_server.bench._host import cpu_info, describe_cpu, host_info
from kvturn_server.bench._stats import (
    bootstrap_ratio,
    cdf_points,
    median_tree,
    percentile,
    spread,
)
from kvturn_server.bench.agent import (
    DEFAULT_MODES,
    KVTURN_MODES,
    MODE_TABLE,
    MODES,
    MODES_BY_NAME,
    STOCK_MODES,
    AgentBenchSettings,
    AgentOutcome,
    GapDistribution,
    ModeRun,
    Sample,
    Sampler,
    TurnRecord,
    add_agent_bench_parser,
    agent_fleet_config,
    aggregate_comparison,
    build_results,
    build_scripts,
    compare,
    decode_turns,
    measure,
    mode_order,
    never_slower_checks,
    pooled_comparison,
    router_args,
    settings_from_args,
    strongest_stock,
    summarize,
    table,
    tail_makeup,
    verdict,
    write_plot,
)
from kvturn_server.local._metrics import PromptSources
from kvturn_server.router import RouterConfig
from tests.fakes.bench_router import AgentBenchRouter as FakeRouter
from tests.fakes.bench_router import Routers, failing_turn

REPO = Path(__file__).resolve().parents[3]
PLAIN_MODES = tuple(m for m in MODES if MODES_BY_NAME[m].profile == "plain")

MIB = 1024 * 1024


# The modes.

def test_the_mode_table_gives_each_mode_its_router_flags_client_and_peer() -> None:
    table_ = {m.name: (m.label, m.router_args, m.client, m.profile) for m in MODE_TABLE}
    cond = ("--no-kv-reuse", "--conditional-disagg", "512")
    assert table_ == {
        "off": ("stock-pd", ("--no-kv-reuse",), "plain", "plain"),
        "stock-cond": ("stock-cond", cond, "ids", "plain"),
        "stock-cond-2k": ("stock-cond-2k", ("--no-kv-reuse", "--conditional-disagg", "2048"),
                          "ids", "plain"),
        # stock-cond as it is, on instances with vLLM's CPU offloading.
        "stock-cond-offload": ("stock-cond-offload", cond, "ids", "offload"),
        "on": ("kvturn", (), "kvturn", "plain"),
        "kvturn-offload": ("kvturn-offload", (), "kvturn", "host-tier"),
    }
    assert MODES == ("off", "stock-cond", "stock-cond-2k", "stock-cond-offload", "on",
                     "kvturn-offload")
    assert DEFAULT_MODES == ("off", "stock-cond", "on") == AgentBenchSettings().modes
    assert STOCK_MODES == ("off", "stock-cond", "stock-cond-2k", "stock-cond-offload")
    assert KVTURN_MODES == ("on", "kvturn-offload")
    offload = MODES_BY_NAME["stock-cond-offload"]
    # The peers it stands for, with sources: llm-d's CPU tier, LMCache, vLLM's connector.
    assert "llm-d's P2P KV sharing" in offload.stands_for and "2x" in offload.stands_for
    assert "offload_prompt_only false" in offload.stands_for
    assert any("OffloadingConnector" in x for x in offload.sources)
    assert any("llm-d guides" in x for x in offload.sources)
    assert any("LMCache" in x for x in offload.sources)
    assert any("prefix_based_pd_decider" in x for x in offload.sources)
    assert MODES_BY_NAME["off"].describe()["profile"] == "plain"
    # stock-cond decides on llm-d's 512, stock-cond-2k on Dynamo's 2,048: kvturn's own default.
    default = next(f.default for f in fields(RouterConfig) if f.name == "decode_continue_tokens")
    assert MODES_BY_NAME["stock-cond"].router_args[-1] == "512"
    assert MODES_BY_NAME["stock-cond-2k"].router_args[-1] == str(default) == "2048"
    for mode in MODE_TABLE:
        assert mode.stands_for and mode.sources
    assert "prefix-based-pd-decider" in MODES_BY_NAME["stock-cond"].stands_for
    assert "Dynamo" in MODES_BY_NAME["stock-cond-2k"].stands_for
    assert any("disagg_proxy" in source for source in MODES_BY_NAME["off"].sources)
    # --router-arg comes after the mode's own flags, for every mode.
    s = AgentBenchSettings(router_args=("--log-level", "debug"))
    assert router_args("stock-cond", s) == ("--no-kv-reuse", "--conditional-disagg", "512",
                                            "--log-level", "debug")
    assert router_args("on", s) == ("--log-level", "debug")
    assert MODES_BY_NAME["off"].describe(("--x",))["router_args"] == ["--no-kv-reuse", "--x"]


def test_every_mode_s_flags_make_a_router_the_router_accepts() -> None:
    from kvturn_server.router import add_router_args, router_config_from_args

    configs = {}
    for mode in MODE_TABLE:
        parser = argparse.ArgumentParser()
        add_router_args(parser)
        configs[mode.name] = router_config_from_args(parser.parse_args(
            ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
             *mode.router_args]))
    assert {m: (c.kv_reuse, c.conditional_disagg) for m, c in configs.items()} == {
        "off": (False, 0), "stock-cond": (False, 512), "stock-cond-2k": (False, 2048),
        "stock-cond-offload": (False, 512), "on": (True, 0), "kvturn-offload": (True, 0)}


# The gap distribution.

def test_the_gap_fit_puts_p50_and_p90_on_the_trace_and_scales_them() -> None:
    gaps = GapDistribution(p50_s=2.0, p90_s=24.0, time_scale=0.1, cap_s=None)
    assert gaps.mu == pytest.approx(math.log(2.0))
    assert gaps.sigma == pytest.approx(math.log(12.0) / 1.2815515655446004)
    assert gaps.quantile(0.5) == pytest.approx(0.2)
    assert gaps.quantile(0.9) == pytest.approx(2.4)
    # Fitted to p50/p90 the log-normal's p99 is about 3 min: lighter than the traces' ~11 min.
    assert 170 < gaps.trace_quantile(0.99) < 195
    assert gaps.describe()["fit_trace_p99_s"] == pytest.approx(gaps.trace_quantile(0.99), abs=0.1)


def test_seeded_draws_repeat_and_their_quantiles_are_near_the_targets() -> None:
    gaps = GapDistribution(time_scale=0.1)
    draws = [gaps.draw(random.Random(7)) for _ in range(3)]
    assert draws == [gaps.draw(random.Random(7)) for _ in range(3)]
    rng = random.Random(1234)
    sample = [gaps.draw(rng) for _ in range(20000)]
    p50, p90 = percentile(sample, 0.5), percentile(sample, 0.9)
    assert p50 is not None and p90 is not None
    assert p50 == pytest.approx(0.2, rel=0.05)
    assert p90 == pytest.approx(2.4, rel=0.08)
    assert max(sample) <= 66.0 + 1e-9  # the cap: 660 trace seconds, scaled


def test_the_gap_distribution_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        GapDistribution(p50_s=30.0, p90_s=24.0)
    with pytest.raises(ValueError):
        GapDistribution(time_scale=0.0)


# Settings and the workload.

def test_settings_derive_the_lease_and_the_keepalive_from_the_time_scale() -> None:
    s = AgentBenchSettings(time_scale=0.1)
    assert s.retention_ttl == 48.0 and s.keepalive_interval == 6.0
    assert AgentBenchSettings(time_scale=0.01).retention_ttl == 30.0  # floor
    assert AgentBenchSettings(retention_ttl_s=100.0).keepalive_interval == 12.5
    with pytest.raises(ValueError):
        AgentBenchSettings(modes=("on", "on"))
    with pytest.raises(ValueError):
        AgentBenchSettings(modes=("fast",))
    with pytest.raises(ValueError, match="decode-blocks"):
        AgentBenchSettings(decode_blocks=1)
    with pytest.raises(ValueError):
        AgentBenchSettings(message_tokens=(300, 100))
    with pytest.raises(ValueError):
        AgentBenchSettings(repeats=0)
    with pytest.raises(ValueError, match="profile"):
        AgentBenchSettings(profile="essay")
    with pytest.raises(ValueError):
        AgentBenchSettings(long_reply_tokens=(1000, 300))
    AgentBenchSettings().check_fits(8192)  # the defaults fit the tiny model's context
    AgentBenchSettings(max_tokens=256).check_fits(8192)
    with pytest.raises(ValueError, match="context"):
        AgentBenchSettings(turns=40).check_fits(8192)
    # The tight decode (320 blocks) and its tightest (100) start; vLLM refuses a decode
    # that cannot hold one request of the context beside its null block.
    AgentBenchSettings(decode_blocks=320, agents=16).check_fits(8192)
    AgentBenchSettings(decode_blocks=65).check_fits(8192)
    with pytest.raises(ValueError, match="at least 65"):
        AgentBenchSettings(decode_blocks=64).check_fits(8192)


def test_the_context_check_counts_the_drawn_reply_lengths() -> None:
    tool = AgentBenchSettings()
    long = AgentBenchSettings(profile="long")
    # The same messages, 64-token replies against 300-1000: the long profile needs more.
    assert long.context_needed() > tool.context_needed() + 6 * (300 - 64)
    assert long.context_needed() < tool.context_needed() + 6 * (1000 - 64)
    assert long.max_prompt_tokens() < long.context_needed()
    # Six long turns after a 2,500-token system prompt can pass the tiny model's 8k; five fit.
    with pytest.raises(ValueError, match="long-reply-tokens"):
        long.check_fits(8192)
    AgentBenchSettings(profile="long", turns=5).check_fits(8192)


def test_scripts_are_deterministic_with_the_requested_sizes() -> None:
    s = AgentBenchSettings(agents=4, turns=5, system_tokens=1000, message_tokens=(100, 300),
                           stagger_s=0.5, seed=3)
    on, again, off = build_scripts(s, "on"), build_scripts(s, "on"), build_scripts(s, "off")
    assert on == again
    assert [a.start_s for a in on] == [0.0, 0.5, 1.0, 1.5]
    for a in on:
        assert len(a.system.split()) == 1000 and a.system_words == 1000
        assert len(a.messages) == 5 and len(a.gaps_s) == 4
        assert all(100 <= n <= 300 for n in a.message_words)
        assert [len(m["content"].split()) for m in a.messages] == list(a.message_words)
        assert a.messages[0]["role"] == "user"
        assert all(m["role"] == "tool" and m["tool_call_id"] for m in a.messages[1:])
        assert all(g >= 0 for g in a.gaps_s)
    # Same sizes, gaps and starts in both modes; other words, so no cache carries over.
    for a, b in zip(on, off, strict=True):
        assert (a.message_words, a.gaps_s, a.start_s) == (b.message_words, b.gaps_s, b.start_s)
        assert a.system != b.system
    assert len({a.system for a in on}) == 4  # every agent its own history
    assert build_scripts(AgentBenchSettings(agents=4, turns=5, seed=4), "on")[0].gaps_s \
        != on[0].gaps_s
    assert all(a.reply_tokens == (64,) * 5 for a in on)  # the tool profile: --max-tokens


def test_every_repeat_runs_the_same_scripts_with_new_words() -> None:
    s = AgentBenchSettings(agents=3, turns=4, system_tokens=200, seed=5)
    runs = {(mode, repeat): build_scripts(s, mode, repeat)
            for mode in ("off", "on") for repeat in range(3)}
    shapes = {key: [(a.message_words, a.gaps_s, a.start_s, a.reply_tokens) for a in scripts]
              for key, scripts in runs.items()}
    assert len({repr(v) for v in shapes.values()}) == 1
    systems = {a.system for scripts in runs.values() for a in scripts}
    assert len(systems) == 2 * 3 * 3  # no prefix shared between any two runs or agents
    assert all(a.repeat == repeat for (_, repeat), scripts in runs.items() for a in scripts)
    assert build_scripts(s, "on", 1) == build_scripts(s, "on", 1)
    assert build_scripts(s, "on") == build_scripts(s, "on", 0)


def test_the_long_profile_draws_reply_lengths_per_turn_and_keeps_the_messages() -> None:
    tool = AgentBenchSettings(agents=4, turns=6, seed=2)
    long = replace(tool, profile="long", long_reply_tokens=(300, 1000))
    tool_scripts, long_scripts = build_scripts(tool, "on"), build_scripts(long, "on")
    replies = [n for a in long_scripts for n in a.reply_tokens]
    assert all(300 <= n <= 1000 for n in replies) and len(set(replies)) > 10
    for a, b in zip(tool_scripts, long_scripts, strict=True):
        assert (a.message_words, a.gaps_s, a.system) == (b.message_words, b.gaps_s, b.system)
    # The same draws in every mode and repeat, and in the JSON.
    assert [a.reply_tokens for a in build_scripts(long, "off", 2)] == [
        a.reply_tokens for a in long_scripts]
    assert long.reply_description()["max_tokens_range"] == [300, 1000]
    assert tool.reply_description()["max_tokens"] == 64
    assert "300-1000" in long.reply_text() and "64" in tool.reply_text()


def test_each_repeat_rotates_the_order_of_the_modes() -> None:
    assert [mode_order(("off", "on"), r) for r in range(4)] == [
        ("off", "on"), ("on", "off"), ("off", "on"), ("on", "off")]
    assert [mode_order(("on", "off"), r) for r in range(2)] == [("on", "off"), ("off", "on")]
    assert mode_order(("on",), 5) == ("on",)
    # With as many repeats as modes, every mode runs once in every position.
    orders = [mode_order(MODES, r) for r in range(len(MODES))]
    assert orders[1] == ("stock-cond", "stock-cond-2k", "stock-cond-offload", "on",
                         "kvturn-offload", "off")
    assert all({o[position] for o in orders} == set(MODES) for position in range(len(MODES)))


# The host.

def test_the_cpu_model_and_amx_come_from_cpuinfo(tmp_path: Path) -> None:
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                   "flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n\n"
                   "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n")
    assert cpu_info(amx) == {"model": "Intel(R) Xeon(R) Platinum 8480+", "amx": True}
    plain = tmp_path / "plain"
    plain.write_text("model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f amx_bf16x\n")
    assert cpu_info(plain) == {"model": "AMD EPYC", "amx": False}
    assert cpu_info(tmp_path / "missing") == {"model": None, "amx": None}
    machine = host_info(plain)
    assert machine["cpu_model"] == "AMD EPYC" and machine["amx"] is False
    assert machine["cpus"] and machine["python"]
    assert describe_cpu(machine).startswith("AMD EPYC, ") and "no AMX" in describe_cpu(machine)
    assert "AMX unknown" in describe_cpu(host_info(tmp_path / "missing"))


def test_the_instances_scale_the_lease_and_size_the_decode(tmp_path: Path) -> None:
    s = AgentBenchSettings(state_dir=tmp_path, time_scale=0.2, size="bench")
    cfg = agent_fleet_config(s)
    assert (cfg.prefills, cfg.decodes) == (1, 1)  # the routers: one per run, started apart
    assert cfg.decoder_kv_blocks_ttl == 96.0
    assert cfg.max_model_len == 32768 and cfg.model_name == "kvturn-bench"
    assert cfg.model_path == tmp_path / "models" / "bench"  # where `kvturn up` builds it
    assert cfg.prefill_prefix_caching  # vLLM's default, what users run
    assert cfg.decode_num_blocks is None and cfg.prefill_num_blocks is None
    # Every reply's usage says what the serving instance's cache supplied.
    assert cfg.extra_vllm_args == ("--enable-prompt-tokens-details",)
    assert not agent_fleet_config(AgentBenchSettings(prefill_prefix_cache=False)) \
        .prefill_prefix_caching
    assert agent_fleet_config(AgentBenchSettings(decode_blocks=320)).decode_num_blocks == 320


# Summary math.

def test_percentiles_interpolate_between_order_statistics() -> None:
    values = [float(v) for v in range(10, 0, -1)]  # unsorted on purpose
    assert percentile(values, 0.5) == pytest.approx(5.5)
    assert percentile(values, 0.9) == pytest.approx(9.1)
    assert percentile(values, 0.99) == pytest.approx(9.91)
    assert percentile(values, 0.0) == 1.0 and percentile(values, 1.0) == 10.0
    assert percentile([4.0], 0.99) == 4.0
    assert percentile([], 0.5) is None
    points = cdf_points(values)
    assert len(points) == 101 and points[0] == 1.0 and points[50] == 5.5 and points[100] == 10.0


def _record(mode: str, agent: int, turn: int, ttft: float | None, prompt: int,
            reuse: str = "miss", reused: int = 0, error: str | None = None,
            itl: tuple[float, ...] = (), repeat: int = 0, route: str | None = None,
            choice: str | None = None, completion: int = 64,
            cached: int | None = None) -> TurnRecord:
    return TurnRecord(mode=mode, agent=agent, turn=turn, conversation_id=None,
                      started_s=float(turn), message_role="tool", message_words=100,
                      prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
                      ttft_ms=ttft,
                      total_ms=None if ttft is None else ttft + 500, reuse=reuse,
                      reused_tokens=reused, error=error, repeat=repeat, max_tokens=64,
                      route=route, prefill_choice=choice, content_chunks=len(itl) + 1,
                      itl_gaps_ms=list(itl))


def _runs(repeat: int = 0, on_scale: float = 1.0, on_itl: float = 20.0) -> list[ModeRun]:
    """One repeat: "off" then "on"; ``on_scale`` multiplies the on mode's TTFTs and
    ``on_itl`` is its inter-token gap."""
    off = ModeRun(
        mode="off", wall_s=10.0, agents=[AgentOutcome("off", 0, None, 3, repeat=repeat)],
        records=[_record("off", 0, 1, 100.0, 1000, itl=(20.0, 20.0), repeat=repeat),
                 _record("off", 0, 2, 300.0, 1500, itl=(20.0, 40.0), repeat=repeat),
                 _record("off", 0, 3, 500.0, 2000, itl=(20.0,), repeat=repeat),
                 _record("off", 0, 4, None, 0, error="APIError: boom", repeat=repeat)],
        samples=[Sample("off", 0.0, 0, 0.0, repeat), Sample("off", 5.0, 0, 2500.0, repeat)],
        prefill_before=PromptSources(1000.0, 0.0, 0.0),
        prefill_after=PromptSources(5500.0, 0.0, 0.0),
        decode_before=PromptSources(0.0, 0.0, 0.0),
        decode_after=PromptSources(0.0, 0.0, 4500.0), load_before=(1.0, 1.0, 1.0),
        repeat=repeat)
    on = ModeRun(
        mode="on", wall_s=8.0, agents=[AgentOutcome("on", 0, "kvt-x", 3, repeat=repeat)],
        records=[_record("on", 0, 1, 100.0 * on_scale, 1000, itl=(on_itl,), repeat=repeat),
                 _record("on", 0, 2, 50.0 * on_scale, 1500, "hit", 1024, itl=(on_itl,),
                         repeat=repeat),
                 _record("on", 0, 3, 60.0 * on_scale, 2000, "partial", 1504, itl=(on_itl,),
                         repeat=repeat)],
        samples=[Sample("on", 0.0, 0, 0.0, repeat), Sample("on", 1.0, 2 * MIB, 1000.0, repeat),
                 Sample("on", 2.0, 4 * MIB, None, repeat),
                 Sample("on", 3.0, None, 1500.0, repeat)],
        prefill_before=PromptSources(5500.0, 0.0, 0.0),
        prefill_after=PromptSources(7000.0, 0.0, 2528.0),
        decode_before=PromptSources(0.0, 0.0, 4500.0),
        decode_after=PromptSources(10.0, 2528.0, 6000.0), repeat=repeat)
    return [off, on]


def test_a_mode_summary_counts_only_successful_turns() -> None:
    off, on = (summarize(run, planned_turns=4) for run in _runs())
    assert off["turns_ok"] == 3 and off["errors"] == 1 and off["turns_planned"] == 4
    assert off["ttft_ms"]["p50"] == 300.0 and off["ttft_ms"]["n"] == 3
    assert off["ttft_ms"]["p90"] == pytest.approx(460.0)
    assert off["ttft_ms_turn2plus"]["p50"] == 400.0
    assert off["prompt_tokens"] == {"total": 4500, "mean": 1500.0, "max": 2000}
    assert off["prefill_computed_tokens"] == 4500.0
    assert off["turns_per_s"] == 0.3
    assert off["reuse"] == {"outcomes": {"miss": 3}, "reused_tokens": 0}
    assert on["reuse"] == {"outcomes": {"hit": 1, "miss": 1, "partial": 1},
                           "reused_tokens": 2528}
    assert on["prefill_tokens"] == {"computed": 1500.0, "local_cache": 0.0,
                                    "transferred": 2528.0, "host": 0.0}
    assert on["host_tokens"] == 0.0 and on["profile"] == "plain"
    assert on["retained_mib"] == {"max": 4.0, "mean": 2.0, "samples": 3}
    assert off["completion_tokens"] == 192 and off["completion_tokens_requested"] == 192
    assert off["replies_short"] == 0 and off["finish_reasons"] == {"unreported": 3}


def test_inter_token_latency_pools_every_gap_and_averages_each_turn() -> None:
    off = summarize(_runs()[0], planned_turns=4)
    # Gaps 20, 20 | 20, 40 | 20 (the failed turn has none): pooled, then per turn.
    assert off["itl_ms"]["n"] == 5 and off["itl_ms"]["p50"] == 20.0
    assert off["itl_ms"]["max"] == 40.0 and off["itl_ms"]["p99"] == pytest.approx(39.2)
    assert off["itl_ms_turn_mean"]["n"] == 3 and off["itl_ms_turn_mean"]["max"] == 30.0
    assert off["content_chunks"] == 8
    # A turn's JSON carries its own ITL summary, not every gap.
    data = _record("on", 0, 1, 10.0, 10, itl=(5.0, 15.0), completion=3).to_json()
    assert "itl_gaps_ms" not in data
    assert data["itl_ms"]["n"] == 2 and data["itl_ms"]["p50"] == 10.0
    assert data["tpot_ms"] == 10.0


def test_time_per_output_token_does_not_depend_on_how_the_tokens_were_chunked() -> None:
    # 65 tokens: 64 gaps of 10 ms, or a stall of 330 ms after which 33 tokens came in one
    # chunk, then 31 gaps of 10 ms: the chunk gaps differ, the time per token does not.
    steady = _record("off", 0, 1, 100.0, 10, itl=(10.0,) * 64, completion=65)
    stalled = _record("off", 0, 2, 100.0, 10, itl=(330.0,) + (10.0,) * 31, completion=65)
    assert steady.tpot_ms == stalled.tpot_ms == 10.0
    assert _record("off", 0, 3, 1.0, 1, itl=(), completion=1).tpot_ms is None
    run = ModeRun(mode="off", wall_s=1.0, samples=[], agents=[], records=[steady, stalled])
    s = summarize(run, 2)
    assert s["tpot_ms"]["n"] == 2 and s["tpot_ms"]["p50"] == 10.0
    assert s["itl_ms"]["n"] == 96 and s["itl_ms"]["max"] == 330.0
    assert s["content_chunks"] == 65 + 33 and s["completion_tokens"] == 130


def test_computed_tokens_count_both_instances_and_the_comparison_uses_their_sum() -> None:
    summaries = {run.mode: summarize(run, 4) for run in _runs()}
    off, on = summaries["off"], summaries["on"]
    assert (off["prefill_computed_tokens"], off["decode_computed_tokens"],
            off["computed_tokens"]) == (4500.0, 0.0, 4500.0)
    assert (on["prefill_computed_tokens"], on["decode_computed_tokens"],
            on["computed_tokens"]) == (1500.0, 10.0, 1510.0)
    cmp = compare(summaries)
    assert cmp is not None
    assert cmp["prefill_computed_off_over_on"] == 3.0
    assert cmp["computed_off_over_on"] == pytest.approx(4500 / 1510, abs=1e-3)
    # A decode that continues a turn itself computes that turn's new tokens: the sum shows it
    # where the prefill's count alone would not.
    decode_heavy = replace(_runs()[1], decode_after=PromptSources(3000.0, 2528.0, 6000.0))
    cmp = compare({"off": off, "on": summarize(decode_heavy, 4)})
    assert cmp is not None
    assert cmp["prefill_computed_off_over_on"] == 3.0 and cmp["computed_off_over_on"] == 1.0
    unmeasured = replace(_runs()[1], decode_after=None)
    assert summarize(unmeasured, 4)["computed_tokens"] is None


def test_the_routers_route_reports_are_counted_per_mode() -> None:
    run = ModeRun(mode="on", wall_s=1.0, samples=[], agents=[], records=[
        _record("on", 0, 1, 100.0, 10, route="prefill", choice="holder"),
        _record("on", 0, 2, 20.0, 10, route="decode"),
        _record("on", 0, 3, 30.0, 10, route="decode"),
        _record("on", 0, 4, 90.0, 10, route="prefill", choice="load"),
        _record("on", 0, 5, 300.0, 10, route="fallback"),
        _record("on", 0, 6, 40.0, 10)])  # a router that does not say
    s = summarize(run, 6)
    assert s["routes"] == {"decode": 2, "fallback": 1, "prefill": 2, "unreported": 1}
    # Choices only where a prefill was chosen (or the router did not say).
    assert s["prefill_choices"] == {"holder": 1, "load": 1, "unreported": 1}
    assert s["ttft_ms_by_route"]["decode"]["p50"] == 25.0
    assert s["ttft_ms_by_route"]["prefill"]["n"] == 2
    assert set(s["ttft_ms_by_route"]) == {"decode", "fallback", "prefill"}
    today = summarize(_runs()[1], 3)  # no router sends the headers yet
    assert today["routes"] == {"unreported": 3} and today["prefill_choices"] == {
        "unreported": 3}


def test_later_turns_the_decode_served_alone_say_whether_it_held_their_history() -> None:
    records = [
        _record("stock-cond", 0, 1, 300.0, 1000, route="prefill", cached=0),
        # The decode's cache held every full block of the last prompt (1000 -> 896 at 128).
        _record("stock-cond", 0, 2, 50.0, 1300, route="decode", cached=896),
        # It had lost this conversation's history: it recomputed all of it.
        _record("stock-cond", 0, 3, 200.0, 1600, route="decode", cached=0),
        # Too long for the decode alone: a prefill leg (not counted as a decode turn).
        _record("stock-cond", 0, 4, 300.0, 3000, route="prefill", cached=1536),
        # A decode turn without vLLM's report: counted, not judged.
        _record("stock-cond", 0, 5, 60.0, 3300, route="decode"),
        _record("stock-cond", 1, 1, 300.0, 1000, route="prefill", cached=0),
        _record("stock-cond", 1, 2, None, 0, route="decode", error="APIError: boom")]
    assert decode_turns(records, 128) == {
        "later_turns": 4, "turns": 3, "reported": 2, "found_history": 1, "missed_history": 1,
        "prompt_tokens": 2900, "cached_tokens": 896, "computed_tokens": 2004}
    # Blocks of 16: 992 of the first prompt's 1000 tokens are full blocks; 896 falls short.
    assert decode_turns(records, 16)["missed_history"] == 2
    run = ModeRun(mode="stock-cond", wall_s=1.0, samples=[], agents=[], records=records)
    assert summarize(run, 12, block_size=128)["decode_turns"]["found_history"] == 1
    assert decode_turns([], 128)["turns"] == 0


def test_medians_over_repeats_go_leaf_by_leaf_and_counters_fill_in_zeros() -> None:
    merged = median_tree([
        {"mode": "on", "n": 1, "d": {"p50": 10.0, "p99": None}, "outcomes": {"hit": 4},
         "load": [1.0], "flag": True},
        {"mode": "on", "n": 3, "d": {"p50": 30.0, "p99": 5.0}, "outcomes": {"hit": 2,
                                                                             "miss": 3},
         "load": [2.0], "flag": True},
        {"mode": "on", "n": 2, "d": {"p50": 20.0, "p99": 7.0}, "outcomes": {"hit": 3},
         "load": [3.0], "flag": True}])
    assert merged == {"mode": "on", "n": 2, "d": {"p50": 20.0, "p99": 6.0},
                      "outcomes": {"hit": 3, "miss": 0}, "flag": True}
    assert median_tree([None, None]) is None
    assert spread([3.0, None, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0,
                                            "per_repeat": [3.0, None, 1.0, 2.0]}
    assert spread([None]) == {"min": None, "median": None, "max": None, "per_repeat": [None]}


def _ratios(repeat: int, ttft: float, itl_on_over_off: float = 1.0,
            computed: float = 1.2) -> dict[str, Any]:
    return {"repeat": repeat, "order": ["off", "on"], "ttft_ms_p50_off_over_on": ttft,
            "ttft_ms_p90_off_over_on": ttft, "ttft_ms_p99_off_over_on": ttft,
            "ttft_ms_turn2plus_p50_off_over_on": ttft, "itl_ms_p99_on_over_off": itl_on_over_off,
            "computed_off_over_on": computed, "prefill_computed_off_over_on": computed}


def test_the_verdict_says_whether_kvturn_was_ever_slower() -> None:
    fine = verdict([_ratios(0, 1.0), _ratios(1, 1.3, 1.09)])
    assert fine["never_slower"] is True and fine["slower"] == []
    assert fine["computed_never_more"] is True and fine["itl_p99_within_10pct"] is True
    assert fine["itl_p99_on_over_off_max"] == 1.09
    slow = verdict([_ratios(0, 1.1), _ratios(1, 1.1, 1.2, computed=0.9)])
    assert slow["never_slower"] is True
    assert slow["itl_p99_within_10pct"] is False and slow["computed_never_more"] is False
    row = _ratios(1, 1.2)
    row["ttft_ms_p99_off_over_on"] = 0.97
    worse = verdict([_ratios(0, 1.2), row])
    assert worse["never_slower"] is False
    assert worse["slower"] == [{"ratio": "ttft_ms_p99_off_over_on", "repeat": 1, "value": 0.97}]
    barely = verdict([_ratios(0, 0.999)])
    assert barely["never_slower"] is False and len(barely["slower"]) == 4
    row = _ratios(0, 1.2)
    row["ttft_ms_p90_off_over_on"] = None
    assert verdict([row])["never_slower"] is None  # not measured is not "never slower"
    agg = aggregate_comparison([_ratios(0, 0.9), _ratios(1, 1.5), _ratios(2, 1.1)])
    assert agg is not None
    assert agg["ttft_ms_p50_off_over_on"] == 1.1  # the median over the repeats
    assert agg["spread"]["ttft_ms_p50_off_over_on"] == {
        "min": 0.9, "median": 1.1, "max": 1.5, "per_repeat": [0.9, 1.5, 1.1]}
    assert agg["verdict"]["never_slower"] is False and len(agg["per_repeat"]) == 3
    assert aggregate_comparison([]) is None


AMD = {"cpus": 2, "cpu_model": "AMD EPYC", "amx": False, "python": "3.12",
       "platform": "Linux"}


def test_the_results_document_has_settings_seed_summaries_records_and_samples(
        tmp_path: Path) -> None:
    settings = AgentBenchSettings(agents=1, turns=4, seed=11, repeats=1)
    results = build_results(settings, _runs(), {"load_average": {"start": [], "end": []}},
                            machine=AMD)
    path = tmp_path / "out" / "agent.json"
    write_json(results, path)
    data = json.loads(path.read_text())
    assert data["benchmark"] == "agent" and data["seed"] == 11
    assert data["settings"]["agents"] == 1 and data["settings"]["seed"] == 11
    assert data["settings"]["effective_retention_ttl_s"] == 48.0
    assert data["order"] == ["off", "on"] and data["order_rationale"]
    assert set(data["modes"]) == {"off", "on"}
    assert data["gaps"]["distribution"] == "lognormal"
    assert len(data["gaps"]["drawn_s"]["0"]) == 3
    assert data["replies"]["profile"] == "tool"
    assert data["replies"]["drawn_max_tokens"] == {"0": [64] * 4}
    assert data["comparison"]["prefill_computed_off_over_on"] == 3.0
    assert data["comparison"]["ttft_ms_p50_off_over_on"] == pytest.approx(300.0 / 60.0, abs=1e-3)
    assert data["machine"] == AMD
    assert data["configuration"] == {
        "prefill_prefix_cache": True, "decode_prefix_cache": True, "prefills": 1,
        "decodes": 1, "router": True, "routers": "one per run, started with its mode's flags",
        "decode_blocks": None, "model": "tiny", "agents": 1, "turns": 4,
        "system_tokens": 2500, "message_tokens": [100, 300],
        "reply": settings.reply_description(), "repeats": 1, "orders": [["off", "on"]],
        "instances": {"plain": {"modes": ["off", "stock-cond", "on"], "host_tier": None}},
        "cpu_model": "AMD EPYC", "amx": False, "cpus": 2}
    assert len(data["turns"]) == 7 and len(data["samples"]) == 6
    assert set(data["turns"][0]) == {
        "mode", "agent", "turn", "conversation_id", "started_s", "message_role",
        "message_words", "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms",
        "total_ms", "reuse",
        "reused_tokens", "no_reuse_reason", "finish_reason", "gap_after_s", "error", "repeat",
        "max_tokens", "route", "prefill_choice", "content_chunks", "itl_ms", "tpot_ms"}
    assert set(data["samples"][0]) == {"mode", "t_s", "retained_bytes",
                                       "prefill_computed_tokens", "repeat"}
    assert data["load_average"] == {"start": [], "end": []}
    # One repeat: the medians are that repeat's figures.
    assert data["modes"]["off"]["ttft_ms"] == data["repeats"][0]["modes"]["off"]["ttft_ms"]
    # The mode table: what each mode ran as and stands for.
    assert [m["mode"] for m in data["mode_table"]] == ["off", "on"]
    assert data["mode_table"][0]["label"] == "stock-pd"
    assert data["mode_table"][0]["router_args"] == ["--no-kv-reuse"]
    # Only off ran as a stock mode: it is the strongest, and comparison (the keys of old
    # readers) and comparisons["off"] hold the same figures.
    assert data["headline"]["against"] == "off"
    assert data["comparisons"]["off"]["base"] == "off"
    assert data["comparisons"]["off"]["ttft_ms_p50_base_over_on"] == data["comparison"][
        "ttft_ms_p50_off_over_on"]
    lines = table(data).splitlines()
    assert lines[0].startswith("configuration: prefill prefix cache ON (vLLM default)")
    assert "1 prefill + 1 decode (plain for off, stock-cond, on: no host tier) + a router per " \
           "run" in lines[0]
    assert "tool profile, 64 tokens" in lines[0] and "AMD EPYC, 2 CPUs, no AMX" in lines[0]
    assert lines[1].startswith("off (stock-pd): router --no-kv-reuse; client plain; plain "
                               "instances")
    assert lines[2].startswith("on (kvturn): router (defaults); client kvturn; plain instances")
    assert lines[5].startswith("off ") and lines[6].startswith("on ")
    assert any(line.startswith("strongest stock mode: off (stock-pd)") for line in lines)
    assert "kvturn (on) against off (stock-pd), the strongest stock mode:" in lines
    assert any(line.startswith("  verdict: kvturn was never slower than off") for line in lines)


def test_repeats_report_medians_spreads_and_the_ratio_of_every_repeat() -> None:
    settings = AgentBenchSettings(agents=1, turns=4, repeats=3, prefill_prefix_cache=False,
                                  profile="long")
    # Repeat 1 runs on first (rotated) and is slower than off at p50; ITL on/off 1.0, 1.5, 1.0.
    first, second, third = _runs(0), _runs(1, on_scale=6.0, on_itl=30.0), _runs(2, 2.0)
    runs = [*first, second[1], second[0], *third]
    results = build_results(settings, runs, machine=AMD)
    assert results["order"] == ["off", "on", "on", "off", "off", "on"]
    assert results["configuration"]["orders"] == [["off", "on"], ["on", "off"], ["off", "on"]]
    assert [r["order"] for r in results["repeats"]] == results["configuration"]["orders"]
    on = results["modes"]["on"]
    assert on["repeats"] == 3 and on["turns_ok_total"] == 9 and on["errors_total"] == 0
    assert results["modes"]["off"]["errors_total"] == 3
    # p50 of each repeat's on TTFTs: 60, 360, 120 -> median 120, spread 60-360.
    assert on["ttft_ms"]["p50"] == 120.0
    assert on["spread"]["ttft_ms_p50"] == {"min": 60.0, "median": 120.0, "max": 360.0,
                                           "per_repeat": [60.0, 360.0, 120.0]}
    assert on["spread"]["itl_ms_p99"]["per_repeat"] == [20.0, 30.0, 20.0]
    assert on["itl_ms_pooled"]["n"] == 9 and len(on["itl_ms_pooled"]["cdf_pct"]) == 101
    assert on["spread"]["computed_tokens"]["per_repeat"] == [1510.0] * 3
    cmp = results["comparison"]
    assert [row["repeat"] for row in cmp["per_repeat"]] == [0, 1, 2]
    assert cmp["per_repeat"][1]["order"] == ["on", "off"]
    p50 = cmp["spread"]["ttft_ms_p50_off_over_on"]["per_repeat"]
    assert p50 == [5.0, pytest.approx(0.833, abs=1e-3), 2.5]
    assert cmp["ttft_ms_p50_off_over_on"] == 2.5
    assert cmp["spread"]["itl_ms_p99_on_over_off"]["per_repeat"] == [
        pytest.approx(20 / 39.2, abs=1e-3), pytest.approx(30 / 39.2, abs=1e-3),
        pytest.approx(20 / 39.2, abs=1e-3)]
    assert cmp["verdict"]["never_slower"] is False
    assert {s["repeat"] for s in cmp["verdict"]["slower"]} == {1}
    text = table(results)
    assert "prefill prefix cache OFF" in text and "long profile, 300-1000 tokens" in text
    assert "order off,on / on,off / off,on" in text
    assert "medians over 3 repeat(s)" in text and "spread over the repeats" in text
    assert "verdict: kvturn was SLOWER than off in 3 of 12 checks" in text
    assert "TTFT p50 off/on 0.833 (repeat 2)" in text
    assert "TTFT p50 off/on 5.00 0.83 2.50" in " ".join(text.split())


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    results = build_results(AgentBenchSettings(agents=1, turns=4, repeats=2),
                            [*_runs(0), *reversed(_runs(1))], machine=AMD)
    path = tmp_path / "agent.png"
    assert write_plot(results, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _FixedProbe:
    def __init__(self) -> None:
        self.held = 0

    def retained_bytes(self) -> int | None:
        self.held += MIB
        return self.held

    def prefill_sources(self) -> PromptSources | None:
        return PromptSources(float(self.held), 0.0, 0.0)

    def decode_sources(self) -> PromptSources | None:
        return None


def test_the_sampler_always_has_a_first_and_a_last_point() -> None:
    ticks = iter(range(100))
    sampler = Sampler(_FixedProbe(), "on", interval=3600.0, clock=lambda: float(next(ticks)),
                      repeat=2)
    sampler.start(t0=0.0)
    samples = sampler.stop()
    assert [s.retained_bytes for s in samples] == [MIB, 2 * MIB]
    assert [(s.mode, s.repeat) for s in samples] == [("on", 2), ("on", 2)]
    assert samples[0].t_s < samples[1].t_s


def test_the_command_line_maps_onto_the_settings(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "10000")  # no line breaks inside an option's name
    parser = argparse.ArgumentParser()
    agent_parser = add_agent_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["agent", "--json", str(tmp_path / "a.json")])
    s = settings_from_args(args)
    assert callable(args.func)
    assert (s.agents, s.turns, s.time_scale, s.seed, s.size, s.modes) == (
        8, 6, 0.1, 0, "tiny", ("off", "stock-cond", "on"))
    assert s.decode_blocks is None and s.router_args == ()
    assert (s.prefill_prefix_cache, s.repeats, s.profile, s.max_tokens) == (True, 3, "tool", 64)
    assert s.json_path == tmp_path / "a.json" and s.plot_path is None
    args = parser.parse_args(["agent", "--json", "x.json", "--modes", "on,off", "--agents", "2",
                              "--message-tokens", "50,60", "--max-gap", "0", "--size", "bench",
                              "--no-prefill-prefix-cache", "--retention-ttl", "90",
                              "--repeats", "5", "--profile", "long",
                              "--long-reply-tokens", "400,500", "--decode-blocks", "320",
                              "--router-arg=--log-level=debug"])
    s = settings_from_args(args)
    assert s.decode_blocks == 320 and s.router_args == ("--log-level=debug",)
    assert s.modes == ("on", "off") and s.agents == 2 and s.message_tokens == (50, 60)
    assert s.gap_cap_s is None and s.size == "bench" and not s.prefill_prefix_cache
    assert s.retention_ttl == 90.0
    assert (s.repeats, s.profile, s.long_reply_tokens) == (5, "long", (400, 500))
    with pytest.raises(SystemExit):
        parser.parse_args(["agent", "--json", "x.json", "--modes", "on,slow"])
    with pytest.raises(SystemExit):
        parser.parse_args(["agent", "--json", "x.json", "--profile", "essay"])
    assert settings_from_args(parser.parse_args(
        ["agent", "--json", "x.json", "--modes", "stock-cond-2k,on"])).modes == (
            "stock-cond-2k", "on")
    text = agent_parser.format_help()
    assert "--no-prefill-prefix-cache" in text and "vLLM" in text and "--repeats" in text
    # Every mode, its flags and the peer it stands for; the three scenarios.
    flat = " ".join(text.split())
    assert "'off' (stock-pd): stock P/D" in flat and "'on' (kvturn): kvturn" in flat
    assert "'stock-cond': stock conditional" in flat and "'stock-cond-2k': stock" in flat
    assert "--conditional-disagg 2048" in flat and "prefix-based-pd-decider" in flat
    assert "--decode-blocks 320 --agents 16" in flat and "--max-tokens 256" in flat
    # The host tier: the offload modes, their instances and the flag that sizes them.
    assert "'stock-cond-offload': stock-cond on instances with vLLM's CPU KV offloading" in flat
    assert "client ids; offload instances" in flat and "'kvturn-offload': kvturn" in flat
    assert "--modes off,stock-cond,stock-cond-offload,on,kvturn-offload" in flat
    assert "--host-tier X" in flat and "device KV" in flat
    assert s.host_tier_multiple == 2.0
    args = parser.parse_args(["agent", "--json", "x.json", "--host-tier", "3",
                              "--modes", "stock-cond-offload,kvturn-offload"])
    s = settings_from_args(args)
    assert s.host_tier_multiple == 3.0 and s.modes == ("stock-cond-offload", "kvturn-offload")
    with pytest.raises(ValueError, match="--host-tier"):
        replace(s, host_tier_multiple=0.0)


# The agent loop against an in-process fake router.

class FakeProbe:
    """The stack's instance-wide numbers, as the fake router's bookkeeping has them."""

    def __init__(self, router: FakeRouter) -> None:
        self.router = router

    def retained_bytes(self) -> int | None:
        return len(self.router.live) * MIB

    def prefill_sources(self) -> PromptSources | None:
        return PromptSources(float(self.router.computed), 0.0, 0.0)

    def decode_sources(self) -> PromptSources | None:
        host = float(self.router.host_loaded)
        return PromptSources(float(self.router.decode_computed), 0.0, host, host)

    def decode_block_size(self) -> int | None:
        return 4


async def test_both_modes_run_every_turn_and_read_usage_and_reuse_headers() -> None:
    router = FakeRouter()
    settings = AgentBenchSettings(agents=2, turns=3, system_tokens=50, message_tokens=(10, 20),
                                  stagger_s=0.0, time_scale=0.001, progress_interval_s=0,
                                  sample_interval_s=3600.0, repeats=1, modes=("off", "on"))
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await asyncio.sleep(0)

    said: list[str] = []
    routers = Routers(router.handle)
    results = await measure(settings, routers, "kvturn-tiny", FakeProbe(router),
                            say=said.append, sleep=sleep)

    turns = results["turns"]
    assert [(t["mode"], t["agent"], t["turn"]) for t in turns] == [
        (mode, agent, turn) for mode in ("off", "on") for agent in (0, 1) for turn in (1, 2, 3)]
    assert all(t["error"] is None and t["ttft_ms"] is not None and t["total_ms"] is not None
               and t["ttft_ms"] <= t["total_ms"] for t in turns)
    assert all(t["completion_tokens"] == 6 and t["finish_reason"] == "length" for t in turns)
    off = [t for t in turns if t["mode"] == "off"]
    on = [t for t in turns if t["mode"] == "on"]
    assert all(t["reuse"] == "miss" and t["reused_tokens"] == 0 and t["conversation_id"] is None
               for t in off)
    assert [t["reuse"] for t in on] == ["miss", "hit", "hit"] * 2
    assert all(t["conversation_id"].startswith("kvt-") for t in on)
    assert all(t["no_reuse_reason"] is None for t in on)  # the replies went back verbatim
    # What the router saw: ids only in "on" (body and header), prompts growing by the reply.
    # (The first two requests are the warm-up conversation.)
    sent = router.requests[2:]
    assert len(sent) == 12
    by_id: dict[str | None, list[dict[str, Any]]] = {}
    for request in sent:
        by_id.setdefault(request["body"].get("conversation_id"), []).append(request)
    assert len(by_id[None]) == 6
    assert all("x-conversation-id" not in r["headers"] for r in by_id[None])
    for conversation in {t["conversation_id"] for t in on}:
        requests = by_id[conversation]
        assert len(requests) == 3
        assert all("x-conversation-id" not in r["headers"] for r in requests)  # body only
        assert all("x-kvturn-no-reuse" not in r["headers"] for r in requests)
        first, second = requests[0]["body"]["messages"], requests[1]["body"]["messages"]
        assert second[:len(first)] == first
        assert second[len(first)] == {"role": "assistant", "content": "".join(FakeRouter.REPLY)}
        assert second[-1]["role"] == "tool"
        assert [r["body"]["max_tokens"] for r in requests] == [64] * 3
        assert all(r["body"]["temperature"] == 0 and r["body"]["stream"] for r in requests)
    # Usage and the router's numbers reach the records and the summaries.
    for t in on:
        request = by_id[t["conversation_id"]][t["turn"] - 1]
        assert t["prompt_tokens"] == sum(len(str(m.get("content") or "").split()) + 4
                                         for m in request["body"]["messages"])
    assert set(router.released) == {t["conversation_id"] for t in on} | {
        router.requests[0]["body"]["conversation_id"]}
    summary = results["modes"]
    assert summary["on"]["reuse"]["outcomes"] == {"hit": 4, "miss": 2}
    assert summary["on"]["reuse"]["reused_tokens"] == sum(t["reused_tokens"] for t in on)
    assert summary["off"]["prefill_computed_tokens"] == sum(t["prompt_tokens"] for t in off)
    assert summary["on"]["prefill_computed_tokens"] == sum(
        t["prompt_tokens"] - t["reused_tokens"] for t in on)
    assert summary["off"]["turns_ok"] == summary["on"]["turns_ok"] == 6
    assert results["comparison"]["prefill_computed_off_over_on"] > 1
    # The tool gaps slept are the drawn ones, in both modes (the warm-up's are zero).
    drawn = [g for agent in results["gaps"]["drawn_s"].values() for g in agent]
    assert sorted(round(s, 4) for s in slept if s > 0) == sorted(
        [g for g in drawn if g > 0] * 2)
    assert any(line.startswith("[on 1/1] done") for line in said)
    # Today's router sends no route report: recorded as such.
    assert all(t["route"] is None and t["prefill_choice"] is None for t in turns)
    assert summary["on"]["routes"] == {"unreported": 6}
    assert summary["off"]["decode_computed_tokens"] == 0.0


async def test_every_mode_runs_through_a_router_of_its_own_as_its_client() -> None:
    router = FakeRouter(routes=True)
    router.forgotten = {"bench-stock-cond-r0-a1"}  # the decode evicted this one's history
    settings = AgentBenchSettings(agents=2, turns=3, system_tokens=20, message_tokens=(5, 5),
                                  modes=PLAIN_MODES, progress_interval_s=0,
                                  sample_interval_s=3600.0, repeats=1,
                                  router_args=("--log-level", "debug"))

    async def instant(seconds: float) -> None:
        await asyncio.sleep(0)

    said: list[str] = []
    routers = Routers(router.handle)
    results = await measure(settings, routers, "kvturn-tiny", FakeProbe(router),
                            say=said.append, sleep=instant)
    # A router per run, started with the mode's flags and --router-arg's; the warm-up's first
    # reads its second turn from the decode into the prefill.
    debug = ("--log-level", "debug")
    cond = ("--no-kv-reuse", "--conditional-disagg")
    assert routers.started == [
        ("router-warm-up", (*debug, "--decode-continue-tokens", "0")),
        ("router-off-r0", ("--no-kv-reuse", *debug)),
        ("router-stock-cond-r0", (*cond, "512", *debug)),
        ("router-stock-cond-2k-r0", (*cond, "2048", *debug)),
        ("router-on-r0", debug)]
    assert "[stock-cond 1/1] 2 agents x 3 turns, starting 1 s apart; stock-cond, router " \
           "--no-kv-reuse --conditional-disagg 512 --log-level debug, client ids, plain " \
           "instances" in said
    # The stock-cond modes' clients send X-Conversation-ID and nothing else: one id per agent
    # and run, no body id, no keepalive, no release.
    sent = router.requests[2:]  # after the warm-up's two turns
    by_header: dict[str, list[dict[str, Any]]] = {}
    for request in sent:
        header = request["headers"].get("x-conversation-id")
        if header is not None:
            assert "conversation_id" not in request["body"]
            by_header.setdefault(header, []).append(request)
    assert set(by_header) == {f"bench-{m}-r0-a{a}" for m in ("stock-cond", "stock-cond-2k")
                              for a in (0, 1)}
    assert all(len(requests) == 3 for requests in by_header.values())
    assert not set(by_header) & (set(router.keepalives) | set(router.released))
    turns = results["turns"]
    cond_turns = [t for t in turns if t["mode"] == "stock-cond"]
    assert [t["conversation_id"] for t in cond_turns] == [f"bench-stock-cond-r0-a{a}"
                                                          for a in (0, 1) for _ in range(3)]
    assert {t["reuse"] for t in cond_turns} == {"disabled"}
    assert [t["route"] for t in cond_turns] == ["prefill", "decode", "decode"] * 2
    # What the decode's cache supplied, as vLLM reports it: agent 0's previous prompt, nothing
    # for agent 1.
    assert [t["cached_tokens"] for t in cond_turns[1:3]] == [t["prompt_tokens"]
                                                              for t in cond_turns[0:2]]
    assert [t["cached_tokens"] for t in cond_turns[3:]] == [0, 0, 0]
    assert all(t["cached_tokens"] == 0 for t in turns if t["mode"] == "off")  # new prompts
    modes = results["modes"]
    assert list(modes) == list(PLAIN_MODES) and results["block_size"] == 4
    assert modes["stock-cond"]["decode_turns"] == {
        "later_turns": 4, "turns": 4, "reported": 4, "found_history": 2, "missed_history": 2,
        "prompt_tokens": sum(t["prompt_tokens"] for t in cond_turns if t["turn"] > 1),
        "cached_tokens": sum(t["cached_tokens"] for t in cond_turns if t["turn"] > 1),
        "computed_tokens": sum(t["prompt_tokens"] - t["cached_tokens"] for t in cond_turns
                               if t["turn"] > 1)}
    assert modes["stock-cond-2k"]["decode_turns"]["found_history"] == 4
    assert modes["on"]["decode_turns"]["found_history"] == 4
    assert modes["off"]["decode_turns"]["turns"] == 0
    assert modes["off"]["routes"] == {"prefill": 6}
    # kvturn against every stock mode; the mode table says what ran.
    assert set(results["comparisons"]) == {"off", "stock-cond", "stock-cond-2k"}
    assert results["headline"]["against"] in STOCK_MODES
    assert [m["router_args"] for m in results["mode_table"]] == [
        [*MODES_BY_NAME[m].router_args, *debug] for m in PLAIN_MODES]
    assert "later turns the decode served alone (route decode):" in table(results)


async def test_the_offload_modes_run_on_instances_of_their_own_beside_the_plain_ones() -> None:
    plain, offload = FakeRouter(routes=True), FakeRouter(routes=True, host_tier=True)
    tiered = FakeRouter(routes=True, host_tier=True)
    # Both decodes evicted agent 1's history; only the offload one has it in host memory.
    plain.forgotten = {"bench-stock-cond-r1-a1"}
    offload.forgotten = {"bench-stock-cond-offload-r1-a1"}
    modes = ("off", "stock-cond", "stock-cond-offload", "on", "kvturn-offload")
    settings = AgentBenchSettings(agents=2, turns=3, system_tokens=20, message_tokens=(5, 5),
                                  modes=modes, progress_interval_s=0, sample_interval_s=3600.0,
                                  repeats=2, decode_blocks=100)

    async def instant(seconds: float) -> None:
        await asyncio.sleep(0)

    said: list[str] = []
    routers = {"plain": Routers(plain.handle), "offload": Routers(offload.handle),
               "host-tier": Routers(tiered.handle)}
    results = await measure(settings, routers, "kvturn-tiny",
                            {"plain": FakeProbe(plain), "offload": FakeProbe(offload),
                             "host-tier": FakeProbe(tiered)},
                            say=said.append, sleep=instant)
    # Each profile's instances are warmed up once, then every mode runs on its own profile's
    # instances through a router of its own, in rotated order across both profiles.
    assert [name for name, _ in routers["plain"].started] == [
        "router-warm-up", "router-off-r0", "router-stock-cond-r0", "router-on-r0",
        "router-stock-cond-r1", "router-on-r1", "router-off-r1"]
    assert [name for name, _ in routers["offload"].started] == [
        "router-warm-up-offload", "router-stock-cond-offload-r0", "router-stock-cond-offload-r1"]
    # kvturn's host tier runs on instances of its own: leases a kvturn run leaves must not
    # protect its conversations in the host tier the stock mode then uses.
    assert [name for name, _ in routers["host-tier"].started] == [
        "router-warm-up-host-tier", "router-kvturn-offload-r0", "router-kvturn-offload-r1"]
    assert results["order"] == [*modes, *mode_order(modes, 1)]
    assert "[kvturn-offload 1/2] 2 agents x 3 turns, starting 1 s apart; kvturn-offload, " \
           "router (defaults), client kvturn, host-tier instances" in said
    assert {r["body"].get("conversation_id") or r["headers"].get("x-conversation-id", "")
            for r in offload.requests[2:]} >= {"bench-stock-cond-offload-r0-a0"}
    assert not any("bench-stock-cond-r" in r["headers"].get("x-conversation-id", "")
                   for r in offload.requests)
    # What the instances say: the offload decode loaded agent 1's history from its host tier
    # (found in its cache, by vLLM's own count), the plain one recomputed it.
    m = results["modes"]
    assert m["stock-cond-offload"]["profile"] == "offload" and m["on"]["profile"] == "plain"
    assert m["stock-cond"]["host_tokens"] == 0 and m["stock-cond-offload"]["host_tokens"] > 0
    assert m["stock-cond"]["decode_turns"]["missed_history"] == 1  # repeat 2 only: median
    assert m["stock-cond-offload"]["decode_turns"]["missed_history"] == 0
    assert m["off"]["host_tokens"] == 0 and m["kvturn-offload"]["host_tokens"] == 0
    # The configuration names each profile's modes and host tier.
    instances = results["configuration"]["instances"]
    assert instances["plain"] == {"modes": ["off", "stock-cond", "on"], "host_tier": None}
    tier = instances["offload"]["host_tier"]
    assert instances["offload"]["modes"] == ["stock-cond-offload"]
    assert instances["host-tier"]["modes"] == ["kvturn-offload"]
    assert tier["decode_gib"] == round(2 * 100 * 128 * 2048 / 2 ** 30, 4)  # 50 MiB
    assert tier["prefill_gib"] == 2.0 and tier["multiple_of_device_kv"] == 2.0
    assert tier["offload_extra"] == {"eviction_policy": "lru", "offload_prompt_only": False}
    assert instances["host-tier"]["host_tier"]["offload_extra"] == {}
    assert results["warmup_ttft_ms_by_profile"].keys() == {"plain", "offload", "host-tier"}
    # Both kvturn modes against every stock mode that ran, each headlined against the
    # strongest by the one rule.
    stock = ["off", "stock-cond", "stock-cond-offload"]
    by_mode = results["comparisons_by_mode"]
    assert list(by_mode) == ["on", "kvturn-offload"]
    assert all(list(by_mode[k]) == stock for k in by_mode)
    assert by_mode["kvturn-offload"]["stock-cond-offload"]["mode"] == "kvturn-offload"
    assert by_mode["kvturn-offload"]["stock-cond-offload"]["pooled"]["turns"] == {
        "base": 12, "on": 12}
    assert results["comparisons"] == by_mode["on"]
    heads = results["headlines"]
    assert heads["on"] == results["headline"] and heads["on"]["mode"] == "on"
    assert heads["kvturn-offload"]["against"] == heads["on"]["against"] in stock
    assert [m["profile"] for m in results["mode_table"]] == [
        "plain", "plain", "offload", "plain", "host-tier"]
    text = table(results)
    lines = text.splitlines()
    assert "1 prefill + 1 decode of 100 KV blocks per instance profile, side by side (plain " \
           "for off, stock-cond, on: no host tier; offload for stock-cond-offload: vLLM CPU " \
           "offloading, host tier 2x the device KV: prefill 2.00 GiB (device 1.00 GiB), " \
           "decode 50 MiB (device 25 MiB), eviction_policy lru, offload_prompt_only false; " \
           "host-tier for kvturn-offload: " in lines[0]
    assert any(line.startswith("stock-cond-offload: router --no-kv-reuse --conditional-disagg "
                               "512; client ids; offload instances: stock-cond on instances "
                               "with vLLM's CPU KV offloading") for line in lines)
    assert "host" in lines[next(i for i, x in enumerate(lines) if x.startswith("mode "))]
    assert f"strongest stock mode against kvturn-offload: {heads['on']['against']}" in text
    # (Which stock mode is the strongest depends on the fake's timing.)
    assert all(f"{kvturn} against {base}" in text for base in ("off", "stock-cond",
                                                                 "stock-cond-offload")
               for kvturn in ("kvturn (on)", "kvturn-offload"))
    assert "computed tokens (prefill + decode) kvturn-offload <= stock-cond" in text


async def test_an_on_agent_keeps_its_lease_alive_during_each_tool_gap() -> None:
    router = FakeRouter()
    settings = AgentBenchSettings(agents=1, turns=3, system_tokens=20, message_tokens=(5, 5),
                                  modes=("on",), warmup=False, keepalive_interval_s=0.001,
                                  progress_interval_s=0, sample_interval_s=3600.0, repeats=1)
    gaps_waited = 0

    async def until_a_keepalive(seconds: float) -> None:
        # The gap ends when the SDK has renewed the lease, not after some time.
        nonlocal gaps_waited
        gaps_waited += 1
        router.keepalive_seen.clear()
        await asyncio.wait_for(router.keepalive_seen.wait(), timeout=30)

    routers = Routers(router.handle)
    results = await measure(settings, routers, "kvturn-tiny", FakeProbe(router),
                            say=lambda _: None, sleep=until_a_keepalive)
    (agent,) = results["agents"]
    assert gaps_waited == 2
    assert len(router.keepalives) >= 2 and set(router.keepalives) == {agent["conversation_id"]}
    assert agent["sdk_stats"]["keepalives"] >= 2
    assert agent["sdk_stats"]["keepalive_failures"] == 0
    assert agent["sdk_stats"]["hits"] == 2 and agent["turns_ok"] == 3
    assert router.released == [agent["conversation_id"]]
    assert results["modes"]["on"]["retained_mib"]["samples"] == 2  # at start and at stop


async def test_a_failed_turn_is_recorded_and_stops_that_agent_only() -> None:
    router = FakeRouter()
    settings = AgentBenchSettings(agents=1, turns=3, system_tokens=20, message_tokens=(5, 5),
                                  modes=("off",), warmup=False, progress_interval_s=0,
                                  sample_interval_s=3600.0, repeats=1)
    routers = Routers(failing_turn(router.handle, 2))

    async def instant(seconds: float) -> None:
        await asyncio.sleep(0)

    results = await measure(settings, routers, "kvturn-tiny", FakeProbe(router),
                            say=lambda _: None, sleep=instant)
    turns = results["turns"]
    assert [t["error"] is None for t in turns] == [True, False]
    assert "BadRequestError" in turns[1]["error"]
    assert results["modes"]["off"]["errors"] == 1 and results["modes"]["off"]["turns_ok"] == 1
    assert results["agents"][0]["error"].startswith("turn 2:")


async def test_repeats_rotate_the_modes_and_record_routes_gaps_and_reply_lengths() -> None:
    router = FakeRouter(routes=True)
    settings = AgentBenchSettings(agents=1, turns=3, system_tokens=20, message_tokens=(5, 5),
                                  warmup=False, progress_interval_s=0, sample_interval_s=3600.0,
                                  repeats=3, profile="long", long_reply_tokens=(300, 400),
                                  modes=("off", "on"))
    ticks = 0.0

    def clock() -> float:
        # Every reading is 10 ms after the previous: the gaps between content chunks (one
        # reading each, nothing else reads the clock between two) are exactly 10 ms.
        nonlocal ticks
        ticks += 0.01
        return ticks

    async def instant(seconds: float) -> None:
        await asyncio.sleep(0)

    said: list[str] = []
    routers = Routers(router.handle)
    results = await measure(settings, routers, "kvturn-tiny", FakeProbe(router),
                            say=said.append, sleep=instant, clock=clock)
    assert results["order"] == ["off", "on", "on", "off", "off", "on"]
    assert [line.split()[0:2] for line in said if " done in " in line] == [
        ["[off", "1/3]"], ["[on", "1/3]"], ["[on", "2/3]"], ["[off", "2/3]"], ["[off", "3/3]"],
        ["[on", "3/3]"]]
    turns = results["turns"]
    assert [(t["repeat"], t["mode"]) for t in turns[::3]] == [
        (0, "off"), (0, "on"), (1, "on"), (1, "off"), (2, "off"), (2, "on")]
    # The drawn reply lengths, the same in every run, are what was asked for.
    drawn = results["replies"]["drawn_max_tokens"]["0"]
    assert all(300 <= n <= 400 for n in drawn)
    assert [r["body"]["max_tokens"] for r in router.requests] == drawn * 6
    assert [t["max_tokens"] for t in turns] == drawn * 6
    # The fake replies 6 tokens: every turn came back short, and the summary says so.
    assert results["modes"]["on"]["replies_short"] == 3
    # New words every run: six distinct system prompts.
    assert len({r["body"]["messages"][0]["content"] for r in router.requests}) == 6
    # Inter-token latency: 6 chunks, 5 gaps of 10 ms per turn.
    assert all(t["content_chunks"] == 6 and t["itl_ms"]["n"] == 5 and t["itl_ms"]["p50"]
               == pytest.approx(10.0) and t["itl_ms"]["max"] == pytest.approx(10.0)
               for t in turns)
    on, off = results["modes"]["on"], results["modes"]["off"]
    assert on["itl_ms"]["p99"] == pytest.approx(10.0) and on["itl_ms_pooled"]["n"] == 45
    assert results["comparison"]["itl_ms_p99_on_over_off"] == pytest.approx(1.0)
    assert results["comparison"]["verdict"]["itl_p99_within_10pct"] is True
    # Routes: off always takes a prefill leg (round-robin); on continues turns 2+ on the
    # decode, which then computes their new tokens.
    assert [t["route"] for t in turns if t["mode"] == "on"] == ["prefill", "decode",
                                                                  "decode"] * 3
    assert off["routes"] == {"prefill": 3} and off["prefill_choices"] == {"round-robin": 3}
    assert on["routes"] == {"decode": 2, "prefill": 1}
    # Continued turns count what the decode's cache supplied (their usage), not "pending".
    assert "pending" not in on["reuse"]["outcomes"] and on["reuse"]["reused_tokens"] > 0
    assert on["prefill_choices"] == {"affinity": 1}
    assert off["decode_computed_tokens"] == 0 and on["decode_computed_tokens"] > 0
    assert on["computed_tokens"] == on["prefill_computed_tokens"] + on[
        "decode_computed_tokens"]
    assert [len(results["retained_bytes_at_mode_start"][m]) for m in ("off", "on")] == [3, 3]


def test_router_arguments_reach_every_router_and_the_results() -> None:
    settings = AgentBenchSettings(router_args=("--decode-continue-tokens", "256"))
    assert all(router_args(m, settings)[-2:] == ("--decode-continue-tokens", "256")
               for m in MODES)
    assert settings.describe()["router_args"] == ["--decode-continue-tokens", "256"]


def test_first_turns_are_summarized_apart() -> None:
    off, on = (summarize(run, planned_turns=4) for run in _runs())
    assert off["ttft_ms_turn1"]["n"] == 1 and off["ttft_ms_turn1"]["p50"] == 100.0
    cmp = compare({"off": off, "on": on})
    assert cmp is not None and cmp["ttft_ms_turn1_p50_off_over_on"] == 1.0


def test_the_bootstrap_interval_brackets_the_ratio_and_is_reproducible() -> None:
    rng = random.Random(1)
    a = [rng.uniform(200, 400) for _ in range(60)]
    b = [rng.uniform(50, 100) for _ in range(60)]
    low, high = bootstrap_ratio([a], [b], 0.9)
    assert low is not None and high is not None
    point = percentile(a, 0.9) / percentile(b, 0.9)  # type: ignore[operator]
    assert low <= point <= high and low > 2.5 and high < 6.0
    assert bootstrap_ratio([a], [b], 0.9) == (low, high)
    assert bootstrap_ratio([[]], [b], 0.5) == (None, None)
    with pytest.raises(ValueError, match="2 repeats against 1"):
        bootstrap_ratio([a, a], [b], 0.5)


def test_the_interval_counts_the_spread_between_repeats() -> None:
    """Two identical setups whose repeats differ (one run's timing slower than another's): the
    turns of each repeat alone would give a narrow interval; resampling the repeats first
    widens it to hold the difference between them."""
    rng = random.Random(2)
    a = [[rng.uniform(90, 110) * scale for _ in range(48)] for scale in (1.0, 1.5, 0.8)]
    b = [[rng.uniform(90, 110) * scale for _ in range(48)] for scale in (1.4, 0.9, 1.0)]
    turns_only = bootstrap_ratio([[x for r in a for x in r]], [[x for r in b for x in r]], 0.5)
    clustered = bootstrap_ratio(a, b, 0.5)
    assert None not in turns_only and None not in clustered
    width = [high - low for low, high in (turns_only, clustered)]  # type: ignore[operator]
    assert width[1] > 2 * width[0]


def test_pooled_ratios_pool_every_repeat_and_split_first_turns() -> None:
    runs = _runs(0) + _runs(1, on_scale=2.0)
    pooled = pooled_comparison(runs)
    assert pooled is not None and pooled["turns"] == {"off": 6, "on": 6}
    # off pools 100, 300, 500 twice; on 100, 50, 60 and 200, 100, 120.
    assert pooled["ttft_ms_all_p50_off_over_on"]["ratio"] == pytest.approx(300 / 100)
    assert pooled["ttft_ms_turn1_p50_off_over_on"]["ratio"] == round(100 / 150, 3)
    assert pooled["ttft_ms_turn2plus_p50_off_over_on"]["ratio"] == pytest.approx(400 / 80)
    assert pooled_comparison([r for r in runs if r.mode == "off"]) is None


def test_the_tail_makeup_counts_first_turns_at_or_above_the_on_quantile() -> None:
    makeup = tail_makeup(_runs(0) + _runs(1), 0.9)
    # The on mode's slowest turn is its first (100 ms against 50 and 60).
    assert makeup == {0: {"turns": 1, "first_turns": 1}, 1: {"turns": 1, "first_turns": 1}}


def test_results_carry_the_pooled_verdict() -> None:
    settings = AgentBenchSettings(agents=1, turns=4, repeats=2)
    results = build_results(settings, _runs(0) + _runs(1, on_scale=1.5), machine=AMD)
    cmp = results["comparison"]
    assert cmp["verdict"]["pooled_never_slower"] is True
    assert "pooled over the repeats" in table(results)
    assert "verdict over the pooled turns: kvturn was never slower" in table(results)


# kvturn against every stock mode, and the strongest.

def _mode_run(mode: str, repeat: int, ttfts: tuple[float, ...], prefill: float,
              decode: float) -> ModeRun:
    """One agent's turns in ``mode``: its TTFTs in turn order, the prompt tokens the prefill
    and the decode computed."""
    records = [_record(mode, 0, turn, ttft, 1000 * turn, itl=(20.0,), repeat=repeat,
                       route="prefill" if turn == 1 or mode == "off" else "decode")
               for turn, ttft in enumerate(ttfts, start=1)]
    return ModeRun(mode=mode, wall_s=10.0, records=records, samples=[],
                   agents=[AgentOutcome(mode, 0, None, len(records), repeat=repeat)],
                   prefill_before=PromptSources(0.0, 0.0, 0.0),
                   prefill_after=PromptSources(prefill, 0.0, 0.0),
                   decode_before=PromptSources(0.0, 0.0, 0.0),
                   decode_after=PromptSources(decode, 0.0, 0.0), repeat=repeat)


def _three_baselines() -> list[ModeRun]:
    runs = []
    for repeat in range(2):
        order = mode_order(("off", "stock-cond", "stock-cond-2k", "on"), repeat)
        shapes = {"off": ((300.0, 310.0, 320.0, 330.0), 4000.0, 0.0),
                  "stock-cond": ((300.0, 100.0, 110.0, 120.0), 1500.0, 500.0),
                  # Its later turns are the fastest of the stock modes: the strongest.
                  "stock-cond-2k": ((300.0, 90.0, 95.0, 400.0), 1000.0, 900.0),
                  "on": ((300.0, 100.0, 100.0, 100.0), 1000.0, 500.0)}
        runs += [_mode_run(mode, repeat, *shapes[mode]) for mode in order]
    return runs


def test_kvturn_is_compared_with_every_stock_mode_and_headlined_against_the_strongest() -> None:
    runs = _three_baselines()
    assert strongest_stock(runs) == ("stock-cond-2k", {"off": 320.0, "stock-cond": 110.0,
                                                       "stock-cond-2k": 95.0})
    settings = AgentBenchSettings(agents=1, turns=4, repeats=2, modes=MODES)
    results = build_results(settings, runs, machine=AMD)
    cmps = results["comparisons"]
    assert list(cmps) == ["off", "stock-cond", "stock-cond-2k"]
    assert all(cmps[base]["base"] == base and len(cmps[base]["per_repeat"]) == 2
               for base in cmps)
    # The same ratios against each: turns 2+ p50 320/100, 110/100, 95/100.
    assert [cmps[b]["ttft_ms_turn2plus_p50_base_over_on"] for b in cmps] == [3.2, 1.1, 0.95]
    assert [cmps[b]["computed_base_over_on"] for b in cmps] == [
        pytest.approx(4000 / 1500, abs=1e-3), pytest.approx(2000 / 1500, abs=1e-3),
        pytest.approx(1900 / 1500, abs=1e-3)]
    assert cmps["stock-cond"]["verdict"]["never_slower"] is True
    slower = cmps["stock-cond-2k"]["verdict"]
    assert slower["never_slower"] is False and slower["pooled_never_slower"] is False
    assert {s["ratio"] for s in slower["slower"]} == {"ttft_ms_turn2plus_p50_base_over_on"}
    assert slower["never_slower_checks"] == list(never_slower_checks("base"))
    assert cmps["stock-cond-2k"]["pooled"]["turns"] == {"base": 8, "on": 8}
    assert cmps["stock-cond-2k"]["pooled"]["ttft_ms_turn2plus_p50_base_over_on"][
        "ratio"] == 0.95
    # The headline: against the strongest, with the targets.
    top = results["headline"]
    assert top["against"] == "stock-cond-2k" and top["label"] == "stock-cond-2k"
    assert top["ttft_ms_turn2plus_p50_pooled"]["stock-cond"] == 110.0
    targets = top["targets"]
    assert targets["ttft_never_slower_pooled"]["met"] is True  # all turns: p50, p90, p99
    assert targets["ttft_never_slower_every_repeat"]["met"] is False  # turns 2+ p50
    assert targets["computed_never_more"]["met"] is True
    assert targets["turn2plus_p50_tight"] == {"value": 0.95, "target": 1.3, "at_least": True,
                                              "met": False}
    assert targets["itl_p99_no_worse_pooled"]["met"] is True  # 20 ms gaps everywhere
    # The table: the mode table, the headline, then every baseline, the strongest first.
    text = table(results)
    assert text.index("strongest stock mode: stock-cond-2k, by") < text.index(
        "kvturn (on) against stock-cond-2k, the strongest stock mode:") < \
        text.index("kvturn (on) against off (stock-pd):") < text.index(
            "kvturn (on) against stock-cond:")
    assert "target turns 2+ TTFT p50 stock-cond-2k/on, pooled (tight-decode bar): 0.95 >= " \
           "1.3: NOT met" in text
    assert "verdict: kvturn was SLOWER than stock-cond-2k in 2 of 8 checks: turns 2+ p50 " \
           "stock-cond-2k/on 0.950 (repeat 1)" in text
    assert "stock-cond: 3 of 3 later turns ran on the decode alone (median per repeat); vLLM " \
           "reported no cached tokens for them" in text
    assert "verdict: kvturn was never slower than stock-cond:" in text
    assert "turns 2+ p50 stock-cond/on 1.10 1.10" in " ".join(text.split())
    assert "stock-cond-2k: router --no-kv-reuse --conditional-disagg 2048; client ids" in text


def test_the_old_comparison_is_the_one_against_off_under_its_old_keys() -> None:
    from kvturn_server.bench.agent._summary import LEGACY, against

    runs = _three_baselines()
    settings = AgentBenchSettings(agents=1, turns=4, repeats=2, modes=MODES)
    results = build_results(settings, runs, machine=AMD)
    rows = [rep["comparison"] for rep in results["repeats"]]
    assert results["comparison"] == against(runs, rows, "off", LEGACY)
    assert results["comparison"]["ttft_ms_turn2plus_p50_off_over_on"] == 3.2
    assert "X_off_over_on = off / on" in results["comparison"]["direction"]
    # Without off there is no such comparison; the others stand.
    no_off = [r for r in runs if r.mode in ("stock-cond", "on")]
    results = build_results(replace(settings, modes=("stock-cond", "on")), no_off, machine=AMD)
    assert results["comparison"] is None and set(results["comparisons"]) == {"stock-cond"}
    assert results["headline"]["against"] == "stock-cond"
    # Without kvturn: nothing to compare, nothing to headline.
    results = build_results(replace(settings, modes=("off",)),
                            [r for r in runs if r.mode == "off"], machine=AMD)
    assert results["comparisons"] == {} and results["headline"] is None
    assert results["comparison"] is None and "against" not in table(results)


def test_the_committed_results_of_before_still_print() -> None:
    # docs/bench/agent-session6.json: off and on only, the old keys, no mode table, no headline.
    data = json.loads((REPO / "docs/bench/agent-session6.json").read_text())
    assert "comparisons" not in data
    text = table(data)
    assert "kvturn (on) against off (stock-pd):" in text
    assert "TTFT p50 off/on          3.29 2.79 2.88" in text
    assert "verdict: kvturn was never slower than off" in text
    assert "strongest stock mode" not in text
