"""The trace benchmark without servers: the scaling (prompt sizes, compaction cuts, gaps,
starts, subagents), the words (equal hash ids, equal text), the modes and their router flags,
the instances' KV sizing, the replay through the agent loop against the fleet bench's fake
router, and the summary, comparison, table, plot and command line."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from kvturn_server._cli_common import write_json
from kvturn_server.bench._fleet_agents import Counters, FleetTurn, ModeRun, Sample, run_mode
from kvturn_server.bench.agent._records import AgentOutcome
from kvturn_server.bench.agent._workload import HistoryCut
from kvturn_server.bench.trace import MODES, Scaling, TraceBenchSettings, plan_replay
from kvturn_server.bench.trace._cli import add_trace_bench_parser, settings_from_args
from kvturn_server.bench.trace._plan import (
    instance_blocks,
    kv_statement,
    max_model_len,
    run_order,
)
from kvturn_server.bench.trace._plot import write_plot
from kvturn_server.bench.trace._report import table
from kvturn_server.bench.trace._scale import (
    GENERATION_PROMPT_TOKENS,
    MESSAGE_FRAMING_TOKENS,
    ReplayPlan,
)
from kvturn_server.bench.trace._summary import build_results
from kvturn_server.bench.trace._text import scripts
from kvturn_server.traces import TraceConversation, read_traces
from tests.fakes.bench_router import FleetBenchProbe, FleetBenchRouter, mock_client

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "claude-code"
BS = 64
SYSTEM_IDS = list(range(1, 11))  # 640 tokens of system prompt and tools
MIB = 1024 * 1024


def _call(t: float, blocks: list[int], extra: int, reply: int, think: float = 0.0) -> dict[
        str, Any]:
    return {"t": t, "type": "n", "in": len(blocks) * BS + extra, "out": reply,
            "hash_ids": blocks, "think_time": think}


def _session(path: Path, name: str = "s") -> Path:
    """A session of five calls (plain follow-ups, a 2,000 s gap, a compaction back to the
    system prompt) and a subagent that opens with the same system prompt."""
    first = [*SYSTEM_IDS, *range(11, 16)]
    second = [*first, *range(100, 120)]
    summary = [*SYSTEM_IDS, 50, 51, 52]
    session = {
        "block_size": BS, "system_tokens": 400, "tool_tokens": 240,
        "requests": [
            _call(0.0, first, 30, 250),
            _call(20.0, second, 10, 500, think=10.0),
            {"t": 30.0, "type": "subagent", "agent_id": "a1", "subagent_type": "Explore",
             "system_tokens": 400, "tool_tokens": 240,
             "requests": [_call(0.0, [*SYSTEM_IDS, *range(90, 95)], 5, 100),
                          _call(5.0, [*SYSTEM_IDS, *range(90, 100)], 5, 100, think=3.0)]},
            _call(60.0, [*second, *range(200, 220)], 0, 100, think=30.0),
            # compaction: the history after the system prompt replaced by a summary
            _call(2100.0, summary, 20, 200, think=2000.0),
            _call(2110.0, [*summary, *range(60, 76)], 0, 50, think=5.0),
        ]}
    out = path / f"{name}.json"
    out.write_text(json.dumps(session))
    return out


@pytest.fixture
def traces(tmp_path: Path) -> tuple[TraceConversation, ...]:
    return read_traces([_session(tmp_path)])


SCALE = Scaling(token_divisor=8, time_scale=0.01, max_gap_s=600.0, stagger_s=1.0,
                max_requests=None)


# The scaling.

def test_each_prompt_is_its_trace_prompt_scaled(traces: tuple[TraceConversation, ...]) -> None:
    plan = plan_replay(traces, SCALE)
    session = plan.conversations[0]
    assert session.system_words == 640 // 8
    targets = [round(r.trace.prompt_tokens / 8) for r in session.requests]
    assert [r.target_tokens for r in session.requests] == targets
    # Where the new text can make up the difference, the prompt is exactly the target.
    assert all(r.planned_tokens == r.target_tokens for r in session.requests)
    assert [r.reply_tokens for r in session.requests] == [31, 62, 12, 25, 6]
    # a follow-up's new words are what the target leaves after the history, the reply coming
    # back and the template's framing
    first, second = session.requests[:2]
    history = session.system_words + first.new_words + first.reply_tokens
    assert second.new_words == second.target_tokens - history - 4 * MESSAGE_FRAMING_TOKENS \
        - GENERATION_PROMPT_TOKENS
    assert second.cut is None and second.new_start == round((first.trace.prompt_tokens
                                                             + first.trace.reply_tokens) / 8)


def test_a_compaction_keeps_the_shared_part_and_cuts_the_rest(
        traces: tuple[TraceConversation, ...]) -> None:
    session = plan_replay(traces, SCALE).conversations[0]
    compacted = session.requests[3]
    assert compacted.trace.shrank and not compacted.trace.extends
    # 10 shared blocks = 640 trace tokens = 80 at scale: exactly the system prompt's words
    # and its framing fit, so the cut keeps one message, whole.
    assert compacted.cut == HistoryCut(1, 75)
    assert compacted.new_start == 80 and compacted.planned_tokens == compacted.target_tokens
    assert session.requests[4].cut is None  # the next one extends the compacted prompt


def test_a_cut_inside_a_message_keeps_its_first_words() -> None:
    history = [{"role": "system", "content": "a b c"}, {"role": "user", "content": "d e f g"},
               {"role": "assistant", "content": "h i"}]
    assert HistoryCut(2, 2).apply(history) == [{"role": "system", "content": "a b c"},
                                               {"role": "user", "content": "d e"}]
    assert HistoryCut(3).apply(history) == history
    assert history[1]["content"] == "d e f g"  # the conversation's own messages are left alone
    with pytest.raises(ValueError, match="at least one message"):
        HistoryCut(0)


def test_gaps_are_capped_then_scaled_and_sessions_start_apart(
        traces: tuple[TraceConversation, ...]) -> None:
    session, sub = plan_replay(traces, SCALE).conversations
    assert [r.gap_s for r in session.requests] == pytest.approx([0.0, 0.1, 0.3, 6.0, 0.05])
    assert session.start_s == 0.0
    # The subagent starts at its parent's time: the parent's clock at 30 s, compressed the same
    # way (20 s then 10 s, scaled).
    assert sub.trace.parent == session.cid and sub.start_s == pytest.approx(0.3)
    assert [r.gap_s for r in sub.requests] == pytest.approx([0.0, 0.03])


def test_caps_leave_out_what_they_cut_and_say_why(tmp_path: Path) -> None:
    traces = read_traces([_session(tmp_path, "a"), _session(tmp_path, "b")])
    capped = plan_replay(traces, Scaling(token_divisor=8, max_requests=1))
    assert [c.cid for c in capped.conversations] == ["a", "b"]
    assert all(len(c.requests) == 1 for c in capped.conversations)
    assert "a/a1" in capped.left_out and "request 1, which is not replayed" in \
        capped.left_out["a/a1"]
    few = plan_replay(traces, Scaling(token_divisor=8, conversations=3, stagger_s=2.0))
    assert [c.cid for c in few.conversations] == ["a", "a/a1", "b"]
    assert few.conversations[2].start_s == 2.0  # the second session
    assert few.left_out == {"b/a1": "over the cap of 3 conversations"}


def test_the_scaling_refuses_what_cannot_run() -> None:
    for bad in ({"token_divisor": 0.5}, {"time_scale": 0}, {"max_gap_s": 0},
                {"stagger_s": -1}, {"max_requests": 0}, {"conversations": 0}):
        with pytest.raises(ValueError):
            Scaling(**bad)  # type: ignore[arg-type]


# The words.

def test_equal_hash_ids_give_equal_words_and_runs_never_share(
        traces: tuple[TraceConversation, ...], tmp_path: Path) -> None:
    plan = plan_replay(traces, SCALE)
    session, sub = (p.script for p in scripts(plan, "kvturn", 0, seed=3))
    # both open with the same ten blocks: the same system prompt, word for word
    assert session.system == sub.system and len(session.system.split()) == 80
    assert session.messages[0]["content"] != sub.messages[0]["content"]
    assert all(len(m["content"].split()) == n for m, n in zip(
        session.messages, session.message_words, strict=True))
    for mode, repeat in (("stock-pd", 0), ("kvturn", 1)):
        other = scripts(plan, mode, repeat, seed=3)[0].script
        assert other.system != session.system
    # the same ids in another file are another text (ids compare within a file only)
    elsewhere = plan_replay(read_traces([_session(tmp_path, "other")]), SCALE)
    assert scripts(elsewhere, "kvturn", 0, seed=3)[0].script.system != session.system
    # the same everything is the same text
    assert scripts(plan, "kvturn", 0, seed=3)[0].script == session


def test_the_plan_carries_sizes_gaps_replies_and_cuts(
        traces: tuple[TraceConversation, ...]) -> None:
    plan = plan_replay(traces, SCALE)
    agents = scripts(plan, "kvturn", 0, seed=0)
    assert [a.script.agent for a in agents] == [0, 1]
    session = agents[0]
    assert session.reply_tokens == tuple(r.reply_tokens for r in plan.conversations[0].requests)
    assert session.script.gaps_s == tuple(r.gap_s for r in plan.conversations[0].requests[1:])
    assert session.script.cuts[3] == HistoryCut(1, 75) and session.script.cuts[0] is None
    assert session.script.start_s == 0.0 and agents[1].script.start_s == pytest.approx(0.3)


# Through the agent loop, against the fleet bench's fake router.

async def _replay(mode: str, plan: ReplayPlan, router: FleetBenchRouter) -> ModeRun:
    client = mock_client(router.handle)

    async def instant(seconds: float) -> None:
        await asyncio.sleep(0)

    try:
        return await run_mode(MODES[mode], "trace", 0, 0, scripts(plan, mode, 0, seed=0),
                              client, "kvturn-tiny", FleetBenchProbe(router),
                              keepalive_interval=6.0, sample_interval=3600.0,
                              progress_interval=0, settle_s=0, drain_timeout=1.0,
                              say=lambda _: None, sleep=instant)
    finally:
        await client.close()


def _bodies(router: FleetBenchRouter, key: str) -> dict[str, list[list[dict[str, Any]]]]:
    out: dict[str, list[list[dict[str, Any]]]] = {}
    for q in router.requests:
        cid = q["body"].get("conversation_id") or q["headers"].get(key)
        out.setdefault(cid, []).append(q["body"]["messages"])
    return out


async def test_a_replay_sends_the_real_reply_back_and_cuts_at_a_compaction(
        traces: tuple[TraceConversation, ...]) -> None:
    plan = plan_replay(traces, SCALE)
    router = FleetBenchRouter()
    run = await _replay("kvturn", plan, router)
    assert len(run.records) == 7 and all(r.ok for r in run.records)
    session = next(b for b in _bodies(router, "").values() if len(b) == 5)
    first, second, third, compacted, after = session
    # a follow-up: the previous prompt, the reply exactly as received, the new message
    assert second[:len(first)] == first and second[len(first)] == {
        "role": "assistant", "content": " " + " ".join(f"t{i}" for i in range(31))}
    assert third[:len(second)] == second
    # the compaction: the system prompt's first 75 words, then the new message
    assert len(compacted) == 2 and compacted[0]["content"].split() == \
        first[0]["content"].split()[:75]
    assert after[:2] == compacted and after[2]["role"] == "assistant"


async def test_each_mode_sends_what_its_client_kind_sends(
        traces: tuple[TraceConversation, ...]) -> None:
    plan = plan_replay(traces, SCALE)
    plain, ids = FleetBenchRouter(), FleetBenchRouter()
    await _replay("stock-pd", plan, plain)
    await _replay("stock-cond", plan, ids)
    assert all("x-conversation-id" not in q["headers"] and "conversation_id" not in q["body"]
               for q in plain.requests)
    assert len({q["headers"]["x-conversation-id"] for q in ids.requests}) == 2
    assert all("conversation_id" not in q["body"] for q in ids.requests)


# The modes, the order and the KV sizing.

def test_the_routers_thresholds_scale_with_the_tokens() -> None:
    s = TraceBenchSettings(scaling=Scaling(token_divisor=25), extra_router_args=("--x",))
    assert s.router_args("stock-pd") == ("--no-kv-reuse", "--x")
    assert s.router_args("stock-cond") == ("--no-kv-reuse", "--conditional-disagg", "20", "--x")
    assert s.router_args("stock-cond-2k")[:3] == ("--no-kv-reuse", "--conditional-disagg", "82")
    assert s.router_args("kvturn") == ("--decode-continue-tokens", "82",
                                       "--decode-continue-budget", "164",
                                       "--decode-continue-host-tokens", "164", "--x")
    deployed = TraceBenchSettings(scale_thresholds=False)
    assert deployed.router_args("stock-cond-2k") == ("--no-kv-reuse", "--conditional-disagg",
                                                     "2048")
    assert deployed.router_args("kvturn") == ("--decode-continue-tokens", "2048",
                                              "--decode-continue-budget", "4096",
                                              "--decode-continue-host-tokens", "4096")
    assert {m: (MODES[m].client, MODES[m].profile) for m in MODES} == {
        "stock-pd": ("plain", "plain"), "stock-cond": ("ids", "plain"),
        "stock-cond-2k": ("ids", "plain"), "stock-cond-offload": ("ids", "offload"),
        "stock-cond-2k-offload": ("ids", "offload"),
        "kvturn": ("kvturn", "plain"), "kvturn-offload": ("kvturn", "host-tier"),
        "kvturn-512-offload": ("kvturn", "host-tier")}
    # The offload modes are stock-cond and kvturn as they are, on instances with a host tier.
    assert s.router_args("stock-cond-offload") == s.router_args("stock-cond")
    assert s.router_args("stock-cond-2k-offload") == s.router_args("stock-cond-2k")
    assert s.router_args("kvturn-offload") == s.router_args("kvturn")
    # kvturn at llm-d's threshold: its own flags scaled in place, the defaults after them.
    assert s.router_args("kvturn-512-offload") == ("--decode-continue-tokens", "20",
                                                   "--decode-continue-budget", "41",
                                                   "--decode-continue-host-tokens", "164", "--x")
    assert deployed.router_args("kvturn-512-offload") == (
        "--decode-continue-tokens", "512", "--decode-continue-budget", "1024",
        "--decode-continue-host-tokens", "4096")
    offload = MODES["stock-cond-offload"].stands_for
    assert "llm-d's P2P KV sharing" in offload and "LMCache" in offload
    assert "OffloadingConnector" in offload and "offload_prompt_only false" in offload
    # On request: the defaults start one prefill and one decode.
    assert TraceBenchSettings().modes == ("stock-pd", "stock-cond", "stock-cond-2k", "kvturn")
    assert s.describe()["mode_profiles"] == {m: "plain" for m in TraceBenchSettings().modes}


def test_settings_refuse_unknown_modes_and_the_lease_scales_with_the_gaps() -> None:
    with pytest.raises(ValueError, match="modes must be distinct"):
        TraceBenchSettings(modes=("stock-pd", "stock-pd"))
    with pytest.raises(ValueError, match="modes must be distinct"):
        TraceBenchSettings(modes=("stock-rr",))
    with pytest.raises(ValueError, match="--host-tier"):
        TraceBenchSettings(host_tier_multiple=-1.0)
    with pytest.raises(ValueError, match="without --gpu"):
        TraceBenchSettings(gpu=True, modes=("kvturn-offload",))
    s = TraceBenchSettings(scaling=Scaling(time_scale=0.05))
    assert s.retention_ttl == 24.0 and s.keepalive_interval == 3.0
    assert TraceBenchSettings(retention_ttl_s=10.0).retention_ttl == 10.0


def test_the_order_rotates() -> None:
    s = TraceBenchSettings(modes=("stock-pd", "stock-cond", "kvturn"), repeats=4)
    assert [m for _, m in run_order(s)] == [
        ("stock-pd", "stock-cond", "kvturn"), ("stock-cond", "kvturn", "stock-pd"),
        ("kvturn", "stock-pd", "stock-cond"), ("stock-pd", "stock-cond", "kvturn")]


def test_each_instance_holds_the_deployment_s_kv_scaled(
        traces: tuple[TraceConversation, ...]) -> None:
    plan = plan_replay(traces, SCALE)
    s = TraceBenchSettings(scaling=SCALE)
    # 270k tokens / 8 = 33,750 tokens = 264 blocks of 128
    assert instance_blocks(s, plan) == 264
    assert max_model_len(plan) % 128 == 0 and max_model_len(plan) >= plan.context_tokens()
    small = TraceBenchSettings(scaling=SCALE, real_kv_tokens=1000)
    assert instance_blocks(small, plan) == max_model_len(plan) // 128 + 1  # vLLM's minimum
    kv = kv_statement(s, plan, 264)
    assert kv["capacity_tokens"] == 264 * 128 and kv["real_deployment"]["kv_tokens"] == 270_000
    assert kv["real_deployment"]["holds_100k_conversations"] == 2.7
    assert "an H200" in kv["stands_for"] and "1/8" in kv["stands_for"]


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared Claude Code traces are not here")
def test_the_shared_traces_fit_the_tiny_model_at_the_default_scale() -> None:
    from kvturn_server.local._model import SIZES

    traces = read_traces([SHARED])
    everything = plan_replay(traces, Scaling(max_requests=None))
    assert everything.requests == 580 and not everything.left_out
    assert max_model_len(everything) <= SIZES["tiny"].max_positions
    default = plan_replay(traces, Scaling())
    s = TraceBenchSettings()
    assert default.requests == 9 * 16 and instance_blocks(s, default) == 85
    # neither instance holds every conversation: about four of nine at their longest
    assert kv_statement(s, default, 85)["conversations_an_instance_holds"] < 5
    # the plan meets its targets but where framing and the reply exceed them
    over = [r.planned_tokens - r.target_tokens for c in everything.conversations
            for r in c.requests]
    assert min(over) == 0 and sum(over) / len(over) < 10


# The summary, the comparison, the table, the plot.

def _turn(mode: str, repeat: int, agent: int, turn: int, ttft: float) -> FleetTurn:
    return FleetTurn(scenario="trace", mode=mode, repeat=repeat, agent=agent, turn=turn,
                     conversation_id=None, started_s=float(turn), message_words=5,
                     reply_tokens=4, prompt_tokens=100, completion_tokens=4, ttft_ms=ttft,
                     total_ms=ttft + 50, itl_n=3, itl_p50_ms=10.0, itl_p99_ms=12.0)


def _snap(computed: float, reused: float = 0.0) -> dict[str, Counters | None]:
    return {"prefill0": Counters(computed, 0.0, 0.0, reused),
            "decode0": Counters(computed / 2, 0.0, computed, 0.0)}


def _run(mode: str, repeat: int, ttfts: list[float], computed: float) -> ModeRun:
    records = [_turn(mode, repeat, i % 2, i // 2 + 1, t) for i, t in enumerate(ttfts)]
    return ModeRun(scenario="trace", mode=mode, repeat=repeat, position=0, wall_s=10.0,
                   records=records, agents=[AgentOutcome(mode, 0, None, 2, repeat=repeat)],
                   samples=[Sample(0.0, {"decode0": 0}), Sample(1.0, {"decode0": 2 * MIB})],
                   itl_ms=[10.0, 11.0, 12.0] * len(records), before=_snap(0.0),
                   after=_snap(computed, 50.0 if mode == "kvturn" else 0.0),
                   turns_planned=len(records))


def _results(traces: tuple[TraceConversation, ...]) -> dict[str, Any]:
    plan = plan_replay(traces, Scaling(token_divisor=8, max_requests=2, conversations=2))
    s = TraceBenchSettings(modes=("stock-pd", "stock-cond", "kvturn"), repeats=2,
                           scaling=plan.scaling)
    ttfts = {"stock-pd": [300.0, 310.0, 320.0, 330.0], "stock-cond": [100.0, 110.0, 300.0, 90.0],
             "kvturn": [50.0, 55.0, 300.0, 60.0]}
    computed = {"stock-pd": 1000.0, "stock-cond": 600.0, "kvturn": 400.0}
    runs = [_run(mode, repeat, ttfts[mode], computed[mode])
            for repeat, modes in run_order(s) for mode in modes]
    kv = kv_statement(s, plan, 85)
    return build_results(s, plan, runs, kv, {"cpus": 2, "cpu_model": "test CPU", "amx": False},
                         extra={"order": [list(m) for _, m in run_order(s)]})


def test_the_results_compare_kvturn_with_the_best_stock_mode(
        traces: tuple[TraceConversation, ...], tmp_path: Path) -> None:
    data = _results(traces)
    path = tmp_path / "trace.json"
    write_json(data, path)
    data = json.loads(path.read_text())
    assert data["benchmark"] == "trace" and list(data["modes"]) == ["stock-pd", "stock-cond",
                                                                     "kvturn"]
    kv = data["modes"]["kvturn"]
    assert kv["repeats"] == 2 and kv["turns_ok"] == 8
    assert kv["ttft_p50_ms"]["median"] == 57.5 and kv["ttft_p50_ms"]["per_repeat"] == [57.5, 57.5]
    assert kv["ttft_later_p50_ms"]["median"] == 180.0
    assert kv["computed_tokens"]["median"] == 600.0  # prefill and decode
    assert kv["moved_tokens"]["median"] == 50.0 and kv["retained_mib_max"]["median"] == 2.0
    assert kv["transferred_tokens"]["median"] == 400.0
    cmp = data["comparison"]
    assert cmp["stock_modes"] == ["stock-pd", "stock-cond"]
    # stock-cond is the strongest stock mode (later turns: 195 against 325 ms): 105 / 57.5 ms
    # at p50, 900 / 600 computed tokens
    assert cmp["strongest_stock"] == "stock-cond"
    assert cmp["stock_ttft_later_p50_ms"] == {"stock-pd": 325.0, "stock-cond": 195.0}
    assert cmp["kvturn"]["ttft_p50_ms"]["ratio"] == round(105 / 57.5, 3)
    assert cmp["kvturn"]["computed_tokens"]["ratio"] == 1.5
    pooled = cmp["kvturn"]["pooled"]["ttft_all_p50"]
    assert pooled["stock"] == "stock-cond" and pooled["ratio"] == round(105 / 57.5, 3)
    assert pooled["low"] is not None and pooled["low"] <= pooled["ratio"] <= pooled["high"]
    # the fake turns all say 100 prompt tokens: off the plan by what it planned
    check = data["plan_check"]["kvturn"]
    assert check["turns"] == 8 and check["off_plan"] == 8 and check["max_abs_diff"] > 0
    turn = data["turns"][0]
    assert turn["conversation"] == "s" and turn["trace_request"] == 0
    assert data["plan"]["conversations"][1]["parent"] == "s"
    assert data["kv"]["blocks"] == 85
    assert data["settings"]["mode_router_args"]["stock-cond"] == [
        "--no-kv-reuse", "--conditional-disagg", "64"]
    text = table(data)
    assert "tokens x1/8" in text and "85 blocks x 128" in text and "test CPU" in text
    assert "stands for: a 32B model" in text
    assert "pooled over repeats against stock-cond (95 % CI): TTFT p50 1.83 (" in text
    assert "strongest stock mode: stock-cond, by the stock mode with the lowest TTFT p50 of " \
           "later turns" in text
    assert "stock-cond / kvturn (above 1: kvturn better)" in text
    assert "kvturn 8 of 8 turns off" in text
    latency, tokens = [line.split() for line in text.splitlines()
                       if line.startswith("  kvturn ") and "router" not in line]
    assert latency[:5] == ["kvturn", "8", "0", "58", "[58-58]"] and "180" in latency
    assert tokens[:4] == ["kvturn", "600", "[600-600]", "50"]


def test_every_kvturn_mode_meets_the_strongest_stock_mode_by_one_rule_and_every_other(
        traces: tuple[TraceConversation, ...]) -> None:
    plan = plan_replay(traces, Scaling(token_divisor=8, max_requests=2, conversations=2))
    modes = ("stock-pd", "stock-cond", "stock-cond-offload", "kvturn", "kvturn-offload")
    s = TraceBenchSettings(modes=modes, repeats=2, scaling=plan.scaling)
    # stock-pd has the fastest first turns (and TTFT p50 of all turns), stock-cond-offload the
    # fastest later turns: the latter is the strongest, and every ratio is against it.
    ttfts = {"stock-pd": [50.0, 50.0, 320.0, 330.0],
             "stock-cond": [400.0, 400.0, 150.0, 160.0],
             "stock-cond-offload": [400.0, 400.0, 100.0, 110.0],
             "kvturn": [400.0, 400.0, 100.0, 100.0],
             "kvturn-offload": [400.0, 400.0, 50.0, 50.0]}
    runs = [_run(mode, repeat, ttfts[mode], 600.0) for repeat, order in run_order(s)
            for mode in order]
    for run in runs:
        if run.mode.endswith("-offload"):
            decode = run.after["decode0"]
            assert decode is not None
            run.after["decode0"] = Counters(decode.computed, 0.0, decode.transferred, 0.0, 256.0)
    fleet = {"profiles": {"plain": {"host_tier": None}, "offload": {"host_tier": {
        "prefill_gib": 0.0415, "decode_gib": 0.0415, "prefill_device_kv_gib": 0.0208,
        "decode_device_kv_gib": 0.0208, "multiple_of_device_kv": 2.0,
        "offload_extra": {"eviction_policy": "lru", "offload_prompt_only": False}}},
        "host-tier": {"host_tier": {
            "prefill_gib": 0.0415, "decode_gib": 0.0415, "prefill_device_kv_gib": 0.0208,
            "decode_device_kv_gib": 0.0208, "multiple_of_device_kv": 2.0,
            "offload_extra": {}}}}}
    data = build_results(s, plan, runs, kv_statement(s, plan, 85), {"cpus": 2},
                         extra={"fleet": fleet})
    cmp = data["comparison"]
    assert cmp["strongest_stock"] == "stock-cond-offload"
    assert cmp["stock_ttft_later_p50_ms"] == {"stock-pd": 325.0, "stock-cond": 155.0,
                                              "stock-cond-offload": 105.0}
    off = cmp["kvturn-offload"]
    assert off["pooled"]["ttft_all_p50"]["stock"] == "stock-cond-offload"  # not stock-pd
    assert off["pooled"]["ttft_later_p50"]["ratio"] == round(105 / 50, 3)
    assert off["ttft_later_p50_ms"]["per_repeat"]["per_repeat"] == [2.1, 2.1]
    every = off["by_stock_mode"]
    assert list(every) == ["stock-pd", "stock-cond", "stock-cond-offload"]
    assert every["stock-cond"]["ttft_later_p50"]["ratio"] == 3.1
    assert every["stock-pd"]["ttft_all_p50"] == round(185 / 225, 3)
    later = every["stock-cond-offload"]["ttft_later_p50"]
    assert later["low"] <= later["ratio"] <= later["high"]
    assert cmp["kvturn"]["by_stock_mode"]["stock-cond-offload"]["ttft_later_p50"]["ratio"] == 1.05
    m = data["modes"]
    assert m["stock-cond-offload"]["host_tokens"]["median"] == 256.0
    assert m["stock-cond"]["host_tokens"]["median"] == 0.0
    assert [e["profile"] for e in data["mode_table"]] == [
        "plain", "plain", "offload", "plain", "host-tier"]
    text = table(data)
    assert "  offload instances (stock-cond-offload): vLLM CPU offloading, " \
           "host tier 2x the device KV: prefill 42 MiB (device 21 MiB)" in text
    assert "  stock-cond-offload router --no-kv-reuse --conditional-disagg 64; client ids; " \
           "offload instances: stock-cond on instances" in text
    assert "every stock mode / kvturn-offload, pooled: later turns p50 and p90 (95 % CI), all " \
           "turns p50, later p99, ITL p99:" in text
    assert "    stock-cond: 3.10 (" in text
    (tokens,) = [line.split() for line in text.splitlines()
                 if line.startswith("  stock-cond-offload ") and "router" not in line
                 and "256" in line]
    assert tokens[tokens.index("256") + 1] == "[256-256]"


def test_the_plot_is_a_png(traces: tuple[TraceConversation, ...], tmp_path: Path) -> None:
    path = tmp_path / "trace.png"
    assert write_plot(_results(traces), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# The command line.

def test_the_command_line_maps_onto_the_settings(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_trace_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["trace", "a.json", "dir", "--json", str(tmp_path / "t.json")])
    s = settings_from_args(args)
    assert callable(args.func)
    assert s == TraceBenchSettings(traces=(Path("a.json"), Path("dir")),
                                   json_path=tmp_path / "t.json")
    args = parser.parse_args([
        "trace", "x.jsonl", "--json", "t.json", "--modes", "kvturn,stock-pd", "--repeats", "2",
        "--token-divisor", "32", "--time-scale", "0.1", "--max-gap", "0", "--max-requests",
        "0", "--conversations", "4", "--no-scale-thresholds", "--router-arg=--log-level=debug",
        "--vllm-arg=--foo", "--no-warmup"])
    s = settings_from_args(args)
    assert s.modes == ("kvturn", "stock-pd") and s.repeats == 2 and not s.warmup
    assert s.scaling == Scaling(token_divisor=32, time_scale=0.1, max_gap_s=None,
                                max_requests=None, conversations=4)
    assert not s.scale_thresholds and s.extra_router_args == ("--log-level=debug",)
    assert s.vllm_args == ("--foo",)
    with pytest.raises(SystemExit):
        parser.parse_args(["trace", "x", "--json", "t", "--modes", "stock-rr"])
    s = settings_from_args(parser.parse_args([
        "trace", "x", "--json", "t", "--modes", "stock-cond-offload,kvturn-offload",
        "--host-tier", "4"]))
    assert s.modes == ("stock-cond-offload", "kvturn-offload") and s.host_tier_multiple == 4.0
