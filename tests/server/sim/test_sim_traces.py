"""Agent traces replayed at full scale: the trace's prompts, blocks, replies and gaps, subagents
as conversations of their own, compaction, and time-shifted copies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvturn_server.cli import main
from kvturn_server.router._history import Transcript
from kvturn_server.sim import FleetSpec, SimSettings, simulate, standard_policies
from kvturn_server.sim._traces import is_agent_trace, load_conversations, replicate

SHARED = Path(__file__).resolve().parents[3] / ".." / "shared" / "traces" / "claude-code"

# One session (a plain follow-up, then a compaction that keeps the first 2 blocks, then a
# follow-up of that) and a subagent it started.
LINES = [
    {"conversation": "s", "t": 0.0, "prompt_tokens": 6400, "reply_tokens": 100},
    {"conversation": "s", "t": 20.0, "prompt_tokens": 6700, "reply_tokens": 50, "gap_s": 12},
    {"conversation": "a", "parent": "s", "t": 25.0, "prompt_tokens": 3000, "reply_tokens": 40},
    {"conversation": "s", "t": 60.0, "prompt_tokens": 1000, "reply_tokens": 80, "gap_s": 30,
     "shared_tokens": 128},
    {"conversation": "s", "t": 90.0, "prompt_tokens": 1300, "reply_tokens": 60, "gap_s": 20},
]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "agent.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in LINES) + "\n")
    return path


def test_a_trace_becomes_conversations_at_full_scale(trace: Path) -> None:
    assert is_agent_trace(trace) and is_agent_trace(trace.parent)
    by_cid = {c.cid: c for c in load_conversations([trace], block_size=64)}
    assert set(by_cid) == {"agent/s", "agent/a"}
    s, a = by_cid["agent/s"], by_cid["agent/a"]
    assert a.start_s == 25.0 and a.turns == 1
    assert [s.prompt_tokens(i) for i in range(4)] == [6400, 6700, 1000, 1300]
    assert s.replies == (100, 50, 80, 60) and s.gaps_s == (12.0, 30.0, 20.0)
    # History: the previous prompt and reply for a follow-up, the shared prefix after the
    # compaction; the history's version changes there.
    assert [s.history_tokens(i) for i in range(4)] == [0, 6500, 128, 1080]
    assert s.versions == (0, 0, 1, 1)
    assert s.hash_ids is not None and s.hash_ids[2][:2] == s.hash_ids[0][:2]


def test_the_routers_transcript_sees_follow_ups_and_compaction(trace: Path) -> None:
    s = next(c for c in load_conversations([trace], block_size=64) if c.cid == "agent/s")

    def transcript(turn: int) -> Transcript:
        return Transcript([{"role": r, "content": chr(97 + v) * n} for r, n, v in s.chat(turn)])

    assert transcript(1).extends(transcript(0).history())
    assert not transcript(2).extends(transcript(1).history())  # compacted
    assert transcript(3).extends(transcript(2).history())
    # The new message's size is what the trace adds: 6700 - 6400 - 100.
    assert transcript(1).sizes[-1] - transcript(0).sizes[-1] == 200 - 6400


def test_replayed_blocks_are_the_traces(trace: Path) -> None:
    """stock-cond continues the plain follow-ups on the decode (its prefix cache holds the
    trace's blocks); the compacted turn shares 2 blocks and goes through a prefill."""
    conversations = load_conversations([trace], block_size=64)
    result = simulate(SimSettings(fleet=FleetSpec(prefills=1, decodes=1),
                                  policy=standard_policies()["stock-cond"]),
                      conversations).summary()
    assert result["turns"] == 5
    assert result["routes"] == {"prefill": 3, "decode": 2}
    assert result["hit_rate"] == 1.0
    assert result["computed_tokens"] < 6400 + 3000 + 1000 + 2 * 700


def test_copies_are_other_users(trace: Path) -> None:
    one = load_conversations([trace], block_size=64)
    three = replicate(one, 3, 100.0)
    assert len(three) == 6 and len({c.cid for c in three}) == 6
    assert sorted(c.start_s for c in three if c.cid.startswith("agent/s")) == [0, 100, 200]
    assert len({c.scope for c in three}) == 3
    assert replicate(one, 1, 100.0) == one
    with pytest.raises(ValueError, match="copies"):
        replicate(one, 0, 1.0)


def test_block_sizes_must_agree(trace: Path) -> None:
    with pytest.raises(ValueError, match="--block-size 64"):
        load_conversations([trace], block_size=128)


def test_simulate_trace_reports_every_policy(trace: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    assert main(["simulate", "--trace", str(trace), "--trace-copies", "2", "--trace-shift",
                 "30", "--prefills", "1", "--decodes", "1", "--sweep-budgets", "",
                 "--json", str(out), "--quiet"]) == 0
    data: dict[str, Any] = json.loads(out.read_text())
    assert set(data["policies"]) == set(standard_policies())
    assert data["config"]["conversations"] == 4 and data["config"]["turns"] == 10
    assert data["config"]["trace_copies"] == 2 and data["config"]["trace_shift_s"] == 30
    assert "| stock-cond-offload |" in capsys.readouterr().out


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared Claude Code traces are not here")
def test_the_shared_claude_code_traces_replay() -> None:
    conversations = load_conversations([SHARED / "trace_0019.json"], block_size=64)
    assert len(conversations) == 1 and conversations[0].turns == 24
    assert max(conversations[0].prompts or ()) > 30000
    result = simulate(SimSettings(policy=standard_policies()["kvturn-lease"]),
                      conversations).summary()
    assert result["turns"] == 24 and result["hit_rate"] is not None


def test_the_simulators_own_formats_still_load(tmp_path: Path) -> None:
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"id": "x", "turns": [
        {"input_tokens": 10, "output_tokens": 3, "gap_s": 7.5},
        {"input_tokens": 20, "output_tokens": 4}]}) + "\n")
    multi = tmp_path / "multi.json"
    multi.write_text(json.dumps([{"id": "m", "messages": [
        {"role": "user", "content": "u" * 40}, {"role": "assistant", "content": "r" * 8}]}]))
    assert not is_agent_trace(own) and not is_agent_trace(multi)
    loaded = load_conversations([own, multi], block_size=64)
    assert {c.cid for c in loaded} == {"x", "m"}
    assert all(c.hash_ids is None for c in loaded)
