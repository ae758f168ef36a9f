"""Reuse visibility: per-turn reports from the router's headers and per-conversation counters."""

from __future__ import annotations

from typing import Any

import httpx2
import pytest

import kvturn
from tests.fakes.router import FakeRouter, Recorded, chat_completion

MODEL = "kvturn-tiny"


def scripted(outcome: str | None, tokens: str | None = None) -> Any:
    def respond(recorded: Recorded) -> httpx2.Response:
        headers = {"x-request-id": "req-x"}
        if outcome is not None:
            headers["X-KVTurn-Reuse"] = outcome
            headers["X-KVTurn-Conversation"] = recorded.conversation or ""
        if tokens is not None:
            headers["X-KVTurn-Reused-Tokens"] = tokens
        return httpx2.Response(200, headers=headers, json=chat_completion())
    return respond


def test_turn_info_reads_the_router_headers(client: kvturn.OpenAI, router: FakeRouter) -> None:
    conversation = client.conversation("c-1")
    assert conversation.last_turn is None
    router.script.append(scripted("partial", "2048"))
    conversation.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    turn = conversation.last_turn
    assert turn == kvturn.TurnInfo(conversation_id="c-1", api="chat", reuse="partial",
                                   reused_tokens=2048, no_reuse_reason=None,
                                   router_conversation="c-1", request_id="req-x", attempts=1,
                                   streamed=False)
    assert turn.reused


def test_stats_count_outcomes_and_misses_by_reason(client: kvturn.OpenAI,
                                                   router: FakeRouter) -> None:
    conversation = client.conversation()
    for outcome, tokens in [("miss", "0"), ("hit", "100"), ("partial", "50"), ("stale", "0"),
                            ("expired", "0"), ("expired", "0"), ("below-threshold", "0"),
                            (None, None), ("hit", "not-a-number")]:
        router.script.append(scripted(outcome, tokens))
        conversation.completions.create(model=MODEL, prompt="same prompt")
    stats = conversation.stats
    assert stats.turns == 9
    assert stats.reused_tokens == 150
    assert stats.hits == 3
    assert dict(stats.misses) == {"miss": 1, "stale": 1, "expired": 2, "below-threshold": 1,
                                  "unreported": 1}
    assert stats.outcomes["hit"] == 2
    assert stats.no_reuse == {"regenerate": 8}
    assert conversation.last_turn is not None and conversation.last_turn.reused_tokens == 0
    with pytest.raises(TypeError):
        stats.outcomes["hit"] = 0  # type: ignore[index]


def test_a_stream_reports_before_its_first_chunk(client: kvturn.OpenAI,
                                                 router: FakeRouter) -> None:
    conversation = client.conversation()
    messages: list[Any] = [{"role": "user", "content": "x"}]
    list(conversation.chat.completions.create(model=MODEL, messages=messages, stream=True))
    messages += [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "y"}]
    stream = conversation.chat.completions.create(model=MODEL, messages=messages, stream=True)
    assert router.bodies[-1].produced == 0  # not one event read yet
    turn = conversation.last_turn
    assert turn is not None and turn.streamed and turn.reuse == "hit" and turn.reused_tokens > 0
    stream.close()


def test_without_a_router_the_report_is_empty(client: kvturn.OpenAI, router: FakeRouter) -> None:
    router.script.append(scripted(None))
    conversation = client.conversation()
    conversation.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert conversation.last_turn is not None
    assert conversation.last_turn.reuse is None and not conversation.last_turn.reused
    assert conversation.stats.outcomes == {"unreported": 1}


async def test_async_reports(aclient: kvturn.AsyncOpenAI, arouter: FakeRouter) -> None:
    conversation = aclient.conversation()
    messages: list[Any] = [{"role": "user", "content": "x"}]
    await conversation.chat.completions.create(model=MODEL, messages=messages)
    messages += [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "y"}]
    stream = await conversation.chat.completions.create(model=MODEL, messages=messages,
                                                        stream=True)
    assert conversation.last_turn is not None and conversation.last_turn.reuse == "hit"
    await stream.close()
    assert conversation.stats.hits == 1 and conversation.stats.misses == {"miss": 1}
