"""The simulator's conversations: drawn from the trace distributions, from the agent bench's
seed, or read from trace files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvturn_server.bench.agent._workload import FRAMING_TOKENS, AgentBenchSettings, agent_shape
from kvturn_server.sim import Conversation, WorkloadSpec, from_agent_bench, load_trace, synthetic


def test_synthetic_is_a_function_of_the_seed() -> None:
    spec = WorkloadSpec(conversations=50, window_s=100.0, seed=3)
    assert synthetic(spec) == synthetic(spec)
    assert synthetic(spec) != synthetic(WorkloadSpec(conversations=50, window_s=100.0, seed=4))


def test_synthetic_follows_the_spec() -> None:
    spec = WorkloadSpec(conversations=400, window_s=60.0, turns=(2, 5), gap_cap_s=100.0)
    conversations = synthetic(spec)
    assert [c.start_s for c in conversations] == sorted(c.start_s for c in conversations)
    assert all(0 <= c.start_s <= 60 and 2 <= c.turns <= 5 for c in conversations)
    gaps = sorted(g for c in conversations for g in c.gaps_s)
    assert max(gaps) <= 100.0
    # The trace's median tool gap is 2 s; 1,000-odd draws land near it.
    assert 1.5 < gaps[len(gaps) // 2] < 2.7


def test_prompts_grow_by_each_message_and_reply() -> None:
    c = Conversation("c", 0.0, 100, (10, 20, 30), (5, 6, 7), (1.0, 2.0))
    assert c.prompt_tokens(0) == 100 + 10 + 2 * FRAMING_TOKENS
    assert c.prompt_tokens(1) == c.prompt_tokens(0) + 5 + 20 + 2 * FRAMING_TOKENS
    assert c.prompt_tokens(2) == c.prompt_tokens(1) + 6 + 30 + 2 * FRAMING_TOKENS


def test_from_agent_bench_sends_what_the_bench_sends() -> None:
    settings = AgentBenchSettings(agents=3, turns=4, seed=7, stagger_s=2.0)
    for agent, conversation in enumerate(from_agent_bench(settings)):
        sizes, gaps, replies = agent_shape(settings, agent)
        assert (conversation.messages, conversation.gaps_s, conversation.replies) == (
            sizes, gaps, replies)
        assert conversation.start_s == 2.0 * agent


def test_vllm_multi_turn_conversations(tmp_path: Path) -> None:
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps([
        {"id": "a", "messages": [
            {"role": "system", "content": "s" * 400},
            {"role": "user", "content": "u" * 40}, {"role": "assistant", "content": "r" * 80},
            {"role": "user", "content": "v" * 8}, {"role": "assistant", "content": "q" * 4},
            {"role": "user", "content": "left without a reply"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "hi there"},
                                      {"from": "gpt", "value": "hello"}]},
        {"id": "c", "messages": [{"role": "user", "content": "no reply"}]},
    ]))
    conversations = {c.cid: c for c in load_trace(path, window_s=10.0)}
    assert set(conversations) == {"a", "b"}
    a = conversations["a"]
    assert (a.system_tokens, a.messages, a.replies, len(a.gaps_s)) == (100, (10, 2), (20, 1), 1)
    assert conversations["b"].messages == (2,)


def test_kvturn_jsonl_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"id": "x", "start_s": 5, "system_tokens": 50, "turns": [
        {"input_tokens": 10, "output_tokens": 3, "gap_s": 7.5},
        {"input_tokens": 20, "output_tokens": 4}]}) + "\n\n")
    (conversation,) = load_trace(path)
    assert conversation == Conversation("x", 5.0, 50, (10, 20), (3, 4), (7.5,))
    path.write_text('{"id": "y", "turns": [{"output_tokens": 3}]}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:1"):
        load_trace(path)
