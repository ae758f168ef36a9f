"""kvturn's clients are openai's clients: every openai call runs unchanged, scoped or not."""

from __future__ import annotations

import httpx2
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import kvturn
from tests.fakes.router import FakeRouter
from tests.fakes.router_api import BASE_URL

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_clients_are_openai_clients(client: kvturn.OpenAI) -> None:
    assert isinstance(client, openai.OpenAI)
    conversation = client.conversation()
    assert isinstance(conversation, openai.OpenAI)
    assert isinstance(conversation, kvturn.OpenAI)
    assert isinstance(conversation, kvturn.Conversation)
    assert isinstance(kvturn.AsyncOpenAI(api_key="-", base_url=BASE_URL), openai.AsyncOpenAI)


def test_a_plain_kvturn_client_sends_what_openai_sends(client: kvturn.OpenAI,
                                                        router: FakeRouter) -> None:
    reply = client.chat.completions.create(model="kvturn-tiny", messages=MESSAGES)  # type: ignore[arg-type]
    assert isinstance(reply, ChatCompletion)
    assert reply.choices[0].message.content == "Hello"
    sent = router.requests[-1]
    assert sent.body == {"model": "kvturn-tiny", "messages": MESSAGES}
    assert sent.conversation_header is None and sent.no_reuse is None
    assert sent.headers["user-agent"] == f"OpenAI/Python {openai.__version__}"
    assert sent.headers["authorization"] == "Bearer sk-test"


def test_chat_completions_streaming_and_raw_responses(client: kvturn.OpenAI) -> None:
    for target in (client, client.conversation()):
        chunks = list(target.chat.completions.create(
            model="kvturn-tiny", messages=MESSAGES, stream=True))  # type: ignore[arg-type]
        assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello"

        with target.chat.completions.create(model="kvturn-tiny", messages=MESSAGES,  # type: ignore[arg-type]
                                            stream=True) as stream:
            assert stream.response.status_code == 200
            assert next(iter(stream)).choices[0].delta.role == "assistant"

        raw = target.chat.completions.with_raw_response.create(
            model="kvturn-tiny", messages=MESSAGES)  # type: ignore[arg-type]
        assert raw.headers["x-kvturn-reuse"] in kvturn.REUSE_OUTCOMES
        assert raw.parse().choices[0].message.content == "Hello"
        assert raw.retries_taken == 0

        with target.chat.completions.with_streaming_response.create(
                model="kvturn-tiny", messages=MESSAGES) as response:  # type: ignore[arg-type]
            # not parsed by _observe: its body is the caller's to read
            assert not isinstance(response, kvturn._compat.LegacyAPIResponse)
            assert response.parse().choices[0].message.content == "Hello"

        raw_stream = target.chat.completions.with_raw_response.create(
            model="kvturn-tiny", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        assert isinstance(raw_stream, kvturn._compat.LegacyAPIResponse)
        assert "".join(c.choices[0].delta.content or "" for c in raw_stream.parse()) == "Hello"


def test_completions_and_models(client: kvturn.OpenAI, router: FakeRouter) -> None:
    for target in (client, client.conversation()):
        done = target.completions.create(model="kvturn-tiny", prompt="Hello")
        assert isinstance(done, Completion) and done.choices[0].text == " world"
        text = "".join(c.choices[0].text for c in target.completions.create(
            model="kvturn-tiny", prompt="Hello", stream=True))
        assert text == " world"
        assert [m.id for m in target.models.list()] == ["kvturn-tiny"]
    assert router.requests[-1].method == "GET" and router.requests[-1].body is None


def test_with_options_and_copy_keep_the_class_and_settings(client: kvturn.OpenAI) -> None:
    policy = kvturn.RetryPolicy(max_elapsed=3)
    copied = client.with_options(timeout=5.0, max_retries=7, retry_policy=policy)
    assert type(copied) is kvturn.OpenAI
    assert copied.timeout == 5.0 and copied.max_retries == 7 and copied.retry_policy is policy
    assert copied.keepalive_interval == client.keepalive_interval
    assert client.copy(keepalive_interval=1.5).keepalive_interval == 1.5
    # like openai, a copy shares the HTTP client
    assert copied._client is client._client

    conversation = client.conversation()
    scoped = conversation.with_options(timeout=2.0)
    assert isinstance(scoped, kvturn.Conversation)
    assert scoped.id == conversation.id and scoped.timeout == 2.0
    assert scoped.retry_policy is client.retry_policy


def test_timeouts_reach_the_request(client: kvturn.OpenAI, router: FakeRouter) -> None:
    client.conversation().with_options(timeout=3.5).chat.completions.create(
        model="kvturn-tiny", messages=MESSAGES)  # type: ignore[arg-type]
    assert router.requests[-1].headers["x-stainless-read-timeout"] == "3.5"


def test_openai_errors_come_through_as_openai_errors(client: kvturn.OpenAI,
                                                     router: FakeRouter) -> None:
    router.script.append(httpx2.Response(400, json={"error": {
        "message": "bad input", "type": "invalid_request_error", "param": "messages",
        "code": None}}))
    with pytest.raises(openai.BadRequestError, match="bad input"):
        client.conversation().chat.completions.create(model="kvturn-tiny", messages=MESSAGES)  # type: ignore[arg-type]


def test_a_subclass_of_the_client_keeps_its_overrides_in_conversations(
        router: FakeRouter) -> None:
    class Tagged(kvturn.OpenAI):
        def tag(self) -> str:
            return "mine"

    client = Tagged(base_url=BASE_URL, api_key="-",
                    http_client=httpx2.Client(transport=httpx2.MockTransport(router)))
    conversation = client.conversation("tagged")
    assert isinstance(conversation, Tagged) and isinstance(conversation, kvturn.Conversation)
    assert conversation.tag() == "mine" and conversation.id == "tagged"
    assert isinstance(conversation.fork("a"), Tagged)


async def test_async_client_runs_openai_calls_unchanged(aclient: kvturn.AsyncOpenAI,
                                                        arouter: FakeRouter) -> None:
    for target in (aclient, aclient.conversation()):
        reply = await target.chat.completions.create(model="kvturn-tiny", messages=MESSAGES)  # type: ignore[arg-type]
        assert reply.choices[0].message.content == "Hello"
        stream = await target.chat.completions.create(model="kvturn-tiny", messages=MESSAGES,  # type: ignore[arg-type]
                                                      stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in stream]) == "Hello"
        raw = await target.chat.completions.with_raw_response.create(
            model="kvturn-tiny", messages=MESSAGES)  # type: ignore[arg-type]
        assert raw.parse().choices[0].message.content == "Hello"
        async with target.chat.completions.with_streaming_response.create(
                model="kvturn-tiny", messages=MESSAGES) as response:  # type: ignore[arg-type]
            assert (await response.parse()).choices[0].message.content == "Hello"
        done = await target.completions.create(model="kvturn-tiny", prompt="Hello")
        assert done.choices[0].text == " world"
    copied = aclient.with_options(timeout=4.0)
    assert type(copied) is kvturn.AsyncOpenAI and copied.timeout == 4.0
    assert arouter.requests[0].headers["user-agent"] == f"AsyncOpenAI/Python {openai.__version__}"
