"""The trace reader (kvturn_server.traces): the shared agent-trace JSON and kvturn's request
JSONL, the relations between a conversation's requests, and the summary of the project's nine
Claude Code traces (the numbers their README states)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvturn_server.bench._stats import quantile
from kvturn_server.traces import TraceFormatError, read_traces, summarize

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "claude-code"


def _call(t: float, prompt: int, reply: int, ids: list[int], think: float = 0.0) -> dict[str, Any]:
    return {"t": t, "type": "n", "in": prompt, "out": reply, "hash_ids": ids,
            "think_time": think, "api_time": 1.5}


def _session(tmp_path: Path) -> Path:
    """A session: a plain follow-up, a subagent, a compaction, an edit before the end."""
    system = [1, 2, 3]
    session = {
        "id": "s", "block_size": 64, "system_tokens": 100, "tool_tokens": 90,
        "requests": [
            _call(0.0, 4 * 64 + 10, 20, [*system, 4]),
            # extends: every full block of the previous prompt, then the reply and a new message
            _call(10.0, 6 * 64, 30, [*system, 4, 5, 6], think=7.0),
            {"t": 12.0, "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore",
             "requests": [_call(0.0, 3 * 64 + 5, 9, [*system]),
                          _call(4.0, 5 * 64, 9, [*system, 40, 41], think=2.0)]},
            # compaction: back to the system prompt, then a summary
            _call(30.0, 4 * 64, 10, [*system, 7], think=11.0),
            # an edit in the last block: shares all but it, longer
            _call(50.0, 6 * 64, 10, [*system, 8, 9, 10], think=500.0),
        ]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(session))
    return path


def test_shared_json_sessions_and_subagents(tmp_path: Path) -> None:
    parent, sub = read_traces([_session(tmp_path)])
    assert parent.cid == "s" and parent.parent is None and not parent.is_subagent
    assert (parent.system_tokens, parent.tool_tokens) == (100, 90)
    assert sub.cid == "s/agent_001" and sub.parent == "s" and sub.agent_type == "Explore"
    assert sub.scope == parent.scope  # one file: its hash ids are comparable
    # a subagent starts at its parent's time; its requests count from there
    assert [r.arrival_s for r in sub.requests] == [12.0, 16.0]
    assert sub.start_s == 12.0

    first, plain, compacted, edited = parent.requests
    assert [r.index for r in parent.requests] == [0, 1, 2, 3]
    assert (first.shared_blocks, first.extends, first.shrank, first.new_tokens) == (
        0, False, False, None)
    assert first.gap_s == 0.0 and first.api_time_s == 1.5
    assert plain.extends and plain.shared_blocks == 4 and plain.shared_tokens == 256
    assert plain.new_tokens == 6 * 64 - (4 * 64 + 10) - 20 and not plain.shrank
    assert plain.gap_s == 7.0
    assert not compacted.extends and compacted.shrank and compacted.shared_blocks == 3
    assert not edited.extends and not edited.shrank and edited.shared_blocks == 3
    assert edited.gap_s == 500.0
    assert sub.requests[1].extends and sub.requests[1].shared_blocks == 3


def test_summary_counts(tmp_path: Path) -> None:
    summary = summarize(read_traces([_session(tmp_path)]))
    assert (summary.conversations, summary.subagents, summary.requests, summary.followups) == (
        2, 1, 6, 4)
    assert summary.shrinks == 1 and summary.divergences == 2
    assert summary.gaps_longer_than(480) == 1
    assert summary.new_tokens == (98, -158, 118, 114)
    assert summary.share_adding_at_most(100) == 0.5
    described = summary.describe(quantile)
    assert described["requests"] == 6 and described["gaps_over_480_s"] == 1
    assert described["reply_tokens"]["p50"] == quantile(summary.reply_tokens, 0.5)


def test_jsonl_shared_tokens_and_defaults(tmp_path: Path) -> None:
    lines = [
        {"conversation": "a", "t": 0.0, "prompt_tokens": 300, "reply_tokens": 20},
        "# a comment",
        {"conversation": "a", "t": 5.0, "prompt_tokens": 400, "reply_tokens": 20},
        {"conversation": "b", "parent": "a", "t": 6.0, "prompt_tokens": 100, "reply_tokens": 5},
        {"conversation": "a", "t": 20.0, "prompt_tokens": 200, "reply_tokens": 20,
         "shared_tokens": 130, "gap_s": 9.5},
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n\n")
    a, b = read_traces([path])
    assert a.cid == "mine/a" and b.cid == "mine/b" and b.parent == "mine/a"
    first, follow, compact = a.requests
    assert len(first.hash_ids) == 300 // 64 and first.block_size == 64
    # default: shares every full block of the previous prompt
    assert follow.extends and follow.shared_blocks == 4 and follow.gap_s == 5.0
    # shared_tokens is counted in whole blocks; gap_s as given
    assert compact.shared_blocks == 2 and compact.shrank and not compact.extends
    assert compact.gap_s == 9.5
    # made-up ids are unrelated across conversations
    assert not set(b.requests[0].hash_ids) & set(first.hash_ids)


def test_jsonl_hash_ids_state_sharing_across_conversations(tmp_path: Path) -> None:
    path = tmp_path / "ids.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [
        {"conversation": "x", "t": 0, "prompt_tokens": 256, "reply_tokens": 1,
         "hash_ids": [1, 2, 3, 4], "block_size": 64},
        {"conversation": "y", "t": 0, "prompt_tokens": 200, "reply_tokens": 1,
         "hash_ids": [1, 2, 9]}]))
    x, y = read_traces([path])
    assert x.requests[0].hash_ids[:2] == y.requests[0].hash_ids[:2]


@pytest.mark.parametrize(("line", "message"), [
    ({"t": 0, "prompt_tokens": 1, "reply_tokens": 1}, "'conversation'"),
    ({"conversation": "a", "t": -1, "prompt_tokens": 1, "reply_tokens": 1}, "'t'"),
    ({"conversation": "a", "t": 0, "prompt_tokens": 0, "reply_tokens": 1}, "'prompt_tokens'"),
    ({"conversation": "a", "t": 0, "prompt_tokens": 64, "reply_tokens": 1,
      "hash_ids": [1, 2]}, "2 hash ids for 64"),
])
def test_jsonl_errors_name_the_line(tmp_path: Path, line: dict[str, Any], message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(TraceFormatError, match=message) as caught:
        read_traces([path])
    assert "line 1" in str(caught.value)


def test_jsonl_time_must_not_go_back(tmp_path: Path) -> None:
    path = tmp_path / "back.jsonl"
    path.write_text("\n".join(json.dumps({"conversation": "a", "t": t, "prompt_tokens": 10,
                                          "reply_tokens": 1}) for t in (5, 4)))
    with pytest.raises(TraceFormatError, match="back in time"):
        read_traces([path])


def test_missing_paths_and_duplicates(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no such file"):
        read_traces([tmp_path / "nope.json"])
    with pytest.raises(TraceFormatError, match=r"no \.json or \.jsonl"):
        read_traces([tmp_path])
    path = _session(tmp_path)
    with pytest.raises(TraceFormatError, match="read twice"):
        read_traces([path, path])
    assert [c.cid for c in read_traces([tmp_path])] == ["s", "s/agent_001"]


def test_conversations_are_frozen(tmp_path: Path) -> None:
    conversation = read_traces([_session(tmp_path)])[0]
    with pytest.raises(AttributeError):
        conversation.cid = "other"  # type: ignore[misc]
    assert isinstance(conversation.requests, tuple)


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared Claude Code traces are not here")
def test_claude_code_traces_match_their_readme() -> None:
    conversations = read_traces([SHARED])
    summary = summarize(conversations)
    # 9 sessions, 2 subagents (trace_0004), 580 calls
    assert (summary.conversations, summary.subagents, summary.requests) == (11, 2, 580)
    assert round(quantile(summary.prompt_tokens, 0.5) / 1000) == 85  # prompt p50 85k
    assert quantile(summary.reply_tokens, 0.5) == 245
    assert [round(summary.share_adding_at_most(n) or 0, 2) for n in (512, 1024, 2048)] == [
        0.63, 0.76, 0.88]
    assert quantile(summary.gaps_s, 0.5) == 10.0
    assert summary.gaps_longer_than(480) == 38
    assert summary.shrinks == 4
    subagents = [c for c in conversations if c.is_subagent]
    assert {c.parent for c in subagents} == {"trace_0004"}
    # the two Explore subagents open with the same system prompt and tools: shared ids
    a, b = (c.requests[0].hash_ids for c in subagents)
    assert a[:100] == b[:100]
