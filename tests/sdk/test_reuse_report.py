"""Reuse visibility: per-turn reports from the router's headers and per-conversation counters."""

from __future__ import annotations

from typing import Any

import httpx2
import pytest

import kvturn
from kvturn._streams import StreamClient, StreamFollower
from tests.fakes.router import FakeRouter, Recorded, chat_chunks, chat_completion, sse_bytes

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
    assert stats.no_reuse == {}  # the SDK itself never asks the router not to reuse
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


# A stream the decode continued alone: pending until its usage event says.

def pending_stream(prompt: int, cached: int | None, *, block_size: str | None = "16",
                   reuse: str = "pending", continuous: bool = False) -> Any:
    """A continued stream as the router answers it: ``pending`` headers, and (``cached`` not
    None) the decode's usage event before ``[DONE]``, as a client that asked for it gets
    (``continuous``: a usage on every chunk too, as with vLLM's continuous usage stats)."""
    def respond(recorded: Recorded) -> httpx2.Response:
        headers = {"X-KVTurn-Reuse": reuse, "X-KVTurn-Reused-Tokens": "0",
                   "X-KVTurn-Route": "decode", "content-type": "text/event-stream"}
        if block_size is not None:
            headers["X-KVTurn-Block-Size"] = block_size
        chunks = chat_chunks()
        if cached is not None:
            usage = {"prompt_tokens": prompt, "completion_tokens": 2, "total_tokens": prompt + 2,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            if continuous:
                chunks = [{**chunk, "usage": usage} for chunk in chunks]
            chunks.append({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                           "model": MODEL, "choices": [], "usage": usage})
        return httpx2.Response(200, headers=headers, content=b"".join(sse_bytes(chunks)))
    return respond


USAGE = {"stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(("block_size", "cached", "reuse"), [
    ("16", 48, "hit"), ("16", 32, "partial"), ("16", 0, "miss"), (None, 48, "partial")])
def test_a_pending_stream_is_settled_by_its_usage(client: kvturn.OpenAI, router: FakeRouter,
                                                  block_size: str | None, cached: int,
                                                  reuse: str) -> None:
    conversation = client.conversation()
    router.script.append(pending_stream(64, cached, block_size=block_size))
    stream = conversation.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], **USAGE)
    turn = conversation.last_turn
    assert turn is not None and (turn.reuse, turn.reused_tokens) == ("pending", 0)
    assert turn.block_size == (16 if block_size else None)
    chunks = list(stream)
    assert chunks[-1].usage is not None  # the caller's own usage chunk, as it asked
    turn = conversation.last_turn
    assert turn is not None and (turn.reuse, turn.reused_tokens) == (reuse, cached)
    stats = conversation.stats
    assert stats.outcomes == {reuse: 1} and stats.reused_tokens == cached
    assert stats.hits == (reuse != "miss")


def test_counters_taken_while_pending_are_settled_later(client: kvturn.OpenAI,
                                                        router: FakeRouter) -> None:
    conversation = client.conversation()
    router.script.append(pending_stream(300, 256))
    stream = conversation.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], **USAGE)
    next(iter(stream))
    assert conversation.stats.outcomes == {"pending": 1}
    list(stream)
    stats = conversation.stats
    assert stats.outcomes == {"partial": 1} and stats.reused_tokens == 256 and stats.hits == 1


def test_without_usage_a_pending_stream_stays_pending(client: kvturn.OpenAI,
                                                      router: FakeRouter) -> None:
    conversation = client.conversation()
    # The router cuts the usage event out of a stream that did not ask for it.
    router.script.append(pending_stream(64, None))
    list(conversation.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True))
    turn = conversation.last_turn
    assert turn is not None and turn.reuse == "pending" and not turn.reused
    assert conversation.stats.outcomes == {"pending": 1} and conversation.stats.hits == 0
    assert dict(conversation.stats.misses) == {"pending": 1}


def test_usage_leaves_a_report_that_was_not_pending_alone(client: kvturn.OpenAI,
                                                          router: FakeRouter) -> None:
    conversation = client.conversation()
    router.stream_reply = lambda _: [*chat_chunks(), {
        "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 2,
                                 "prompt_tokens_details": {"cached_tokens": 0}}}]
    messages: list[Any] = [{"role": "user", "content": "x"}]
    list(conversation.chat.completions.create(model=MODEL, messages=messages, **USAGE))
    messages += [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "y"}]
    list(conversation.chat.completions.create(model=MODEL, messages=messages, **USAGE))
    turn = conversation.last_turn
    assert turn is not None and turn.reuse == "hit" and turn.reused_tokens > 0


async def test_async_pending_streams_are_settled(aclient: kvturn.AsyncOpenAI,
                                                 arouter: FakeRouter) -> None:
    conversation = aclient.conversation()
    arouter.script.append(pending_stream(64, 0))
    stream = await conversation.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], **USAGE)
    async for _ in stream:
        pass
    turn = conversation.last_turn
    assert turn is not None and (turn.reuse, turn.reused_tokens) == ("miss", 0)
    assert conversation.stats.misses == {"miss": 1}


def followed(stream: Any) -> StreamFollower | None:
    """The follower of a conversation's stream (the stand-in client's per-chunk hook), if any."""
    if not isinstance(stream._client, StreamClient):
        return None
    follower = stream._client._process_response_data.__self__
    assert isinstance(follower, StreamFollower)
    return follower


@pytest.mark.parametrize(("reuse", "options", "follow"), [
    ("pending", USAGE, True), ("pending", {"stream": True}, False),
    ("hit", USAGE, False), ("partial", USAGE, False)])
def test_only_a_pending_stream_that_asked_for_usage_is_followed(
        client: kvturn.OpenAI, router: FakeRouter, reuse: str, options: dict[str, Any],
        follow: bool) -> None:
    conversation = client.conversation()
    router.script.append(pending_stream(64, 48, reuse=reuse))
    stream = conversation.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], **options)
    assert (followed(stream) is not None) == follow
    if not follow:
        assert stream._client is conversation  # every chunk goes straight to openai
    list(stream)
    turn = conversation.last_turn
    assert turn is not None and turn.reuse == ("hit" if follow else reuse)


def test_continuous_usage_settles_once(client: kvturn.OpenAI, router: FakeRouter) -> None:
    conversation = client.conversation()
    router.script.append(pending_stream(64, 48, continuous=True))
    stream = conversation.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], **USAGE)
    follower = followed(stream)
    assert follower is not None
    next(iter(stream))  # the first chunk's usage settles the turn; later ones are not read
    assert not follower.following
    assert conversation.last_turn is not None and conversation.last_turn.reuse == "hit"
    list(stream)
    assert conversation.stats.outcomes == {"hit": 1} and conversation.stats.reused_tokens == 48


def test_raw_responses_are_settled_too(client: kvturn.OpenAI, router: FakeRouter) -> None:
    conversation = client.conversation()
    router.script.append(pending_stream(64, 32))
    raw = conversation.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], **USAGE)
    list(raw.parse())  # the same stream kvturn parsed and follows (openai caches it)
    assert conversation.last_turn is not None
    assert (conversation.last_turn.reuse, conversation.last_turn.reused_tokens) == ("partial", 32)


def test_with_streaming_response_leaves_a_pending_turn_pending(client: kvturn.OpenAI,
                                                               router: FakeRouter) -> None:
    conversation = client.conversation()
    router.script.append(pending_stream(64, 48))
    with conversation.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], **USAGE) as response:
        assert conversation.last_turn is not None and conversation.last_turn.reuse == "pending"
        response.read()  # the body is the caller's to read
    assert conversation.last_turn.reuse == "pending"


def test_an_odd_usage_leaves_the_turn_pending_and_the_stream_whole(
        client: kvturn.OpenAI, router: FakeRouter) -> None:
    def respond(recorded: Recorded) -> httpx2.Response:
        chunks = [*chat_chunks(), {"id": "x", "object": "chat.completion.chunk", "created": 1,
                                   "model": MODEL, "choices": [],
                                   "usage": {"prompt_tokens": 64, "completion_tokens": 2,
                                             "total_tokens": 66}}]  # no cached tokens
        return httpx2.Response(200, headers={"X-KVTurn-Reuse": "pending",
                                             "content-type": "text/event-stream"},
                               content=b"".join(sse_bytes(chunks)))

    conversation = client.conversation()
    router.script.append(respond)
    chunks = list(conversation.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], **USAGE))
    assert len(chunks) == len(chat_chunks()) + 1  # the caller still gets every chunk
    assert conversation.last_turn is not None and conversation.last_turn.reuse == "pending"


def test_an_abandoned_stream_is_not_kept_alive(client: kvturn.OpenAI,
                                               router: FakeRouter) -> None:
    import gc
    import weakref

    conversation = client.conversation()
    router.script.append(pending_stream(64, 48))
    stream = conversation.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], **USAGE)
    response = weakref.ref(stream.response)
    assert followed(stream) is not None
    stream.close()
    del stream
    gc.collect()
    assert response() is None
