"""The agent loop both agent benchmarks share: what it refuses before sending anything.

The loop's turns, gaps and client kinds are exercised through each benchmark against its fake
router (tests/server/bench/test_bench_agent.py, tests/server/bench/test_bench_fleet.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvturn_server.bench.agent._kinds import IDS
from kvturn_server.bench.agent._loop import Live, chunk_gaps_ms, run_agent, stream_turn
from kvturn_server.bench.agent._records import TurnRecord
from kvturn_server.bench.agent._workload import AgentBenchSettings, build_scripts
from tests.fakes.bench_router import AgentBenchRouter, mock_client, prompt_size


def test_chunk_gaps_are_the_milliseconds_between_consecutive_chunks() -> None:
    assert chunk_gaps_ms([1.0, 1.01, 1.5]) == pytest.approx([10.0, 490.0])
    assert chunk_gaps_ms([2.0]) == [] and chunk_gaps_ms([]) == []


@pytest.mark.parametrize(("kind", "cid", "error"), [
    ("shared", None, "unknown client kind"),
    (IDS, None, "needs a conversation id"),
])
async def test_a_bad_client_kind_is_refused_before_any_turn(kind: str, cid: str | None,
                                                            error: str) -> None:
    script = build_scripts(AgentBenchSettings(agents=1, turns=2, system_tokens=5,
                                              message_tokens=(3, 3)), "x")[0]
    records: list[Any] = []
    no_client: Any = None  # never reached

    def new_record(turn: int, conversation_id: str | None, started_s: float) -> Any:
        raise AssertionError("no turn may start")

    with pytest.raises(ValueError, match=error):
        await run_agent(script, kind, no_client, "m", t0=0.0, live=Live(1, 2), records=records,
                        new_record=new_record, timed=lambda *_: None,
                        keepalive_interval=1.0, conversation_id=cid)
    assert records == []


async def test_a_turn_the_decode_continued_counts_what_its_cache_supplied() -> None:
    """A continued stream's headers say ``pending``: the record takes the usage's cached
    tokens (none when the decode had lost the conversation), never a predicted hit."""
    router = AgentBenchRouter(routes=True)
    client = mock_client(router.handle)
    messages: list[Any] = [{"role": "system", "content": "tools " * 20},
                           {"role": "user", "content": "go"}]
    records: list[TurnRecord] = []
    try:
        for turn in range(3):
            if turn == 2:
                router.forgotten.add("c")  # evicted during the gap
            record = TurnRecord(mode="on", agent=0, turn=turn, conversation_id="c",
                                started_s=0.0, message_role="user", message_words=1)
            text = await stream_turn(client, "m", messages, 8, lambda: 0.0, record, [],
                                     extra_body={"conversation_id": "c"})
            records.append(record)
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": "next"}]
    finally:
        await client.close()
    first, held, lost = records
    assert (first.route, first.reuse, first.reused_tokens) == ("prefill", "miss", 0)
    # Held: the previous prompt (the fake's tokens) came from the decode's cache.
    assert held.route == "decode" and held.reuse in ("hit", "partial")
    assert held.reused_tokens == prompt_size(router.requests[0]["body"]["messages"])
    assert (lost.route, lost.reuse, lost.reused_tokens) == ("decode", "miss", 0)
