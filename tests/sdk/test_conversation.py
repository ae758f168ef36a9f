"""Scoped clients: ids on every request, forks, release on close, turns sent as written."""

from __future__ import annotations

import io
import re
from typing import Any

import httpx2
import openai
import pytest

import kvturn
from tests.fakes.router import FakeRouter, chat_chunks, chat_completion, error

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


# --- edited histories on the wire ----------------------------------------------------------
# The SDK sends every turn as the caller wrote it: whether it extends the previous one is the
# router's and the connector's to find out, exactly (docs/sdk.md, "Edited histories").

def test_edited_histories_go_to_the_router_as_written(client: kvturn.OpenAI,
                                                      router: FakeRouter) -> None:
    router.reply = lambda r: chat_completion("It is 4.", reasoning="2+2 is 4")
    conversation = client.conversation()
    messages: list[Any] = [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "2+2?"}]
    reply = ask(conversation, messages)
    # the reply without its reasoning, the system prompt edited in place, then a truncation,
    # the same prompt again, a changed reply, and a switch of API
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "And 3+3?"}]
    messages[0]["content"] = "Be verbose."
    ask(conversation, messages)
    ask(conversation, messages[:1])
    ask(conversation, messages[:1])
    ask(conversation, [*messages[:1], {"role": "assistant", "content": "Not what was said"},
                       {"role": "user", "content": "?"}])
    conversation.completions.create(model=MODEL, prompt="Goodbye")
    sent = router.turns()
    assert len(sent) == 6 and all("x-kvturn-no-reuse" not in r.headers for r in sent)
    assert sent[1].body["messages"][0] == {"role": "system", "content": "Be verbose."}
    # the router reuses what still verifies (the fake one reports every retained turn a hit)
    assert conversation.last_turn is not None and conversation.last_turn.reuse == "hit"
    assert conversation.last_turn.no_reuse_reason is None
    stats = conversation.stats
    assert stats.no_reuse == {} and stats.hits == 5 and stats.misses == {"miss": 1}


@pytest.mark.parametrize("spelling", ["x-kvturn-no-reuse", "X-KVTurn-No-Reuse"])
def test_the_callers_own_no_reuse_header_goes_as_written_and_is_reported(
        client: kvturn.OpenAI, router: FakeRouter, spelling: str) -> None:
    conversation = client.conversation()
    ask(conversation, [{"role": "user", "content": "Hi"}])
    ask(conversation, [{"role": "user", "content": "Hi"}],
        extra_headers={spelling: "tenant-policy"})
    assert router.turns()[-1].headers.get_list("x-kvturn-no-reuse") == ["tenant-policy"]
    assert conversation.last_turn is not None
    assert conversation.last_turn.no_reuse_reason == "tenant-policy"
    assert conversation.last_turn.reuse == "disabled"
    assert conversation.stats.no_reuse == {"tenant-policy": 1}


def test_a_failed_turn_is_not_counted(client: kvturn.OpenAI, router: FakeRouter) -> None:
    conversation = client.conversation()
    ask(conversation, [{"role": "user", "content": "Hi"}])
    first = conversation.last_turn
    router.script.append(error(400, message="nope"))
    with pytest.raises(openai.BadRequestError):
        ask(conversation, [{"role": "user", "content": "something else entirely"}])
    assert conversation.last_turn == first and conversation.stats.turns == 1


def test_a_stream_reaches_the_caller_unbuffered_and_unwrapped(client: kvturn.OpenAI,
                                                              router: FakeRouter) -> None:
    router.stream_reply = lambda r: chat_chunks("Let me check the weather.",
                                                reasoning="I need data", tool_calls=[CALL])
    conversation = client.conversation()
    stream = ask(conversation, [{"role": "user", "content": "Weather?"}], stream=True)
    assert stream._client is conversation  # nothing of kvturn's runs per chunk
    body = router.bodies[-1]
    first = next(stream)
    assert first.choices[0].delta.role == "assistant"
    assert body.produced < len(body.events)  # the caller got a chunk before the body ended
    list(stream)
    assert body.produced == len(body.events)


async def test_async_streams_and_edits(aclient: kvturn.AsyncOpenAI,
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
    messages += [{"role": "assistant", "content": "".join(parts)},
                 {"role": "user", "content": "Again"}]
    messages[0] = {"role": "user", "content": "Hello"}
    await conversation.chat.completions.create(model=MODEL, messages=messages)
    assert "x-kvturn-no-reuse" not in arouter.turns()[-1].headers
    assert conversation.last_turn.reuse == "hit" and conversation.stats.no_reuse == {}


async def test_a_conversation_inherits_the_clients_platform(aclient: kvturn.AsyncOpenAI) -> None:
    # openai's async client looks its platform up in a worker thread on its first request;
    # conversations (copies) must not pay that each, whether or not the client has asked yet.
    async with aclient.conversation() as first, aclient.conversation() as second:
        assert first._platform is not None and second._platform is first._platform
        await first.chat.completions.create(model=MODEL,
                                            messages=[{"role": "user", "content": "Hi"}])
        assert first._platform is aclient._platform
