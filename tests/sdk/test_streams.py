"""Stream followers: a reply rebuilt from the chunks the caller reads, in bounded batches."""

from __future__ import annotations

import copy
from typing import Any

import httpx2

from kvturn._continuity import CompletionTurn, normalise_message
from kvturn._state import ConversationState, TurnPlan
from kvturn._streams import FOLD_EVERY, ChatFollower, CompletionFollower, StreamClient

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Lisbon"}'}}


class Conversation:
    """The methods of ConversationState a follower calls, recorded."""

    id = "c"

    def __init__(self) -> None:
        self.replies: list[Any] = []
        self.fold: Any = None

    def pending_reply(self, plan: TurnPlan, fold: Any) -> None:
        self.fold = fold

    def finished(self, plan: TurnPlan, replies: Any) -> None:
        self.replies.append(replies)


class Client:
    _client = "the http client"

    def _process_response_data(self, *, data: Any, cast_to: Any, response: Any) -> Any:
        return ("decoded", data)


class Stream:
    def __init__(self) -> None:
        self._client: Any = Client()


def feed(stream: Stream, data: Any) -> Any:
    # what openai's Stream.__stream__ does with each chunk
    return stream._client._process_response_data(data=data, cast_to=object, response=None)


def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0) -> dict[str, Any]:
    return {"choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


def test_the_stream_gets_a_stand_in_client_whose_hook_is_the_followers() -> None:
    stream, state = Stream(), Conversation()
    client = stream._client
    follower = ChatFollower(state, TurnPlan("chat", None, None), stream)  # type: ignore[arg-type]
    assert isinstance(stream._client, StreamClient)
    assert stream._client._process_response_data == follower.take
    assert stream._client._process_response_data.__self__ is follower
    assert stream._client._kvturn_target is client
    # everything else is the conversation's, its HTTP client included; a copy does not recurse
    assert stream._client._client == "the http client"
    assert copy.copy(stream._client)._client == "the http client"
    # the chunk still reaches the caller, decoded by the conversation's own method
    assert feed(stream, chunk({"content": "x"})) == ("decoded", chunk({"content": "x"}))


def test_streamed_chunks_are_reassembled_from_their_json() -> None:
    stream, state = Stream(), Conversation()
    follower = ChatFollower(state, TurnPlan("chat", None, None), stream)  # type: ignore[arg-type]
    assert state.fold == follower.fold  # the next turn assembles what was queued
    for delta in ({"role": "assistant", "content": ""}, {"reasoning": "think "},
                  {"content": "Hel"}, {"content": "lo", "reasoning": None},
                  {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "weather", "arguments": '{"city": '}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '"Lisbon"}'}}]}):
        feed(stream, chunk(delta))
        follower.fold()
        assert follower.following and not state.replies and not follower.chunks
    feed(stream, chunk({}, "tool_calls"))
    feed(stream, {"choices": [], "usage": {"total_tokens": 3}})  # not needed
    follower.fold()
    assert not follower.following and not follower.chunks
    [replies] = state.replies
    assert [normalise_message(reply) for reply in replies] == [normalise_message(
        {"role": "assistant", "content": "Hello", "reasoning": "think ", "tool_calls": [CALL]})]


def test_a_long_stream_is_assembled_in_bounded_batches() -> None:
    stream, state = Stream(), Conversation()
    follower = ChatFollower(state, TurnPlan("chat", None, None), stream)  # type: ignore[arg-type]
    queued = []
    words = 3 * FOLD_EVERY + 5
    for i in range(words):
        feed(stream, chunk({"content": f"w{i} "}))
        queued.append(len(follower.chunks))
    assert max(queued) < FOLD_EVERY and follower.chunks  # bounded; the tail waits
    feed(stream, chunk({}, "stop"))
    follower.fold()
    assert state.replies == [[{"role": "assistant",
                               "content": "".join(f"w{i} " for i in range(words))}]]
    for _ in range(3 * FOLD_EVERY):  # chunks after the reply are dropped too
        feed(stream, {"choices": [], "usage": {}})
        assert len(follower.chunks) < FOLD_EVERY


def test_a_reply_with_several_choices_is_whole_when_all_have_finished() -> None:
    stream, state = Stream(), Conversation()
    follower = ChatFollower(state, TurnPlan("chat", None, None, choices=2),  # type: ignore[arg-type]
                            stream)
    feed(stream, chunk({"content": "b"}, "stop", index=1))
    follower.fold()
    assert follower.following
    feed(stream, chunk({"content": "a"}, "stop", index=0))
    follower.fold()
    assert [r["content"] for r in state.replies[0]] == ["a", "b"]


def test_a_chunk_the_follower_cannot_read_stops_it_but_reaches_the_caller() -> None:
    stream, state = Stream(), Conversation()
    follower = ChatFollower(state, TurnPlan("chat", None, None), stream)  # type: ignore[arg-type]
    assert feed(stream, {"choices": [7]}) == ("decoded", {"choices": [7]})
    feed(stream, chunk({"content": "a"}, "stop"))
    follower.fold()
    assert not follower.following
    assert state.replies == []  # the reply stays unknown


def test_completions_text_is_concatenated_and_an_echoed_prompt_cut() -> None:
    stream, state = Stream(), Conversation()
    turn = CompletionTurn(("m",), "Say: ")
    follower = CompletionFollower(state, TurnPlan("completions", turn, None, echo=True),  # type: ignore[arg-type]
                                  stream)
    for text, finish in (("Say: ", None), ("hi", None), (" there", "stop")):
        feed(stream, {"choices": [{"index": 0, "text": text, "finish_reason": finish}]})
    follower.fold()
    assert state.replies == [["hi there"]] and not follower.following


def test_a_late_follower_does_not_replace_a_newer_turns_fold() -> None:
    # Two threads streaming on one conversation: turn 2's follower registers after turn 3
    # started; the next turn must assemble turn 3's reply, not turn 2's.
    state = ConversationState("c", keepalive_interval=60)
    older = TurnPlan("chat", None, None)
    newer = TurnPlan("chat", None, None)
    state.started(older, httpx2.Response(200), attempts=1, streamed=True)
    state.started(newer, httpx2.Response(200), attempts=1, streamed=True)
    folds: list[str] = []
    state.pending_reply(newer, lambda: folds.append("newer"))
    state.pending_reply(older, lambda: folds.append("older"))
    state.prepare(_options({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
    assert folds == ["newer"]


def _options(body: dict[str, Any]) -> Any:
    from openai._models import FinalRequestOptions

    return FinalRequestOptions.construct(method="post", url="/chat/completions", json_data=body)
