"""The decode leg's usage: asked for on streams, read from replies and from a stream's last
events, and cut out of a stream whose client did not ask for it (router/_apis.py, _stream.py,
_decode_step.py; docs/http-api.md, B "Usage")."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvturn_server.router import _json
from kvturn_server.router._apis import CHAT, COMPLETIONS, MESSAGES, RESPONSES
from kvturn_server.router._legs import DecodeUsage
from kvturn_server.router._stream import UsageTap
from tests.fakes.backends import DEFAULT_SSE, Cluster, sse
from tests.fakes.router_harness import MakeHarness

USAGE = {"prompt_tokens": 300, "completion_tokens": 7, "total_tokens": 307,
         "prompt_tokens_details": {"cached_tokens": 256}}


# Reading it, per API.

def test_chat_and_completions_read_prompt_completion_and_cached_tokens() -> None:
    for api in (CHAT, COMPLETIONS):
        assert api.usage({"usage": USAGE}) == DecodeUsage(300, 7, 256)
        assert api.usage({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}) \
            == DecodeUsage(5, 1, None)  # a decode without --enable-prompt-tokens-details
        assert api.usage({"choices": []}) is None
        assert api.usage({"usage": {"prompt_tokens": "300"}}) is None
        assert api.prompt_tokens({"usage": USAGE}) == 300
    assert DecodeUsage(300, 7, 256).total_tokens == 307


def test_messages_add_the_cache_read_back_into_the_prompt() -> None:
    # vLLM's Anthropic usage: input_tokens = prompt - cache_read - cache_creation.
    usage = {"input_tokens": 44, "output_tokens": 7, "cache_read_input_tokens": 256}
    assert MESSAGES.usage({"usage": usage}) == DecodeUsage(300, 7, 256)
    # message_delta, the stream's last event with usage.
    assert MESSAGES.usage({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                           "usage": usage}) == DecodeUsage(300, 7, 256)
    assert MESSAGES.usage({"usage": {"input_tokens": 300, "output_tokens": 7}}) == \
        DecodeUsage(300, 7, None)
    assert MESSAGES.prompt_tokens({"usage": usage}) == 300


def test_responses_read_the_reply_s_or_the_final_event_s_response() -> None:
    usage = {"input_tokens": 300, "output_tokens": 7, "total_tokens": 307,
             "input_tokens_details": {"cached_tokens": 256}}
    assert RESPONSES.usage({"object": "response", "usage": usage}) == DecodeUsage(300, 7, 256)
    assert RESPONSES.usage({"type": "response.completed", "response": {"usage": usage}}) == \
        DecodeUsage(300, 7, 256)
    assert RESPONSES.usage({"type": "response.completed", "response": {}}) is None


# Asking for it.

def test_a_chat_stream_asks_for_usage_and_says_when_the_client_did_not() -> None:
    body = {"stream": True, "messages": []}
    asked, strip = CHAT.ask_usage(body)
    assert strip and asked["stream_options"] == {"include_usage": True,
                                                 "continuous_usage_stats": False}
    assert "stream_options" not in body  # the client's body is not changed
    # The client's other options stay; continuous usage without include_usage did nothing,
    # and is not switched on by the router's ask.
    asked, strip = COMPLETIONS.ask_usage({"stream": True, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}})
    assert strip and asked["stream_options"] == {"include_usage": True,
                                                 "continuous_usage_stats": False}
    own = {"stream": True, "stream_options": {"include_usage": True,
                                              "continuous_usage_stats": True}}
    assert CHAT.ask_usage(own) == (own, False)
    plain = {"stream": False}
    assert CHAT.ask_usage(plain) == (plain, False)
    # Messages and Responses streams carry usage anyway.
    for api in (MESSAGES, RESPONSES):
        assert api.ask_usage(body) == (body, False)


# Finding it in a stream.

EVENTS = b"".join(sse({"choices": [{"delta": {"content": "a"}, "finish_reason": "stop"}]}))
USAGE_EVENT = b"".join(sse({"choices": [], "usage": USAGE}))


def test_the_tap_cuts_the_usage_event_the_client_did_not_ask_for() -> None:
    tap = UsageTap(strip=True)
    assert tap.take(EVENTS) == EVENTS
    assert tap.take(EVENTS + USAGE_EVENT) == EVENTS
    assert tap.take(USAGE_EVENT) == b""
    assert tap.event() == {"choices": [], "usage": USAGE}


def test_the_tap_leaves_usage_the_client_asked_for_and_reads_it_at_the_end() -> None:
    tap = UsageTap(strip=False)
    continuous = b"".join(sse({"choices": [{"delta": {"content": "a"}}],
                               "usage": {"prompt_tokens": 300, "completion_tokens": 1}}))
    assert tap.take(continuous) == continuous
    assert tap.take(EVENTS + USAGE_EVENT) == EVENTS + USAGE_EVENT
    assert tap.event() == {"choices": [], "usage": USAGE}  # the last one: the final usage
    assert UsageTap(strip=False).event() is None
    # Responses: the usage is in the held final event.
    final = b"event: response.completed\ndata: " + _json.dumps(
        {"type": "response.completed", "response": {"usage": {"input_tokens": 3}}}) + b"\n\n"
    tap = UsageTap(strip=False)
    tap.take(EVENTS)
    assert tap.event(final)["response"]["usage"] == {"input_tokens": 3}


def test_generated_text_that_spells_usage_is_not_cut() -> None:
    text = b"".join(sse({"choices": [{"delta": {"content": 'say "usage": {1}'}}]}))
    assert b'\\"usage\\":' in text
    assert UsageTap(strip=True).take(text) == text


# Through the router.

def usage_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.kvturn_fields for r in caplog.records if r.getMessage() == "request"]


async def test_a_reply_s_usage_is_the_turn_s(make_harness: MakeHarness,
                                            caplog: pytest.LogCaptureFixture) -> None:
    cluster = Cluster()
    h = await make_harness(cluster)
    with caplog.at_level(logging.DEBUG, logger="kvturn.router"):
        resp = await h.chat("c")
    assert resp.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    (line,) = usage_lines(caplog)
    assert (line["prompt_tokens"], line["cached_tokens"], line["completion_tokens"]) == \
        (64, 64, 2)


async def test_a_stream_s_usage_is_read_and_cut_out_when_the_client_did_not_ask(
        make_harness: MakeHarness, caplog: pytest.LogCaptureFixture) -> None:
    cluster = Cluster()
    h = await make_harness(cluster)
    with caplog.at_level(logging.DEBUG, logger="kvturn.router"):
        resp = await h.chat("c", stream=True)
    # Byte for byte the stream the decode sends a client that asks for no usage.
    assert resp.content == b"".join(DEFAULT_SSE)
    assert cluster.bodies("decode0")[-1]["stream_options"] == {
        "include_usage": True, "continuous_usage_stats": False}
    (line,) = usage_lines(caplog)
    assert (line["prompt_tokens"], line["cached_tokens"]) == (64, 64)


async def test_a_stream_s_usage_reaches_a_client_that_asked(
        make_harness: MakeHarness, caplog: pytest.LogCaptureFixture) -> None:
    cluster = Cluster()
    h = await make_harness(cluster)
    cluster.decodes[0].usage_prompt_tokens = 90
    with caplog.at_level(logging.DEBUG, logger="kvturn.router"):
        resp = await h.chat("c", stream=True, stream_options={"include_usage": True})
    assert b'"prompt_tokens":90' in resp.content
    assert resp.content.endswith(b"data: [DONE]\n\n")
    assert cluster.bodies("decode0")[-1]["stream_options"] == {"include_usage": True}
    (line,) = usage_lines(caplog)
    assert (line["prompt_tokens"], line["cached_tokens"]) == (90, 90)


async def test_a_decode_without_usage_leaves_the_turn_without(
        make_harness: MakeHarness, caplog: pytest.LogCaptureFixture) -> None:
    cluster = Cluster()
    h = await make_harness(cluster)
    chunks = list(DEFAULT_SSE)
    cluster.decodes[0].chunks = chunks  # an older decode: no usage event, whatever is asked

    def plain(body: dict[str, Any]) -> Any:
        return cluster.decodes[0].stream_response({**body, "stream_options": None})

    cluster.decodes[0].fail_next(plain)
    with caplog.at_level(logging.DEBUG, logger="kvturn.router"):
        resp = await h.chat("c", stream=True)
    assert resp.content == b"".join(chunks)
    (line,) = usage_lines(caplog)
    assert "prompt_tokens" not in line
