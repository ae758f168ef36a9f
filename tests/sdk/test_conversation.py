"""Scoped clients: ids on every request, forks, release on close, continuity hints on the wire."""

from __future__ import annotations

import io
import re
from typing import Any

import httpx2
import openai
import pytest

import kvturn
from kvturn._streams import FOLD_EVERY, StreamClient, StreamFollower
from tests.fakes.router import FakeRouter, chat_chunks, chat_completion, completion, error

MODEL = "kvturn-tiny"
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Lisbon"}'}}


def ask(conversation: kvturn.Conversation, messages: list[Any], **kwargs: Any) -> Any:
    return conversation.chat.completions.create(model=MODEL, messages=messages, **kwargs)


# --- identity -------------------------------------------------------------------------------

def test_every_request_carries_the_id_once_in_body_or_header(client: kvturn.OpenAI,
                                                              router: FakeRouter) -> None:
    # A JSON body carries it (the router's first source), a request without one the header:
    # never both (every header costs each later header lookup of the request; docs/sdk.md).
    conversation = client.conversation("trip/42:a#b")
    ask(conversation, [{"role": "user", "content": "Hi"}])
    conversation.completions.create(model=MODEL, prompt="Hi")
    list(ask(conversation, [{"role": "user", "content": "Hi"}], stream=True))
    conversation.models.list()
    assert [r.body["conversation_id"] for r in router.turns()] == ["trip/42:a#b"] * 3
    assert all(r.conversation_header is None for r in router.turns())
    assert router.requests[-1].method == "GET" and router.requests[-1].body is None
    assert router.requests[-1].conversation_header == "trip/42:a#b"
    assert [r.conversation for r in router.requests] == ["trip/42:a#b"] * 4


def test_a_form_body_is_no_json_body_and_the_header_carries_the_id(client: kvturn.OpenAI,
                                                                    router: FakeRouter) -> None:
    # openai sends a body with files as multipart form fields (with files but no multipart
    # Content-Type, not at all): the router never reads those, so the header carries the id.
    conversation = client.conversation("up-1")
    uploaded = {"id": "file-1", "object": "file", "bytes": 3, "created_at": 1,
                "filename": "a.jsonl", "purpose": "batch", "status": "processed"}
    router.script.extend([httpx2.Response(200, json=uploaded) for _ in range(2)])
    conversation.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    conversation.post("/uploads", body={"purpose": "batch"}, cast_to=httpx2.Response,
                      files=[("file", ("a.jsonl", io.BytesIO(b"{}\n")))])
    for sent in router.requests:
        assert sent.conversation_header == "up-1"
        assert b'name="conversation_id"' not in sent.body
    assert b'name="purpose"' in router.requests[0].body  # the caller's own fields still go


def test_a_generated_id_is_random_and_stable(client: kvturn.OpenAI, router: FakeRouter) -> None:
    first, second = client.conversation(), client.conversation()
    assert first.id != second.id
    assert re.fullmatch(r"kvt-[0-9a-f]{32}", first.id)
    ask(first, [{"role": "user", "content": "a"}])
    ask(first.with_options(timeout=9), [{"role": "user", "content": "b"}])
    assert {r.conversation for r in router.turns()} == {first.id}


@pytest.mark.parametrize("bad", ["", "has space", "x" * 257, "caf\u00e9", "tab\t", 7])
def test_invalid_ids_fail_before_anything_is_sent(client: kvturn.OpenAI, router: FakeRouter,
                                                  bad: Any) -> None:
    with pytest.raises(kvturn.InvalidConversationIdError):
        client.conversation(bad)
    assert router.requests == []


def test_an_id_of_256_printable_characters_is_valid(client: kvturn.OpenAI) -> None:
    assert client.conversation("~" * 256).id == "~" * 256


def test_the_scoped_id_cannot_be_overridden_per_call(client: kvturn.OpenAI,
                                                     router: FakeRouter) -> None:
    conversation = client.conversation("a")
    with pytest.raises(kvturn.InvalidConversationIdError, match="scoped to conversation 'a'"):
        ask(conversation, [{"role": "user", "content": "x"}],
            extra_body={"conversation_id": "b"})
    with pytest.raises(kvturn.InvalidConversationIdError):
        ask(conversation, [{"role": "user", "content": "x"}],
            extra_headers={"x-conversation-id": "b"})
    # the same id, in any spelling of the header, is fine and sent once
    ask(conversation, [{"role": "user", "content": "x"}], extra_headers={"x-conversation-id": "a"},
        extra_body={"conversation_id": "a"})
    assert router.requests[-1].headers.get_list("x-conversation-id") == ["a"]
    assert len(router.requests) == 1


def test_an_unscoped_client_passes_a_callers_id_through(client: kvturn.OpenAI,
                                                        router: FakeRouter) -> None:
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                   extra_body={"conversation_id": "mine"})
    assert router.requests[-1].body["conversation_id"] == "mine"


# --- forks ----------------------------------------------------------------------------------

def test_forks_are_their_own_conversations(client: kvturn.OpenAI, router: FakeRouter) -> None:
    parent = client.conversation("run-1")
    left, right = parent.fork("search"), parent.fork("browse")
    assert (left.id, right.id) == ("run-1/search", "run-1/browse")
    assert parent.fork("search").id == left.id
    assert left.fork("deep").id == "run-1/search/deep"
    assert re.fullmatch(r"run-1/[0-9a-f]{8}", parent.fork().id)
    ask(left, [{"role": "user", "content": "x"}])
    assert router.turns()[-1].conversation == "run-1/search"
    assert left.stats.turns == 1 and parent.stats.turns == 0
    with pytest.raises(kvturn.InvalidConversationIdError):
        parent.fork("no spaces")


def test_a_fork_of_a_long_id_still_fits(client: kvturn.OpenAI) -> None:
    child = client.conversation("p" * 256).fork("branch")
    assert len(child.id) <= 256 and child.id.endswith("/branch")
    assert client.conversation("p" * 256).fork("branch").id == child.id


# --- release --------------------------------------------------------------------------------

def test_closing_releases_the_retention_and_keeps_the_http_client(client: kvturn.OpenAI,
                                                                  router: FakeRouter) -> None:
    with client.conversation("a/b#c") as conversation:
        ask(conversation, [{"role": "user", "content": "x"}])
        branch = conversation.fork("t")
        ask(branch, [{"role": "user", "content": "y"}])
    deletes = router.to("", method="DELETE")
    assert [d.raw_path for d in deletes] == ["/kvturn/v1/conversations/a%2Fb%23c%2Ft",
                                             "/kvturn/v1/conversations/a%2Fb%23c"]
    assert [d.conversation_header for d in deletes] == ["a/b#c/t", "a/b#c"]
    assert conversation.closed and branch.closed
    assert router.retained == {}
    assert not client.is_closed()
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "z"}])

    conversation.close()  # idempotent
    assert len(router.to("", method="DELETE")) == 2
    with pytest.raises(kvturn.ConversationClosedError):
        ask(conversation, [{"role": "user", "content": "again"}])
    # reusing the id is allowed: a new conversation object
    ask(client.conversation("a/b#c"), [{"role": "user", "content": "again"}])


def test_a_failed_release_is_counted_not_raised(client: kvturn.OpenAI,
                                                router: FakeRouter) -> None:
    conversation = client.conversation()
    original = router._conversation_endpoint
    router._conversation_endpoint = lambda recorded: error(503)  # type: ignore[method-assign]
    try:
        conversation.close()
    finally:
        router._conversation_endpoint = original  # type: ignore[method-assign]
    assert conversation.closed
    assert conversation.stats.release_failures == 1
    assert len(router.to("", method="DELETE")) == 1  # release is best effort: no retries


def test_kvturn_url_overrides_where_conversation_endpoints_live(router: FakeRouter) -> None:
    http = httpx2.Client(transport=httpx2.MockTransport(router))
    client = kvturn.OpenAI(base_url="http://gw.test/openai/v1", api_key="-", http_client=http,
                           kvturn_url="http://gw.test/router")
    client.conversation("c").close()
    assert router.requests[-1].raw_path == "/router/kvturn/v1/conversations/c"
    default = kvturn.OpenAI(base_url="http://gw.test/openai/v1", api_key="-", http_client=http)
    default.conversation("c").close()
    assert router.requests[-1].raw_path == "/openai/kvturn/v1/conversations/c"


async def test_async_context_manager_releases(aclient: kvturn.AsyncOpenAI,
                                              arouter: FakeRouter) -> None:
    async with aclient.conversation("x") as conversation:
        await conversation.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}])
        conversation.fork("f")
    assert [r.raw_path for r in arouter.to("", method="DELETE")] == [
        "/kvturn/v1/conversations/x%2Ff", "/kvturn/v1/conversations/x"]
    assert not aclient.is_closed()
    with pytest.raises(kvturn.ConversationClosedError):
        await conversation.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}])


# --- continuity on the wire ------------------------------------------------------------------

def test_a_conversation_that_extends_its_turns_never_says_no_reuse(client: kvturn.OpenAI,
                                                                    router: FakeRouter) -> None:
    router.reply = lambda r: (chat_completion(None, tool_calls=[CALL], reasoning="Need data.")
                              if len(r.body["messages"]) == 2
                              else chat_completion("Sunny, 22C."))
    with client.conversation() as conversation:
        messages: list[Any] = [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Weather in Lisbon?"}]
        reply = ask(conversation, messages)
        messages += [reply.choices[0].message,  # the pydantic object, as returned
                     {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]
        reply = ask(conversation, messages)
        messages += [reply.choices[0].message.model_dump(),  # a dict with None fields
                     {"role": "user", "content": "Thanks"}]
        ask(conversation, messages)
    assert [r.no_reuse for r in router.turns()] == [None, None, None]
    assert [t for t in conversation.stats.outcomes] == ["miss", "hit"]


def test_edits_are_flagged_and_the_next_turn_extends_the_edited_one(
        client: kvturn.OpenAI, router: FakeRouter) -> None:
    conversation = client.conversation()
    messages: list[Any] = [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Hi"}]
    ask(conversation, messages)
    messages += [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    messages[0]["content"] = "Be verbose."  # edited in place, after the first turn
    ask(conversation, messages)
    assert conversation.last_turn is not None
    assert conversation.last_turn.no_reuse_reason == "system-changed"
    assert conversation.last_turn.reuse == "disabled"
    messages += [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Ok"}]
    ask(conversation, messages)
    assert [r.no_reuse for r in router.turns()] == [None, "system-changed", None]
    assert conversation.stats.no_reuse == {"system-changed": 1}


def test_stripped_reasoning_is_flagged(client: kvturn.OpenAI, router: FakeRouter) -> None:
    router.reply = lambda r: chat_completion("It is 4.", reasoning="2+2 is 4")
    conversation = client.conversation()
    messages: list[Any] = [{"role": "user", "content": "2+2?"}]
    reply = ask(conversation, messages)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "And 3+3?"}]
    ask(conversation, messages)
    assert router.turns()[-1].no_reuse == "reasoning-stripped"


def test_a_streamed_reply_is_reassembled_without_buffering(client: kvturn.OpenAI,
                                                           router: FakeRouter) -> None:
    router.stream_reply = lambda r: chat_chunks("Let me check the weather.",
                                                reasoning="I need data", tool_calls=[CALL])
    conversation = client.conversation()
    messages: list[Any] = [{"role": "user", "content": "Weather?"}]
    stream = ask(conversation, messages, stream=True)
    body = router.bodies[-1]
    first = next(stream)
    assert first.choices[0].delta.role == "assistant"
    assert body.produced < len(body.events)  # the caller got a chunk before the body ended
    rest = list(stream)
    assert body.produced == len(body.events)
    # what a caller rebuilds from the deltas (vLLM's field names)
    content = "".join(c.choices[0].delta.content or "" for c in [first, *rest])
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning", "")
                        for c in [first, *rest])
    messages += [{"role": "assistant", "content": content, "reasoning": reasoning,
                  "tool_calls": [CALL]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]
    ask(conversation, messages)
    assert router.turns()[-1].no_reuse is None


def follower_of(stream: Any) -> StreamFollower:
    """The follower of a conversation's stream: the stand-in client's per-chunk hook."""
    assert isinstance(stream._client, StreamClient)
    follower = stream._client._process_response_data.__self__
    assert isinstance(follower, StreamFollower)
    return follower


def test_a_long_stream_is_assembled_in_bounded_batches(client: kvturn.OpenAI,
                                                       router: FakeRouter) -> None:
    words = [f"w{i}" for i in range(3 * FOLD_EVERY)]
    router.stream_reply = lambda r: chat_chunks(" ".join(words))
    conversation = client.conversation()
    messages: list[Any] = [{"role": "user", "content": "Talk"}]
    stream = ask(conversation, messages, stream=True)
    follower = follower_of(stream)
    queued = [len(follower.chunks) for _ in stream]
    assert len(queued) > 2 * FOLD_EVERY and max(queued) < FOLD_EVERY  # memory stays bounded
    assert follower.chunks and follower.following  # the tail waits for the next turn
    # the tail is assembled when the next turn is compared: the exact reply extends...
    ask(conversation, [*messages, {"role": "assistant", "content": " ".join(words)},
                       {"role": "user", "content": "More"}])
    assert router.turns()[-1].no_reuse is None
    assert not follower.following and not follower.chunks
    # ...and one word changed near its end does not
    conversation = client.conversation()
    list(ask(conversation, messages, stream=True))
    ask(conversation, [*messages, {"role": "assistant", "content": " ".join([*words[:-1], "x"])},
                       {"role": "user", "content": "More"}])
    assert router.turns()[-1].no_reuse == "reply-changed"


def test_a_stream_abandoned_midway_leaves_only_a_prefix_check(client: kvturn.OpenAI,
                                                              router: FakeRouter) -> None:
    conversation = client.conversation()
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    stream = ask(conversation, messages, stream=True)
    next(stream)
    stream.close()
    # the reply was never seen whole: any assistant message may follow the same prefix
    ask(conversation, [*messages, {"role": "assistant", "content": "He"},
                       {"role": "user", "content": "?"}])
    assert router.turns()[-1].no_reuse is None
    ask(conversation, [{"role": "user", "content": "Hello"}])
    assert router.turns()[-1].no_reuse == "edited"


def test_a_turn_refused_mid_stream_leaves_the_streams_reply_to_the_next_turn(
        client: kvturn.OpenAI, router: FakeRouter) -> None:
    # The refused turn started nothing: the stream's turn is still the record, and its reply
    # (assembled when a later turn needs it) is still compared in full.
    router.stream_reply = lambda r: chat_chunks("Hello there")
    conversation = client.conversation()
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    stream = ask(conversation, messages, stream=True)
    next(stream)
    router.script.append(error(400))
    with pytest.raises(openai.BadRequestError):
        ask(conversation, [*messages, {"role": "user", "content": "too soon"}])
    list(stream)
    ask(conversation, [*messages, {"role": "assistant", "content": "Hello here"},
                       {"role": "user", "content": "?"}])
    assert router.turns()[-1].no_reuse == "reply-changed"


def test_a_stream_cut_before_finish_reason_is_not_a_reply(client: kvturn.OpenAI,
                                                          router: FakeRouter) -> None:
    router.stream_reply = lambda r: chat_chunks("Partial answer", finish=False)
    conversation = client.conversation()
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    list(ask(conversation, messages, stream=True))
    ask(conversation, [*messages, {"role": "assistant", "content": "something else"},
                       {"role": "user", "content": "?"}])
    assert router.turns()[-1].no_reuse is None


def test_the_callers_own_no_reuse_header_wins(client: kvturn.OpenAI, router: FakeRouter) -> None:
    conversation = client.conversation()
    ask(conversation, [{"role": "user", "content": "Hi"}],
        extra_headers={"x-kvturn-no-reuse": "tenant-policy"})
    assert router.turns()[-1].headers.get_list("x-kvturn-no-reuse") == ["tenant-policy"]
    assert conversation.stats.no_reuse == {"tenant-policy": 1}


def test_completions_continuity(client: kvturn.OpenAI, router: FakeRouter) -> None:
    conversation = client.conversation()
    conversation.completions.create(model=MODEL, prompt="Hello")
    conversation.completions.create(model=MODEL, prompt="Hello world, and")
    assert router.turns()[-1].no_reuse is None
    conversation.completions.create(model=MODEL, prompt="Hello world, and then some")
    list(conversation.completions.create(model=MODEL, prompt="Hello world, and then some more",
                                         stream=True))
    assert router.turns()[-1].no_reuse == "reply-changed"
    conversation.completions.create(model=MODEL, prompt="Goodbye")
    assert router.turns()[-1].no_reuse == "edited"
    router.script.append(httpx2.Response(200, json=completion(" x", token_ids=[7, 8])))
    conversation.completions.create(model=MODEL, prompt=[1, 2, 3])
    assert router.turns()[-1].no_reuse == "edited"
    conversation.completions.create(model=MODEL, prompt=[1, 2, 3, 7, 8, 9])
    assert router.turns()[-1].no_reuse is None


def test_a_chat_turn_after_a_completion_is_not_an_extension(client: kvturn.OpenAI,
                                                            router: FakeRouter) -> None:
    conversation = client.conversation()
    conversation.completions.create(model=MODEL, prompt="Hello")
    ask(conversation, [{"role": "user", "content": "Hello"}])
    assert router.turns()[-1].no_reuse == "api-changed"


def test_a_failed_turn_leaves_the_record_as_it_was(client: kvturn.OpenAI,
                                                   router: FakeRouter) -> None:
    conversation = client.conversation()
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    ask(conversation, messages)
    router.script.append(error(400, message="nope"))
    with pytest.raises(openai.BadRequestError):
        ask(conversation, [{"role": "user", "content": "something else entirely"}])
    ask(conversation, [*messages, {"role": "assistant", "content": "Hello"},
                       {"role": "user", "content": "next"}])
    assert router.turns()[-1].no_reuse is None
    assert conversation.stats.turns == 2


async def test_async_continuity_and_streaming(aclient: kvturn.AsyncOpenAI,
                                              arouter: FakeRouter) -> None:
    arouter.stream_reply = lambda r: chat_chunks("Sure thing.", reasoning="easy")
    conversation = aclient.conversation()
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    stream = await conversation.chat.completions.create(model=MODEL, messages=messages,
                                                        stream=True)
    assert conversation.last_turn is not None and conversation.last_turn.streamed
    body = arouter.bodies[-1]
    parts = []
    async for chunk in stream:
        if not parts:
            assert body.produced < len(body.events)
        parts.append(chunk.choices[0].delta.content or "")
    messages += [{"role": "assistant", "content": "".join(parts), "reasoning_content": "easy "},
                 {"role": "user", "content": "Again"}]
    await conversation.chat.completions.create(model=MODEL, messages=messages)
    assert arouter.turns()[-1].no_reuse is None
    messages[1] = {"role": "assistant", "content": "".join(parts)}
    await conversation.chat.completions.create(model=MODEL, messages=messages)
    assert arouter.turns()[-1].no_reuse == "reasoning-stripped"


def test_raw_responses_are_observed_too(client: kvturn.OpenAI, router: FakeRouter) -> None:
    conversation = client.conversation()
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    raw = conversation.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse())
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "x"}]
    conversation.chat.completions.with_raw_response.create(model=MODEL, messages=messages)
    assert router.turns()[-1].no_reuse is None
    # the raw (non-streamed) reply was seen: a different one is caught
    messages += [{"role": "assistant", "content": "not what was said"},
                 {"role": "user", "content": "y"}]
    ask(conversation, messages)
    assert router.turns()[-1].no_reuse == "reply-changed"


def test_with_streaming_response_leaves_the_reply_unknown(client: kvturn.OpenAI,
                                                          router: FakeRouter) -> None:
    conversation = client.conversation()
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    with conversation.chat.completions.with_streaming_response.create(
            model=MODEL, messages=messages) as response:
        assert conversation.last_turn is not None and conversation.last_turn.reuse == "miss"
        response.read()
    messages += [{"role": "assistant", "content": "whatever"}, {"role": "user", "content": "y"}]
    ask(conversation, messages)
    assert router.turns()[-1].no_reuse is None  # prefix-only check


def test_a_stream_of_unexpected_shape_only_makes_the_reply_unknown(
        client: kvturn.OpenAI, router: FakeRouter) -> None:
    router.stream_reply = lambda r: [{"id": "x", "object": "chat.completion.chunk", "created": 1,
                                      "model": MODEL, "choices": [{"index": 0, "delta": "odd",
                                                                   "finish_reason": None}]}]
    conversation = client.conversation()
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    assert len(list(ask(conversation, messages, stream=True))) == 1  # the caller still gets it
    ask(conversation, [*messages, {"role": "assistant", "content": "anything"},
                       {"role": "user", "content": "?"}])
    assert router.turns()[-1].no_reuse is None  # prefix-only check


def test_an_abandoned_stream_is_not_kept_alive(client: kvturn.OpenAI) -> None:
    import gc
    import weakref

    conversation = client.conversation()
    stream = ask(conversation, [{"role": "user", "content": "Hi"}], stream=True)
    response = weakref.ref(stream.response)
    follower_of(stream)  # it is followed
    stream.close()
    del stream
    gc.collect()
    assert response() is None


async def test_a_conversation_inherits_the_clients_platform(aclient: kvturn.AsyncOpenAI) -> None:
    # openai's async client looks its platform up in a worker thread on its first request;
    # conversations (copies) must not pay that each, whether or not the client has asked yet.
    async with aclient.conversation() as first, aclient.conversation() as second:
        assert first._platform is not None and second._platform is first._platform
        await first.chat.completions.create(model=MODEL,
                                            messages=[{"role": "user", "content": "Hi"}])
        assert first._platform is aclient._platform
