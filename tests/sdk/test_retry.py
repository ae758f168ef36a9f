"""Retries: kvturn owns them (openai's inner loop is off), with tenacity and the router's hints."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest

import kvturn
from tests.fakes.router import FakeClock, FakeRouter, Recorded, error, sse_bytes
from tests.fakes.router_api import BASE_URL

MODEL = "kvturn-tiny"
MESSAGES = [{"role": "user", "content": "Hi"}]


def ask(target: Any, **kwargs: Any) -> Any:
    return target.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)


def test_a_transient_error_is_retried_after_retry_after(client: kvturn.OpenAI, router: FakeRouter,
                                                        clock: FakeClock) -> None:
    router.script.append(error(503, headers={"Retry-After": "2", "x-should-retry": "true"}))
    conversation = client.conversation("c")
    reply = ask(conversation)
    assert reply.choices[0].message.content == "Hello"
    assert clock.sleeps == [2.0]
    first, second = router.turns()
    assert first.body == second.body and second.body["conversation_id"] == "c"
    assert [first.headers["x-stainless-retry-count"],
            second.headers["x-stainless-retry-count"]] == ["0", "1"]
    assert conversation.last_turn is not None and conversation.last_turn.attempts == 2
    assert conversation.stats.retries == 1 and conversation.stats.turns == 1


def test_retry_after_ms_is_preferred(client: kvturn.OpenAI, router: FakeRouter,
                                     clock: FakeClock) -> None:
    router.script.append(error(429, headers={"retry-after-ms": "250", "Retry-After": "9"}))
    ask(client)
    assert clock.sleeps == [0.25]


def test_retry_after_as_an_http_date(client: kvturn.OpenAI, router: FakeRouter,
                                     clock: FakeClock) -> None:
    router.script.append(error(503, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}))
    ask(client)
    assert clock.sleeps == [0.0]  # a date in the past: retry at once


@pytest.mark.parametrize("status", [429, 502, 503, 504])
def test_transient_statuses(client: kvturn.OpenAI, router: FakeRouter, status: int) -> None:
    router.script.append(error(status))
    ask(client)
    assert len(router.turns()) == 2


@pytest.mark.parametrize(("status", "headers", "raised"), [
    (500, {}, openai.InternalServerError),
    (400, {}, openai.BadRequestError),
    (409, {}, openai.ConflictError),
    (503, {"x-should-retry": "false"}, openai.InternalServerError),
    (429, {"Retry-After": "300"}, openai.RateLimitError),  # longer than max_retry_after
])
def test_final_errors_are_not_retried(client: kvturn.OpenAI, router: FakeRouter, status: int,
                                      headers: dict[str, str],
                                      raised: type[Exception]) -> None:
    router.script.append(error(status, headers=headers))
    with pytest.raises(raised):
        ask(client)
    assert len(router.turns()) == 1


def test_x_should_retry_true_overrides_the_status(client: kvturn.OpenAI,
                                                  router: FakeRouter) -> None:
    router.script.append(error(400, headers={"x-should-retry": "true"}))
    ask(client)
    assert len(router.turns()) == 2


def test_attempts_are_max_retries_plus_one_and_never_multiply(
        router: FakeRouter, policy: kvturn.RetryPolicy) -> None:
    # If openai's own loop (max_retries=3 -> 4 attempts) ran inside kvturn's, a router that
    # always fails would see 16 requests.
    router.script.extend(error(503) for _ in range(20))
    http = httpx2.Client(transport=httpx2.MockTransport(router))
    client = kvturn.OpenAI(base_url=BASE_URL, api_key="-", http_client=http, max_retries=3,
                           retry_policy=policy)
    with pytest.raises(openai.InternalServerError):
        ask(client)
    assert len(router.turns()) == 4
    with pytest.raises(openai.InternalServerError):
        ask(client.with_options(max_retries=0))
    assert len(router.turns()) == 5
    with pytest.raises(openai.InternalServerError):
        ask(client.conversation().with_options(max_retries=1))
    assert len(router.turns()) == 7
    assert client.max_retries == 3  # the user's setting is what the client reports


def test_backoff_is_exponential_with_jitter(client: kvturn.OpenAI, router: FakeRouter,
                                            clock: FakeClock) -> None:
    router.script.extend([error(502), error(502)])
    ask(client)
    first, second = clock.sleeps
    policy = client.retry_policy
    assert policy.initial_delay <= first <= policy.initial_delay + policy.jitter
    assert 2 * policy.initial_delay <= second <= 2 * policy.initial_delay + policy.jitter


def test_total_time_is_bounded(router: FakeRouter, clock: FakeClock) -> None:
    policy = kvturn.RetryPolicy(max_elapsed=5, sleep=clock.sleep, clock=clock)
    router.script.extend(error(503, headers={"Retry-After": "3"}) for _ in range(5))
    http = httpx2.Client(transport=httpx2.MockTransport(router))
    client = kvturn.OpenAI(base_url=BASE_URL, api_key="-", http_client=http, max_retries=10,
                           retry_policy=policy)
    with pytest.raises(openai.InternalServerError):
        ask(client)
    # t=0 fails, waits 3; t=3 fails, a second wait would end at t=6 > 5: give up
    assert clock.sleeps == [3.0]
    assert len(router.turns()) == 2


def test_connection_errors_are_retried(client: kvturn.OpenAI, router: FakeRouter) -> None:
    def refuse(recorded: Recorded) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused")

    router.script.append(refuse)
    ask(client)
    router.script.extend([refuse, refuse, refuse])
    with pytest.raises(openai.APIConnectionError):
        ask(client)


def test_a_stream_is_retried_until_it_starts_never_after(client: kvturn.OpenAI,
                                                         router: FakeRouter) -> None:
    router.script.append(error(503))
    assert "".join(c.choices[0].delta.content or "" for c in ask(client, stream=True)) == "Hello"
    assert len(router.turns()) == 2

    def broken_body() -> Iterator[bytes]:
        yield sse_bytes([{"id": "x", "object": "chat.completion.chunk", "created": 1,
                          "model": MODEL, "choices": [{"index": 0, "finish_reason": None,
                                                       "delta": {"content": "Hel"}}]}],
                        done=False)[0]
        raise httpx2.ReadError("connection reset")

    router.script.append(lambda r: httpx2.Response(200, headers={
        "content-type": "text/event-stream"}, content=broken_body()))
    conversation = client.conversation()
    stream = ask(conversation, stream=True)
    assert next(stream).choices[0].delta.content == "Hel"
    with pytest.raises(openai.APIConnectionError):
        next(stream)
    assert len(router.turns()) == 3
    assert conversation.stats.retries == 0


def test_a_retried_turn_updates_the_conversation_once(client: kvturn.OpenAI,
                                                      router: FakeRouter) -> None:
    conversation = client.conversation()
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    router.script.append(error(502))
    conversation.chat.completions.create(model=MODEL, messages=messages)
    messages += [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    conversation.chat.completions.create(model=MODEL, messages=messages)
    assert router.turns()[-1].no_reuse is None
    assert conversation.stats.turns == 2 and conversation.stats.retries == 1


def test_retries_taken_reports_kvturns_retries(client: kvturn.OpenAI, router: FakeRouter) -> None:
    router.script.append(error(503))
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert raw.retries_taken == 1


def test_a_file_upload_is_not_replayed(client: kvturn.OpenAI, router: FakeRouter) -> None:
    router.script.append(error(503))
    with pytest.raises(openai.InternalServerError):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
    assert len(router.requests) == 1


async def test_async_retries(aclient: kvturn.AsyncOpenAI, arouter: FakeRouter,
                             clock: FakeClock) -> None:
    arouter.script.append(error(503, headers={"Retry-After": "1.5"}))
    conversation = aclient.conversation()
    reply = await conversation.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == "Hello"
    assert clock.sleeps == [1.5] and conversation.stats.retries == 1
    arouter.script.extend(error(503) for _ in range(5))
    with pytest.raises(openai.InternalServerError):
        await aclient.with_options(max_retries=1).chat.completions.create(
            model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert len(arouter.turns()) == 4
    arouter.script.clear()
    arouter.script.append(error(503))
    stream = await conversation.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                                        stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == "Hello"


@pytest.mark.parametrize(("failure", "raised"), [
    (httpx2.ConnectError("connection refused"), openai.APIConnectionError),
    (httpx2.ReadTimeout("timed out"), openai.APITimeoutError)])
def test_connection_errors_stop_at_the_deadline(router: FakeRouter, clock: FakeClock,
                                                failure: Exception,
                                                raised: type[Exception]) -> None:
    # openai's loop retries these without asking _should_retry: kvturn stops it in
    # _sleep_for_retry, with the error openai itself raises when it gives up.
    def fail(recorded: Recorded) -> httpx2.Response:
        raise failure

    policy = kvturn.RetryPolicy(max_elapsed=0.2, sleep=clock.sleep, clock=clock)
    http = httpx2.Client(transport=httpx2.MockTransport(router))
    client = kvturn.OpenAI(base_url=BASE_URL, api_key="-", http_client=http, max_retries=5,
                           retry_policy=policy)
    conversation = client.conversation()
    router.script.extend([fail] * 6)
    with pytest.raises(raised) as caught:
        ask(conversation)
    assert type(caught.value) is raised and caught.value.__cause__ is failure
    assert len(router.turns()) == 1 and clock.sleeps == []  # the first wait (>= 0.5 s) is over
    assert conversation.stats.retries == 0 and conversation.last_turn is None


def test_a_file_upload_is_not_replayed_after_a_connection_error(client: kvturn.OpenAI,
                                                                router: FakeRouter) -> None:
    def refuse(recorded: Recorded) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused")

    router.script.append(refuse)
    with pytest.raises(openai.APIConnectionError):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
    assert len(router.requests) == 1
