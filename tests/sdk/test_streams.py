"""The stream follower: a pending turn settled from the first usage event that says the
cached tokens, every chunk still decoded by the conversation's own method."""

from __future__ import annotations

import copy
from typing import Any

from kvturn._streams import StreamClient, StreamFollower

USAGE = {"prompt_tokens": 64, "completion_tokens": 2,
         "prompt_tokens_details": {"cached_tokens": 48}}


class Conversation:
    """The method of ConversationState a follower calls, recorded."""

    id = "c"

    def __init__(self, fails: bool = False) -> None:
        self.settled: list[Any] = []
        self.fails = fails

    def settle(self, plan: Any, usage: Any) -> bool:
        if self.fails:
            raise RuntimeError("bookkeeping bug")
        self.settled.append(usage)
        return isinstance(usage, dict) and "prompt_tokens_details" in usage


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


def follow(state: Conversation) -> tuple[Stream, StreamFollower]:
    stream = Stream()
    return stream, StreamFollower(state, "plan", stream)  # type: ignore[arg-type]


def test_the_stream_gets_a_stand_in_client_whose_hook_is_the_followers() -> None:
    state = Conversation()
    stream, follower = follow(state)
    assert isinstance(stream._client, StreamClient)
    assert stream._client._process_response_data == follower.take
    assert isinstance(stream._client._kvturn_target, Client)
    # everything else is the conversation's, its HTTP client included; a copy does not recurse
    assert stream._client._client == "the http client"
    assert copy.copy(stream._client)._client == "the http client"
    # the chunk still reaches the caller, decoded by the conversation's own method
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
    assert feed(stream, chunk) == ("decoded", chunk)
    assert state.settled == []


def test_the_first_usage_that_says_the_cached_tokens_settles_and_ends_following() -> None:
    state = Conversation()
    stream, follower = follow(state)
    feed(stream, {"choices": [], "usage": {"prompt_tokens": 64}})  # no details: keep looking
    assert follower.following
    feed(stream, {"choices": [], "usage": USAGE})
    assert not follower.following
    feed(stream, {"choices": [], "usage": USAGE})  # later usage is not read
    assert state.settled == [{"prompt_tokens": 64}, USAGE]


def test_a_chunk_the_follower_cannot_use_still_reaches_the_caller() -> None:
    state = Conversation(fails=True)
    stream, follower = follow(state)
    assert feed(stream, "not json") == ("decoded", "not json")
    assert follower.following
    assert feed(stream, {"usage": USAGE}) == ("decoded", {"usage": USAGE})
    assert not follower.following  # a failure stops the following, never the iteration
