"""The fleet benchmark without servers: the mode table, the plan (scripts, reply lengths, order,
KV sizing), the statistics and the results document, and the agents against an in-process fake
router speaking each mode's headers."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvturn_server._cli_common import write_json
from kvturn_server.bench._fleet import add_fleet_bench_parser, fleet_config, settings_from_args
from kvturn_server.bench._fleet_agents import (
    Counters,
    FleetTurn,
    HttpFleetProbe,
    ModeRun,
    Sample,
    run_mode,
)
from kvturn_server.bench._fleet_plan import (
    DEFAULT_MODES,
    IDS,
    KVTURN,
    MODE_TABLE,
    MODES,
    PLAIN,
    FleetBenchSettings,
    Scenario,
    rotated,
    run_order,
    scenarios,
)
from kvturn_server.bench._fleet_report import (
    aggregate,
    build_results,
    compare,
    scenario_result,
    spread,
    summarize,
    table,
    turn2plus_p50,
    write_plot,
)
from kvturn_server.bench._profiles import CPU_BLOCK_SIZE
from kvturn_server.bench.agent._records import AgentOutcome
from kvturn_server.local import free_port
from tests.fakes.bench_router import FleetBenchProbe, failing_turn, mock_client
from tests.fakes.bench_router import FleetBenchRouter as FakeRouter

MIB = 1024 * 1024


# The mode table: the router's flags and the client, as issue 12's contract has them, and the
# stock conditional disaggregation of issue 25.

def test_the_mode_table_maps_each_mode_to_its_router_flags_and_client() -> None:
    table_ = {m.name: (m.router_args, m.client, m.profile) for m in MODE_TABLE}
    cond = ("--no-kv-reuse", "--conditional-disagg")
    assert table_ == {
        "stock-rr": (("--no-kv-reuse", "--prefill-policy", "round-robin"), PLAIN, "plain"),
        "stock-affinity": (("--no-kv-reuse", "--prefill-policy", "affinity"), IDS, "plain"),
        "stock-cond": ((*cond, "512", "--prefill-policy", "kv-aware"), IDS, "plain"),
        "stock-cond-2k": ((*cond, "2048", "--prefill-policy", "kv-aware"), IDS, "plain"),
        "stock-cond-offload": ((*cond, "512", "--prefill-policy", "kv-aware"), IDS, "offload"),
        "kvturn-ll": (("--prefill-policy", "least-loaded"), KVTURN, "plain"),
        "kvturn-kv": ((), KVTURN, "plain"),
        "kvturn-offload": ((), KVTURN, "host-tier"),
    }
    offload = MODES["stock-cond-offload"].stands_for
    assert "llm-d's P2P KV sharing" in offload and "LMCache" in offload
    assert "OffloadingConnector" in offload and "offload_prompt_only false" in offload
    assert not MODES["stock-cond-offload"].by_default and not MODES["kvturn-offload"].by_default
    assert all(m.stands_for for m in MODE_TABLE)
    assert "prefix-based-pd-decider" in MODES["stock-cond"].stands_for
    assert "Dynamo" in MODES["stock-cond-2k"].stands_for
    # stock-cond by default, at Dynamo's threshold on request.
    assert DEFAULT_MODES == ("stock-rr", "stock-affinity", "stock-cond", "kvturn-ll",
                             "kvturn-kv")
    assert FleetBenchSettings().modes == DEFAULT_MODES


def test_router_args_add_decode_continue_to_kvturn_modes_only() -> None:
    s = FleetBenchSettings(decode_continue_tokens=0)
    assert s.router_args("stock-rr") == ("--no-kv-reuse", "--prefill-policy", "round-robin")
    assert s.router_args("stock-cond")[:3] == ("--no-kv-reuse", "--conditional-disagg", "512")
    assert s.router_args("kvturn-kv") == ("--decode-continue-tokens", "0")
    assert s.router_args("kvturn-ll") == ("--prefill-policy", "least-loaded",
                                          "--decode-continue-tokens", "0")
    assert FleetBenchSettings().router_args("kvturn-kv") == ()


def test_settings_refuse_unknown_or_repeated_choices() -> None:
    for bad in ({"modes": ("stock-rr", "stock-rr")}, {"modes": ("fast",)},
                {"profiles": ("chat",)}, {"sizings": ("huge",)}, {"repeats": 0},
                {"prefills": 0}, {"message_tokens": (300, 100)}, {"prefill_holds": 0.0},
                {"decode_continue_tokens": -1}, {"host_tier_multiple": 0.0},
                {"gpu": True, "modes": ("stock-cond-offload", "kvturn-kv")}):
        with pytest.raises(ValueError):
            FleetBenchSettings(**bad)  # type: ignore[arg-type]
    s = FleetBenchSettings(time_scale=0.1)
    assert s.retention_ttl == 48.0 and s.keepalive_interval == 6.0
    assert FleetBenchSettings(time_scale=0.01).retention_ttl == 30.0


# Order.

def test_the_order_rotates_so_that_every_mode_sits_in_every_position() -> None:
    modes = tuple(MODES)
    assert rotated(modes, 0) == modes
    assert rotated(modes, 1) == (*modes[1:], modes[0])
    assert rotated(modes, len(modes)) == modes
    order = run_order(FleetBenchSettings(modes=modes, repeats=len(modes)))
    assert [r for r, _ in order] == list(range(len(modes)))
    for position in range(len(modes)):
        assert {o[position] for _, o in order} == set(modes)
    assert all(sorted(o) == sorted(modes) for _, o in order)


# The plan.

def _scenario(**kw: Any) -> Scenario:
    kw = {"agents": 4, "profiles": ("tool",), "sizings": ("tight",), **kw}
    return scenarios(FleetBenchSettings(**kw))[0]


def test_runs_share_sizes_gaps_starts_and_replies_but_never_words() -> None:
    sc = _scenario(profiles=("long",))
    a, again = sc.agents("kvturn-kv", 0), sc.agents("kvturn-kv", 0)
    assert a == again
    others = [sc.agents("stock-rr", 0), sc.agents("kvturn-kv", 1)]
    for other in others:
        for x, y in zip(a, other, strict=True):
            assert (x.script.message_words, x.script.gaps_s, x.script.start_s, x.reply_tokens) \
                == (y.script.message_words, y.script.gaps_s, y.script.start_s, y.reply_tokens)
            assert x.script.system != y.script.system
    assert a[0].script.mode == "kvturn-kv" and others[0][0].script.mode == "stock-rr"
    for plan in a:
        assert len(plan.reply_tokens) == 4 == len(plan.script.messages)
        assert all(300 <= n <= 1000 for n in plan.reply_tokens)
        assert len(plan.script.system.split()) == 1500
    assert len({p.reply_tokens for p in a}) == 4  # each agent its own draws
    tool = _scenario().agents("kvturn-kv", 0)
    assert all(p.reply_tokens == (64,) * 6 for p in tool)


def test_the_context_and_the_tight_prefill_cache_follow_the_conversations() -> None:
    sc = _scenario(prefill_holds=2.0)
    contexts = sc.contexts()
    plan = sc.agents("kvturn-kv", 0)[0]
    assert contexts[0] == plan.context_tokens() == (
        2500 + 12 + sum(plan.script.message_words) + 6 * 64 + 2 * 12 * 6)
    assert sc.max_model_len % CPU_BLOCK_SIZE == 0 and sc.max_model_len > max(contexts)
    mean = sum(contexts) / len(contexts)
    assert sc.prefill_num_blocks == math.ceil(2 * mean / CPU_BLOCK_SIZE)
    # Never below one longest request (vLLM refuses to start otherwise).
    assert _scenario(prefill_holds=0.1).prefill_num_blocks == sc.max_model_len // 128 + 1
    assert _scenario(sizings=("roomy",)).prefill_num_blocks is None
    with pytest.raises(ValueError, match="context"):
        _scenario(turns=40)


def test_the_kv_statement_gives_the_ratio_and_the_deployment_it_stands_for() -> None:
    sc = _scenario(agents=12, prefills=2)
    mean = sum(sc.contexts()) / 12
    kv = sc.kv_statement(66)
    assert kv["prefill_capacity_tokens"] == 66 * 128
    assert kv["conversations_a_prefill_holds"] == pytest.approx(66 * 128 / mean, abs=0.01)
    assert kv["active_per_prefill"] == 6.0
    assert kv["held_over_active_per_prefill"] == pytest.approx(66 * 128 / mean / 6, abs=1e-3)
    assert kv["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 4  # tiny: 2 layers, 2 KV heads, fp32
    assert "32B" in kv["stands_for"] and "serving 6 concurrent agents" in kv["stands_for"]
    roomy = sc.kv_statement(4096)
    assert roomy["held_over_all_active"] > 1 and "fits on each prefill" in roomy["stands_for"]


def test_the_fleet_config_of_a_scenario(tmp_path: Path) -> None:
    s = FleetBenchSettings(state_dir=tmp_path, prefills=3, decodes=2, time_scale=0.2)
    sc = scenarios(s)[0]
    cfg = fleet_config(s, sc)
    assert (cfg.prefills, cfg.decodes) == (3, 2)
    assert cfg.prefill_prefix_caching and cfg.prefill_num_blocks == sc.prefill_num_blocks
    assert cfg.max_model_len == sc.max_model_len and cfg.decoder_kv_blocks_ttl == 96.0
    assert cfg.state_dir == tmp_path / "tool-tight"
    assert cfg.model_path == tmp_path / "models" / "tiny"  # shared by every scenario
    # Every reply's usage says what the serving instance's cache supplied.
    assert cfg.extra_vllm_args == ("--enable-prompt-tokens-details",)
    gpu = FleetBenchSettings(state_dir=tmp_path, vllm_args=("--gpu-memory-utilization=0.28",))
    assert fleet_config(gpu, scenarios(gpu)[0]).extra_vllm_args == (
        "--enable-prompt-tokens-details", "--gpu-memory-utilization=0.28")


# Statistics and the document.

def _turn(mode: str, agent: int, turn: int, ttft: float | None, reused: int = 0,
          route: str | None = None, error: str | None = None) -> FleetTurn:
    return FleetTurn(scenario="tool/tight", mode=mode, repeat=0, agent=agent, turn=turn,
                     conversation_id=None, started_s=float(turn), message_words=100,
                     reply_tokens=64, prompt_tokens=1000 * turn, completion_tokens=64,
                     ttft_ms=ttft, total_ms=None if ttft is None else ttft + 500,
                     reuse="hit" if reused else "miss", reused_tokens=reused, route=route,
                     error=error)


def _snap(p0: float, p1: float, d0: float, reused: float = 0.0,
          host: float = 0.0) -> dict[str, Counters | None]:
    return {"prefill0": Counters(p0, 10.0, 0.0, reused), "prefill1": Counters(p1, 0.0, 0.0, 0.0),
            "decode0": Counters(d0, 0.0, 5.0 + host, 0.0, host)}


def _run(mode: str, repeat: int, ttfts: list[float], computed: float, reused: float = 0.0,
         held: list[int | None] | None = None, host: float = 0.0) -> ModeRun:
    records = [_turn(mode, 0, i + 1, t, reused=int(reused) // len(ttfts)) for i, t in
               enumerate(ttfts)]
    for r in records:
        r.repeat = repeat
    samples = [Sample(float(i), {"decode0": h}) for i, h in enumerate(held or [0])]
    return ModeRun(scenario="tool/tight", mode=mode, repeat=repeat, position=0, wall_s=10.0,
                   records=records,
                   agents=[AgentOutcome(mode, 0, None, len(records), repeat=repeat)],
                   samples=samples, itl_ms=[10.0, 20.0, 30.0, 40.0, 1000.0],
                   before=_snap(100.0, 200.0, 3.0, host=7.0),
                   after=_snap(100.0 + computed * 0.75, 200.0 + computed * 0.25, 3.0 + 2,
                               reused, host=7.0 + host),
                   turns_planned=len(records), router_args=("--x",))


def test_a_run_summary_sums_computed_tokens_over_every_instance() -> None:
    run = _run("kvturn-kv", 0, [100.0, 200.0, 300.0], computed=4000.0, reused=3000.0,
               held=[0, 2 * MIB, 4 * MIB, None])
    run.records.append(_turn("kvturn-kv", 0, 4, None, error="APIError: boom"))
    run.records[1].route, run.records[1].prefill_choice = "prefill", "holder"
    s = summarize(run)
    assert s["turns_ok"] == 3 and s["errors"] == 1 and s["turns_per_s"] == 0.3
    assert s["ttft_ms"]["p50"] == 200.0 and s["ttft_ms_turn2plus"]["p50"] == 250.0
    assert s["computed_tokens"]["total"] == 4002.0  # both prefills and the decode
    assert s["computed_tokens"]["prefills"] == 4000.0
    assert s["computed_by_instance"] == {"decode0": 2.0, "prefill0": 3000.0,
                                         "prefill1": 1000.0}
    assert s["reused_tokens"] == {"prefill_metric": 3000.0, "headers": 3000,
                                  "by_prefill": {"prefill0": 3000.0, "prefill1": 0.0}}
    assert s["retained_mib"]["max"] == 4.0 and s["retained_mib"]["samples"] == 3
    assert s["retained_mib"]["max_by_decode"] == {"decode0": 4.0}
    assert s["itl_ms"]["n"] == 5 and s["itl_ms"]["p50"] == 30.0
    assert s["itl_ms"]["p99"] == pytest.approx(961.6)
    assert s["routes"] == {"prefill": 1, "unreported": 2}
    assert s["prefill_choices"] == {"holder": 1, "unreported": 2}
    assert s["router_args"] == ["--x"]
    assert s["host_tokens"] == {"total": 0.0, "by_instance": {
        "decode0": 0.0, "prefill0": 0.0, "prefill1": 0.0}}
    s = summarize(_run("stock-cond-offload", 0, [100.0], computed=1000.0, host=640.0))
    assert s["host_tokens"]["total"] == 640.0 and s["host_tokens"]["by_instance"]["decode0"] == 640


def test_an_unreadable_instance_makes_the_fleet_sum_unknown_not_smaller() -> None:
    run = _run("stock-rr", 0, [100.0], computed=1000.0)
    run.after["prefill1"] = None
    s = summarize(run)
    assert s["computed_tokens"]["total"] is None
    assert s["computed_by_instance"]["prefill1"] is None


def test_spread_and_aggregate_give_median_and_range_per_mode_in_table_order() -> None:
    assert spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                             "values": [3.0, None, 1.0, 2.0]}
    assert spread([None])["median"] is None
    runs = [summarize(_run(m, r, [t * (r + 1)], 1000.0)) for m, t in
            (("kvturn-kv", 50.0), ("stock-rr", 100.0)) for r in range(3)]
    modes = aggregate(runs)
    assert list(modes) == ["stock-rr", "kvturn-kv"]
    assert modes["stock-rr"]["ttft_p50_ms"] == {"median": 200.0, "min": 100.0, "max": 300.0,
                                                "values": [100.0, 200.0, 300.0]}
    assert modes["kvturn-kv"]["repeats"] == 3 and modes["kvturn-kv"]["turns_ok"] == 3


def _scenario_runs() -> list[ModeRun]:
    out = []
    for r in range(2):
        out += [_run("stock-rr", r, [400.0, 500.0], 9000.0),
                _run("stock-affinity", r, [300.0 + 100 * r, 350.0], 6000.0),
                _run("kvturn-ll", r, [200.0, 250.0], 4000.0, 2000.0),
                _run("kvturn-kv", r, [100.0, 150.0], 3000.0, 3000.0, held=[0, 8 * MIB])]
    return out


def test_the_comparison_names_the_strongest_stock_mode_and_checks_the_targets() -> None:
    raw = _scenario_runs()
    runs = [summarize(r) for r in raw]
    modes = aggregate(runs)
    # Turns 2+ pooled over both repeats: stock-rr 500 and 500, stock-affinity 350 and 350.
    p50 = turn2plus_p50(raw)
    assert p50 == {"stock-rr": 500.0, "stock-affinity": 350.0}
    cmp = compare(modes, runs, "tight", p50)
    assert cmp is not None and cmp["stock_modes"] == ["stock-rr", "stock-affinity"]
    assert cmp["strongest_stock"] == "stock-affinity"
    assert cmp["stock_ttft_turn2plus_p50_ms"] == p50 and "turns 2+" in cmp["strongest_by"]
    # Without the pooled figures: the medians over the repeats, the same mode here.
    assert (compare(modes, runs, "tight") or {})["strongest_stock"] == "stock-affinity"
    kv = cmp["kvturn-kv"]
    # stock-affinity's TTFT p50: 325 and 375 ms over the repeats (median 350), against 125.
    assert kv["ttft_p50_ms"]["ratio"] == pytest.approx(350.0 / 125.0, abs=1e-3)
    assert kv["ttft_p50_ms"]["per_repeat"]["values"] == [pytest.approx(2.6),
                                                         pytest.approx(3.0)]
    assert kv["computed_tokens"]["ratio"] == pytest.approx(6002.0 / 3002.0, abs=1e-3)
    assert kv["turns_per_s"]["ratio"] == 1.0
    targets = cmp["issue12_targets"]
    assert targets["ttft_p50_not_worse"]["met"] and targets["computed_not_worse"]["met"]
    assert targets["ttft_p50_tight"]["met"] and targets["ttft_p50_tight"]["target"] == 1.5
    assert "ttft_p50_tight" not in (compare(modes, runs, "roomy") or {})["issue12_targets"]
    assert compare({"kvturn-kv": modes["kvturn-kv"]}, runs, "tight") is None


def test_the_strongest_stock_mode_is_the_fastest_on_later_turns_and_every_ratio_is_its() -> None:
    # stock-cond's later turns are the fastest, its first turns the slowest: its TTFT p50 over
    # all turns (530 ms) is worse than stock-rr's (200), yet it is the stronger baseline, and
    # every ratio, TTFT p50 of all turns included, is against it.
    raw = []
    for r in range(2):
        raw += [_run("stock-rr", r, [100.0, 200.0, 200.0, 200.0], 9000.0),
                _run("stock-cond", r, [900.0, 150.0, 160.0, 900.0], 5000.0),
                _run("kvturn-kv", r, [100.0, 100.0, 100.0, 100.0], 4000.0)]
    runs = [summarize(run) for run in raw]
    modes = aggregate(runs)
    p50 = turn2plus_p50(raw)
    assert p50 == {"stock-rr": 200.0, "stock-cond": 160.0}
    cmp = compare(modes, runs, "tight", p50)
    assert cmp is not None and cmp["strongest_stock"] == "stock-cond"
    assert cmp["kvturn-kv"]["ttft_p50_ms"]["ratio"] == pytest.approx(5.3)
    assert cmp["kvturn-kv"]["ttft_p50_ms"]["per_repeat"]["values"] == [5.3, 5.3]
    assert cmp["kvturn-kv"]["computed_tokens"]["ratio"] == pytest.approx(5002 / 4002, abs=1e-3)


def test_offload_modes_report_their_instances_host_tokens_and_every_stock_ratio(
        tmp_path: Path) -> None:
    modes = ("stock-rr", "stock-cond", "stock-cond-offload", "kvturn-kv", "kvturn-offload")
    settings = FleetBenchSettings(agents=1, repeats=2, modes=modes, host_tier_multiple=3.0)
    assert settings.describe()["host_tier_multiple"] == 3.0
    raw = []
    for r in range(2):
        raw += [_run("stock-rr", r, [400.0, 500.0], 9000.0),
                _run("stock-cond", r, [400.0, 300.0], 6000.0),
                # The host tier gives stock-cond-offload the fastest later turns: the strongest.
                _run("stock-cond-offload", r, [400.0, 200.0], 5000.0, host=900.0),
                _run("kvturn-kv", r, [300.0, 150.0], 4000.0, 2000.0),
                _run("kvturn-offload", r, [300.0, 100.0], 4000.0, 2000.0, host=300.0)]
    sc = scenarios(settings)[0]
    fleet = {"prefills": 2, "decodes": 1, "model": "tiny", "max_model_len": 4480,
             "retention_budget": 0.5, "decoder_kv_blocks_ttl": 48.0, "profiles": {
                 "plain": {"host_tier": None},
                 "offload": {"host_tier": {
                     "prefill_gib": 0.0484, "decode_gib": 3.0, "prefill_device_kv_gib": 0.0161,
                     "decode_device_kv_gib": 1.0, "multiple_of_device_kv": 3.0,
                     "offload_extra": {"eviction_policy": "lru",
                                       "offload_prompt_only": False}}},
                 "host-tier": {"host_tier": {
                     "prefill_gib": 0.0484, "decode_gib": 3.0, "prefill_device_kv_gib": 0.0161,
                     "decode_device_kv_gib": 1.0, "multiple_of_device_kv": 3.0,
                     "offload_extra": {}}}}}
    doc = scenario_result(sc.name, {"name": "tool", "reply_tokens": [64, 64], "turns": 6,
                                    "system_tokens": 2500, "message_tokens": [100, 300],
                                    "what": "tool calls"}, "tight", sc.kv_statement(66), fleet,
                          [list(modes)] * 2, raw)
    data = build_results(settings, [doc], raw)
    assert [m["profile"] for m in data["mode_table"]] == [
        "plain", "plain", "offload", "plain", "host-tier"]
    (s,) = data["scenarios"]
    assert s["modes"]["stock-cond-offload"]["host_tokens"]["median"] == 900.0
    assert s["modes"]["stock-cond"]["host_tokens"]["median"] == 0.0
    cmp = s["comparison"]
    assert cmp["strongest_stock"] == "stock-cond-offload"
    assert cmp["stock_ttft_turn2plus_p50_ms"] == {"stock-rr": 500.0, "stock-cond": 300.0,
                                                  "stock-cond-offload": 200.0}
    # Both kvturn modes against the strongest, and against every stock mode that ran.
    off = cmp["kvturn-offload"]
    assert off["ttft_turn2plus_p50_ms"]["ratio"] == 2.0
    assert list(off["by_stock_mode"]) == ["stock-rr", "stock-cond", "stock-cond-offload"]
    assert off["by_stock_mode"]["stock-cond"]["ttft_turn2plus_p50_ms"] == 3.0
    assert cmp["kvturn-kv"]["by_stock_mode"]["stock-cond-offload"]["ttft_turn2plus_p50_ms"] \
        == round(200 / 150, 3)
    text = table(data)
    assert "  plain instances (stock-rr, stock-cond, kvturn-kv): no host tier" in text
    assert "  offload instances (stock-cond-offload): vLLM CPU offloading, " \
           "host tier 3x the device KV: prefill 50 MiB (device 16 MiB), decode 3.00 GiB " \
           "(device 1.00 GiB), eviction_policy lru, offload_prompt_only false" in text
    assert "  host-tier instances (kvturn-offload): " in text
    assert "from host" in text
    (work,) = [line.split() for line in text.splitlines()
               if line.startswith("  stock-cond-offload ") and "[" in line and "ms" not in line
               and "prefill0" in line]
    assert work[-4:-2] == ["900", "[900-900]"]  # from host, then retained MiB
    assert "stock-cond-offload / kvturn-offload: TTFT p50 1.50x" in text
    assert "every stock mode / kvturn-offload (medians; TTFT p50, turns 2+ p50, computed): " \
           "stock-rr 2.25, 5.00, 2.25; stock-cond 1.75, 3.00, 1.50; stock-cond-offload 1.50, " \
           "2.00, 1.25" in text


def _results(tmp_path: Path) -> dict[str, Any]:
    settings = FleetBenchSettings(agents=1, repeats=2, seed=5, json_path=tmp_path / "f.json")
    sc = scenarios(settings)[0]
    runs = _scenario_runs()
    doc = scenario_result(sc.name, {"name": "tool", "reply_tokens": [64, 64], "turns": 6,
                                    "system_tokens": 2500, "message_tokens": [100, 300],
                                    "what": "tool calls"}, "tight", sc.kv_statement(66),
                          {"prefills": 2, "decodes": 1, "model": "tiny", "max_model_len": 4480,
                           "retention_budget": 0.5, "decoder_kv_blocks_ttl": 48.0},
                          [["stock-rr", "stock-affinity", "kvturn-ll", "kvturn-kv"]] * 2, runs,
                          extra={"instance_blocks": {"prefill0": 66, "prefill1": 66,
                                                     "decode0": 4096}})
    return build_results(settings, [doc], runs, {"load_average": {"start": [], "end": []}})


def test_the_results_document_states_the_configuration_and_keeps_every_turn(
        tmp_path: Path) -> None:
    path = tmp_path / "out" / "fleet.json"
    write_json(_results(tmp_path), path)
    data = json.loads(path.read_text())
    assert data["benchmark"] == "fleet" and data["seed"] == 5
    assert data["order_rationale"]
    assert [m["mode"] for m in data["mode_table"]] == list(DEFAULT_MODES)
    assert data["mode_table"][0]["router_args"] == ["--no-kv-reuse", "--prefill-policy",
                                                    "round-robin"]
    (s,) = data["scenarios"]
    assert s["scenario"] == "tool/tight" and s["kv"]["prefill_blocks"] == 66
    assert set(s["modes"]) == {"stock-rr", "stock-affinity", "kvturn-ll", "kvturn-kv"}
    assert len(s["runs"]) == 8
    assert s["comparison"]["issue12_targets"]["ttft_p50_tight"]["met"] is True
    assert len(data["turns"]) == 16 and len(data["agents"]) == 8
    assert {"scenario", "mode", "repeat", "t_s", "retained_bytes"} == set(data["samples"][0])
    text = table(data)
    assert "stands for: a 32B model" in text and "prefill0" not in text.split("stands")[0]
    assert "66 blocks x 128" in text and "decode0 4096 blocks" in text
    assert "target ttft_p50_tight: 2.80x >= 1.5: met" in text
    assert "strongest stock mode: stock-affinity, by the stock mode with the lowest TTFT p50 " \
        "of later turns (turns 2+, every repeat's turns pooled)" in text
    assert "stock-affinity / kvturn-kv: TTFT p50 2.80x" in text
    latency, work = [line.split() for line in text.splitlines()
                     if line.startswith("  kvturn-kv ")]
    assert latency[:5] == ["kvturn-kv", "4", "0", "125", "[125-125]"]  # turns, errors, TTFT
    assert work[:3] == ["kvturn-kv", "3002", "[3002-3002]"]  # computed over all instances
    assert "prefill0 2250 prefill1 750" in " ".join(work)


def test_the_table_names_each_mode_s_router_flags(tmp_path: Path) -> None:
    data = build_results(FleetBenchSettings(), [], [])
    assert [m["router_args"] for m in data["mode_table"]][:2] == [
        ["--no-kv-reuse", "--prefill-policy", "round-robin"],
        ["--no-kv-reuse", "--prefill-policy", "affinity"]]
    assert table(data).startswith("stock-rr           router --no-kv-reuse --prefill-policy "
                                  "round-robin; client plain; plain instances: stock P/D")


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "fleet.png"
    assert write_plot(_results(tmp_path), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# The command line.

def test_the_command_line_maps_onto_the_settings(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_fleet_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["fleet", "--json", str(tmp_path / "f.json")])
    s = settings_from_args(args)
    assert callable(args.func)
    assert (s.prefills, s.decodes, s.modes, s.profiles, s.sizings, s.repeats, s.agents) == (
        2, 1, DEFAULT_MODES, ("tool", "long"), ("tight",), 2, 12)
    assert s.decode_continue_tokens is None
    args = parser.parse_args([
        "fleet", "--json", "x.json", "--prefills", "3", "--decodes", "2", "--modes",
        "kvturn-kv,stock-rr", "--profiles", "long,tool", "--kv", "roomy,tight", "--repeats",
        "4", "--turns", "3", "--message-tokens", "50,60", "--decode-continue-tokens", "0"])
    s = settings_from_args(args)
    assert (s.prefills, s.decodes, s.modes, s.profiles, s.sizings) == (
        3, 2, ("kvturn-kv", "stock-rr"), ("long", "tool"), ("roomy", "tight"))
    assert s.turns == 3 and s.message_tokens == (50, 60) and s.decode_continue_tokens == 0
    assert s.profile("long").turns == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["fleet", "--json", "x.json", "--modes", "kvturn-kv,fast"])
    help_text = parser._subparsers._group_actions[0].choices["fleet"].format_help()  # type: ignore[union-attr]
    assert "--prefills" in help_text
    assert "stock-cond: stock conditional disaggregation" in " ".join(help_text.split())
    # argparse may wrap a line after a hyphen.
    assert "stock-cond-2k" in re.sub(r"-\s+", "-", help_text) and "20 runs" in help_text
    flat = " ".join(help_text.split())
    assert "stock-cond-offload: stock-cond on instances with vLLM's CPU KV offloading" in flat
    assert "offload instances; on request)" in flat and "--host-tier" in flat
    s = settings_from_args(parser.parse_args([
        "fleet", "--json", "x.json", "--modes", "stock-cond-offload,kvturn-offload",
        "--host-tier", "1.5"]))
    assert s.modes == ("stock-cond-offload", "kvturn-offload") and s.host_tier_multiple == 1.5


# The agents against a fake router.

async def _run_mode(mode: str, sc: Scenario, router: FakeRouter) -> ModeRun:
    client = mock_client(router.handle)

    async def instant(seconds: float) -> None:
        await asyncio.sleep(0)

    try:
        return await run_mode(MODES[mode], sc.name, 1, 0, sc.agents(mode, 1), client,
                              "kvturn-tiny", FleetBenchProbe(router), keepalive_interval=6.0,
                              sample_interval=3600.0, progress_interval=0, settle_s=0,
                              drain_timeout=1.0, say=lambda _: None, sleep=instant)
    finally:
        await client.close()


@pytest.fixture
def small() -> Scenario:
    return scenarios(FleetBenchSettings(agents=2, turns=3, system_tokens=30,
                                        message_tokens=(5, 8), profiles=("long",),
                                        stagger_s=0.0))[0]


async def test_stock_rr_agents_send_no_conversation_id(small: Scenario) -> None:
    router = FakeRouter()
    run = await _run_mode("stock-rr", small, router)
    assert len(run.records) == 6 and all(r.ok for r in run.records)
    assert all("conversation_id" not in q["body"] and "x-conversation-id" not in q["headers"]
               for q in router.requests)
    assert router.keepalives == [] and router.released == []
    assert {r.prefill_choice for r in run.records} == {"round-robin"}
    assert all(r.conversation_id is None for r in run.records)


@pytest.mark.parametrize("mode", ["stock-affinity", "stock-cond", "stock-cond-2k",
                                  "stock-cond-offload"])
async def test_affinity_and_conditional_agents_send_an_id_header_and_nothing_else(
        small: Scenario, mode: str) -> None:
    router = FakeRouter()
    run = await _run_mode(mode, small, router)
    ids = {q["headers"]["x-conversation-id"] for q in router.requests}
    assert len(ids) == 2 and all(i.startswith(f"fleet-{mode}-r1-a") for i in ids)
    assert all("conversation_id" not in q["body"] for q in router.requests)
    assert router.keepalives == [] and router.released == []  # no SDK conversation
    assert {r.reuse for r in run.records} == {"disabled"}
    assert {r.conversation_id for r in run.records} == ids


async def test_kvturn_agents_are_sdk_conversations_that_pause_and_release(
        small: Scenario) -> None:
    router = FakeRouter()
    run = await _run_mode("kvturn-kv", small, router)
    ids = {r.conversation_id for r in run.records}
    assert len(ids) == 2 and all(i is not None and i.startswith("kvt-") for i in ids)
    assert {q["body"]["conversation_id"] for q in router.requests} == ids
    assert set(router.released) == ids
    assert [r.reuse for r in run.records] == ["miss", "hit", "hit"] * 2
    assert [r.prefill_choice for r in run.records] == ["load", "holder", "holder"] * 2
    assert all(a.sdk_stats is not None and a.sdk_stats["hits"] == 2 for a in run.agents)
    # Counters moved by what the fake computed and read, sampled before and after.
    s = summarize(run)
    assert s["computed_tokens"]["total"] == router.computed
    assert s["reused_tokens"]["prefill_metric"] == router.reused == s["reused_tokens"]["headers"]


async def test_every_turn_asks_for_its_reply_length_and_measures_its_chunks(
        small: Scenario) -> None:
    router = FakeRouter()
    run = await _run_mode("kvturn-ll", small, router)
    plans = small.agents("kvturn-ll", 1)
    asked = [q["body"]["max_tokens"] for q in router.requests]
    assert sorted(asked) == sorted(n for p in plans for n in p.reply_tokens)
    assert all(q["body"]["ignore_eos"] is True and q["body"]["temperature"] == 0
               and q["body"]["stream"] for q in router.requests)
    for r in run.records:
        assert r.completion_tokens == r.reply_tokens and r.itl_n == r.reply_tokens - 1
        assert r.ttft_ms is not None and r.total_ms is not None and r.ttft_ms <= r.total_ms
        assert r.itl_p50_ms is not None and r.itl_p50_ms >= 0
    assert len(run.itl_ms) == sum(r.itl_n for r in run.records)
    # Each next prompt is the previous one plus the reply as received and the next message.
    by_id: dict[str, list[dict[str, Any]]] = {}
    for q in router.requests:
        by_id.setdefault(q["body"]["conversation_id"], []).append(q["body"])
    for bodies in by_id.values():
        first, second = bodies[0]["messages"], bodies[1]["messages"]
        assert second[:len(first)] == first and second[len(first)]["role"] == "assistant"
        assert second[len(first)]["content"].startswith(" t0 t1")


async def test_a_failed_turn_stops_that_agent_only(small: Scenario) -> None:
    router = FakeRouter()
    router.handle = failing_turn(router.handle, 2)  # type: ignore[method-assign]
    run = await _run_mode("stock-rr", small, router)
    failed = [r for r in run.records if not r.ok]
    assert len(failed) == 1 and "400" in (failed[0].error or "")
    # Its agent lost that turn and the ones after it (3 turns each); the other went on.
    assert sum(a.turns_ok for a in run.agents) == 6 - (4 - failed[0].turn)
    assert sorted(a.turns_ok for a in run.agents)[1] == 3
    assert summarize(run)["errors"] == 1


# The probe against instances' real endpoints, served by a thread on loopback.

METRICS_TEXT = """\
# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 1200.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 300.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 40.0
kvturn:reused_tokens_total{engine="0",model_name="m"} 512.0
vllm:cache_config_info{block_size="128",num_gpu_blocks="66",enable_prefix_caching="True",\
engine="0",gpu_memory_utilization="0.92"} 1.0
"""


class _Instance(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/metrics":
            body, kind = METRICS_TEXT.encode(), "text/plain"
        elif self.path == "/kvturn/v1/stats":
            body = json.dumps({"retention": {"held_bytes": 3 * MIB}}).encode()
            kind = "application/json"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_the_http_probe_reads_counters_retention_and_cache_info() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Instance)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        probe = HttpFleetProbe([("prefill0", url), ("gone", gone)],
                               [("decode0", url), ("gone", gone)])
        assert probe.counters() == {"prefill0": Counters(1200.0, 300.0, 40.0, 512.0),
                                    "gone": None}
        assert probe.retained() == {"decode0": 3 * MIB, "gone": None}
        assert probe.cache_info() == {"prefill0": {"block_size": "128", "num_gpu_blocks": "66",
                                                   "enable_prefix_caching": "True"},
                                      "gone": None}
    finally:
        server.shutdown()
        server.server_close()


def test_every_mode_s_flags_make_a_router_the_router_accepts() -> None:
    from kvturn_server.router import add_router_args, router_config_from_args

    configs = {}
    for mode in MODE_TABLE:
        parser = argparse.ArgumentParser()
        add_router_args(parser)
        configs[mode.name] = router_config_from_args(parser.parse_args(
            ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
             *FleetBenchSettings(decode_continue_tokens=0).router_args(mode.name)]))
    assert {m: (c.kv_reuse, c.conditional_disagg) for m, c in configs.items()} == {
        "stock-rr": (False, 0), "stock-affinity": (False, 0), "stock-cond": (False, 512),
        "stock-cond-2k": (False, 2048), "stock-cond-offload": (False, 512),
        "kvturn-ll": (True, 0), "kvturn-kv": (True, 0), "kvturn-offload": (True, 0)}
