"""The Messages (Anthropic) and Responses (OpenAI) APIs through the router: legs, reuse,
streams, errors, and the Responses state the router holds (docs/http-api.md, section A)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest

from kvturn_server.router import _json
from kvturn_server.router._apis import RESPONSES, split_final_event
from kvturn_server.router._identity import resolve_identity
from kvturn_server.router._legs import NO_RETENTION_PARAMS
from kvturn_server.router._state_responses import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
)
from tests.fakes.backends import FakeBackend, ManualClock
from tests.fakes.router_harness import Harness, MakeHarness

# Replies shaped like vLLM 0.32's, built on the fake decode's own (which retains and reports).


def _messages_decode(backend: FakeBackend) -> None:
    chat = backend._decode

    def decode(body: dict[str, Any]) -> httpx2.Response:
        if body.get("stream"):
            return chat(body)
        reply = chat(body).json()
        return httpx2.Response(200, json={
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 10, "output_tokens": 3},
            "kv_transfer_params": reply["kv_transfer_params"]})

    backend._decode = decode  # type: ignore[method-assign]


def _responses_decode(backend: FakeBackend, text: str = "Hello") -> None:
    chat = backend._decode

    def decode(body: dict[str, Any]) -> httpx2.Response:
        if body.get("stream"):
            return chat(body)
        reply = chat(body).json()
        return httpx2.Response(200, json={
            "id": body["request_id"], "object": "response", "status": "completed",
            "previous_response_id": None, "store": False,
            "output": [{"type": "message", "id": "msg_x", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": text}]}],
            "usage": {"input_tokens": 10, "output_tokens": 1},
            "kv_transfer_params": reply["kv_transfer_params"]})

    backend._decode = decode  # type: ignore[method-assign]


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\n".encode() + b"data: " + _json.dumps(payload) + b"\n\n"


async def _messages(h: Harness, *, stream: bool = False, headers: dict[str, str] | None = None,
                    **body: Any) -> httpx2.Response:
    payload = {"model": "m", "max_tokens": 20, "system": "be brief",
               "messages": [{"role": "user", "content": "hi"}], "stream": stream, **body}
    resp = await h.client.post("/v1/messages", json=payload, headers=headers or {})
    await h.router.wait_idle()
    return resp


async def _responses(h: Harness, *, headers: dict[str, str] | None = None,
                     **body: Any) -> httpx2.Response:
    payload = {"model": "m", "input": "hi", **body}
    resp = await h.client.post("/v1/responses", json=payload, headers=headers or {})
    await h.router.wait_idle()
    return resp


# Messages.

async def test_messages_run_both_legs_and_reuse_from_the_second_turn(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    _messages_decode(h.cluster.decodes[0])
    tools = [{"name": "f", "description": "d", "input_schema": {"type": "object"}}]
    first = await _messages(h, headers={"X-Conversation-ID": "m1"}, tools=tools)
    assert first.status_code == 200, first.text
    assert first.headers["X-KVTurn-Reuse"] == "miss"
    assert first.json()["stop_reason"] == "tool_use"
    assert "kv_transfer_params" not in first.json()
    [p_body] = h.cluster.bodies("prefill0")
    [d_body] = h.cluster.bodies("decode0")
    assert h.cluster.legs("prefill0")[0].path == "/v1/messages"
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"] == NO_RETENTION_PARAMS
    assert p_body["tools"] == tools and p_body["system"] == "be brief"
    assert d_body["max_tokens"] == 20
    assert d_body["kv_transfer_params"]["kvturn"]["conversation"] == "-/m1"
    second = await _messages(h, headers={"X-Conversation-ID": "m1"}, tools=tools, messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "42"}]}])
    assert second.headers["X-KVTurn-Reuse"] == "hit"
    assert second.headers["X-KVTurn-Route"] == "prefill"
    p2 = h.cluster.bodies("prefill0")[1]
    assert p2["kv_transfer_params"]["remote_engine_id"] == "decode0-engine-1"


async def test_messages_turns_continue_on_the_decode_from_messages_and_system(
        make_harness: MakeHarness) -> None:
    h = await make_harness(decode_continue_tokens=512)
    _messages_decode(h.cluster.decodes[0])
    await _messages(h, headers={"X-Conversation-ID": "m2"})
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"},
               {"role": "user", "content": "and?"}]
    resp = await _messages(h, headers={"X-Conversation-ID": "m2"}, messages=history)
    assert resp.headers["X-KVTurn-Route"] == "decode"
    assert len(h.cluster.bodies("prefill0")) == 1
    # Another system prompt is another prompt: no continuation from the old history.
    resp = await _messages(h, headers={"X-Conversation-ID": "m2"}, system="other",
                           messages=[*history, {"role": "assistant", "content": "x"},
                                     {"role": "user", "content": "y"}])
    assert resp.headers["X-KVTurn-Route"] == "prefill"


async def test_messages_stream_holds_message_stop_until_the_capture(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    decode = h.cluster.decodes[0]
    decode.chunks = [
        _event("message_start", {"type": "message_start", "message": {"id": "msg_1"}}),
        _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": "Hi"}}),
        _event("message_delta", {"type": "message_delta",
                                 "delta": {"stop_reason": "end_turn"}}),
        _event("message_stop", {"type": "message_stop"})]
    resp = await _messages(h, stream=True, headers={"X-Conversation-ID": "m3"})
    assert resp.status_code == 200
    assert resp.text.endswith('event: message_stop\ndata: {"type":"message_stop"}\n\n')
    # The capture ran before message_stop reached the client: the next turn reads it.
    assert [e.method for e in h.cluster.calls("decode0.control")] == ["GET"]
    again = await _messages(h, stream=True, headers={"X-Conversation-ID": "m3"})
    assert again.headers["X-KVTurn-Reuse"] == "hit"


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"stream": "yes"}, "stream")])
async def test_messages_refusals_are_anthropic_shaped(make_harness: MakeHarness,
                                                      body: dict[str, Any], param: str) -> None:
    h = await make_harness()
    resp = await _messages(h, **body)
    assert resp.status_code == 400
    payload = resp.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == "invalid_request_error"
    assert param in payload["error"]["message"]
    assert h.cluster.log == []


async def test_messages_backend_trouble_is_anthropic_shaped(make_harness: MakeHarness) -> None:
    h = await make_harness()
    h.cluster.decodes[0].fail_next("connect", "connect")
    resp = await _messages(h)
    assert resp.status_code == 502
    assert resp.json()["type"] == "error"
    assert resp.json()["error"]["type"] == "api_error"
    assert resp.headers["x-should-retry"] == "true"
    bad_json = await h.client.post("/v1/messages", content=b"{",
                                   headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["type"] == "error"


async def test_messages_broken_stream_ends_with_an_anthropic_error_event(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    decode = h.cluster.decodes[0]
    decode.chunks = [_event("message_start", {"type": "message_start"}),
                     _event("ping", {"type": "ping"}),
                     _event("message_stop", {"type": "message_stop"})]
    decode.fail_next(("break_after", 2))
    resp = await _messages(h, stream=True)
    assert resp.status_code == 200
    last = resp.text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    assert _json.loads(last.split("data: ", 1)[1])["error"]["type"] == "api_error"


# Responses.

async def test_responses_chain_expands_previous_response_id_and_reuses(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    _responses_decode(h.cluster.decodes[0])
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    first = await _responses(h, tools=tools, instructions="be brief")
    assert first.status_code == 200, first.text
    one = first.json()
    assert one["id"].startswith("resp_") and "kv_transfer_params" not in one
    assert first.headers["X-KVTurn-Conversation"] == one["id"]
    [p_body] = h.cluster.bodies("prefill0")
    [d_body] = h.cluster.bodies("decode0")
    assert h.cluster.legs("decode0")[0].path == "/v1/responses"
    assert p_body["max_output_tokens"] == 1 and p_body["store"] is False
    assert p_body["input"] == "hi" and d_body["input"] == "hi"
    assert d_body["store"] is False and d_body["request_id"] == one["id"]
    assert d_body["kv_transfer_params"]["kvturn"]["conversation"] == f"-/{one['id']}"

    output = [{"type": "function_call_output", "call_id": "c1", "output": "42"}]
    second = await _responses(h, previous_response_id=one["id"], input=output, tools=tools)
    assert second.status_code == 200, second.text
    two = second.json()
    assert two["previous_response_id"] == one["id"] and two["id"] != one["id"]
    assert second.headers["X-KVTurn-Reuse"] == "hit"
    assert second.headers["X-KVTurn-Conversation"] == one["id"]
    full = [{"role": "user", "content": "hi"}, *one["output"], *output]
    for body in (h.cluster.bodies("prefill0")[1], h.cluster.bodies("decode0")[1]):
        assert body["input"] == full
        assert "previous_response_id" not in body and body["store"] is False
        assert "instructions" not in body  # instructions do not carry over
    # The third turn expands the whole chain.
    third = await _responses(h, previous_response_id=two["id"], input="bye")
    assert h.cluster.bodies("decode0")[2]["input"] == [
        *full, *two["output"], {"role": "user", "content": "bye"}]
    assert third.headers["X-KVTurn-Conversation"] == one["id"]


async def test_responses_unknown_or_unstored_or_foreign_ids_are_not_found(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    _responses_decode(h.cluster.decodes[0])
    resp = await _responses(h, previous_response_id="resp_nope")
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error["code"] == "previous_response_not_found"
    assert error["param"] == "previous_response_id"
    assert h.cluster.log == []
    unstored = (await _responses(h, store=False)).json()
    assert (await _responses(h, previous_response_id=unstored["id"])).status_code == 404
    mine = (await _responses(h, headers={"Authorization": "Bearer a"})).json()
    other = await _responses(h, previous_response_id=mine["id"],
                             headers={"Authorization": "Bearer b"})
    assert other.status_code == 404
    ok = await _responses(h, previous_response_id=mine["id"],
                          headers={"Authorization": "Bearer a"})
    assert ok.status_code == 200


async def test_responses_records_expire(make_harness: MakeHarness) -> None:
    clock = ManualClock()
    h = await make_harness(clock=clock, responses_ttl=60.0)
    _responses_decode(h.cluster.decodes[0])
    one = (await _responses(h)).json()
    clock.advance(61)
    assert (await _responses(h, previous_response_id=one["id"])).status_code == 404


async def test_responses_conversation_parameter_accumulates(make_harness: MakeHarness) -> None:
    h = await make_harness()
    _responses_decode(h.cluster.decodes[0])
    first = await _responses(h, conversation="conv_1", store=False)
    assert first.json()["conversation"] == {"id": "conv_1"}
    assert first.headers["X-KVTurn-Conversation"] == "conv_1"
    second = await _responses(h, conversation={"id": "conv_1"}, input="more")
    assert second.headers["X-KVTurn-Reuse"] == "hit"
    assert h.cluster.bodies("decode0")[1]["input"] == [
        {"role": "user", "content": "hi"}, *first.json()["output"],
        {"role": "user", "content": "more"}]
    both = await _responses(h, conversation="conv_1", previous_response_id="resp_x")
    assert both.status_code == 400


@pytest.mark.parametrize(("body", "param"), [
    ({"background": True}, "background"), ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"stream": 1}, "stream"), ({"store": "no"}, "store"), ({"input": 5}, "input"),
    ({"previous_response_id": ""}, "previous_response_id")])
async def test_responses_refusals(make_harness: MakeHarness, body: dict[str, Any],
                                  param: str) -> None:
    h = await make_harness()
    resp = await _responses(h, **body)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == param
    assert h.cluster.log == []


async def test_responses_stream_is_stored_before_its_final_event(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    decode = h.cluster.decodes[0]
    final = {"type": "response.completed", "sequence_number": 3, "response": {
        "id": "resp_s1", "status": "completed", "output": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}],
        "kv_transfer_params": {"remote_host": "10.0.0.2"}}}
    decode.chunks = [
        _event("response.created", {"type": "response.created", "response": {"id": "resp_s1"}}),
        _event("response.output_text.delta", {"type": "response.output_text.delta",
                                              "delta": "x"}),
        _event("response.completed", final)]
    resp = await _responses(h, stream=True, request_id="resp_s1")
    assert resp.status_code == 200
    assert "event: response.completed" in resp.text
    assert "kv_transfer_params" not in resp.text
    second = await _responses(h, previous_response_id="resp_s1",
                              input=[{"type": "function_call_output", "call_id": "c1",
                                      "output": "1"}])
    assert second.status_code == 200
    assert second.headers["X-KVTurn-Reuse"] == "hit"
    assert h.cluster.bodies("decode0")[1]["input"][1]["type"] == "function_call"


async def test_responses_stream_events_carry_the_requests_own_fields(
        make_harness: MakeHarness) -> None:
    # The legs saw the expanded request (no previous_response_id, store false): every response
    # object the stream carries says what the client asked for, as a whole reply does.
    h = await make_harness()
    _responses_decode(h.cluster.decodes[0])
    first = await _responses(h, request_id="resp_p1")
    assert first.status_code == 200
    decode = h.cluster.decodes[0]
    leg = {"id": "resp_p2", "status": "in_progress", "previous_response_id": None,
           "store": False, "output": []}
    delta = {"type": "response.output_text.delta", "delta": "x", "sequence_number": 1}
    decode.chunks = [
        _event("response.created", {"type": "response.created", "response": leg}),
        _event("response.output_text.delta", delta),
        _event("response.completed", {"type": "response.completed", "response": {
            **leg, "status": "completed", "output": [
                {"type": "message", "id": "m", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": "x"}]}]}})]
    resp = await _responses(h, stream=True, request_id="resp_p2",
                            previous_response_id="resp_p1", input="more")
    assert resp.status_code == 200
    events = [_json.loads(line[6:]) for line in resp.text.split("\n")
              if line.startswith("data: ")]
    assert [e["type"] for e in events] == [
        "response.created", "response.output_text.delta", "response.completed"]
    for e in (events[0], events[2]):
        assert e["response"]["previous_response_id"] == "resp_p1", e
        assert e["response"]["store"] is True, e
    assert events[1] == delta
    # The leg itself was sent the expanded input, without the id.
    leg_body = h.cluster.bodies("decode0")[-1]
    assert "previous_response_id" not in leg_body and leg_body["store"] is False


def test_split_final_event() -> None:
    split = split_final_event((b"event: message_stop",))
    stop = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    delta = b'event: message_delta\ndata: {}\n\n'
    assert split(delta + stop) == (delta, stop)
    assert split(delta) == (delta, b"")
    assert split(b"event: message_stopped\ndata: {}\n\n") == (
        b"event: message_stopped\ndata: {}\n\n", b"")


# The response store, memory and Redis.

@pytest.fixture(params=["memory", "redis"])
async def response_store(request: pytest.FixtureRequest) -> AsyncIterator[ResponseStore]:
    if request.param == "memory":
        yield MemoryResponseStore(max_entries=3, max_bytes=12)
        return
    url = request.getfixturevalue("redis_url")
    # A prefix of its own: the byte total lives in Redis beside the records.
    store = RedisResponseStore(url, max_entries=3, max_bytes=12,
                               prefix=f"t{uuid.uuid4().hex[:8]}:")
    yield store
    await store.aclose()


async def test_response_store_round_trip_and_cap(response_store: ResponseStore) -> None:
    assert await response_store.get("a") is None
    for key in ("a", "b", "c"):
        assert await response_store.put(key, key.encode() * 3, 60.0) == 0
    assert await response_store.get("a") == b"aaa"  # a is now the most recently used
    assert await response_store.put("d", b"d", 60.0) == 1
    assert await response_store.get("b") is None
    assert await response_store.get("a") == b"aaa"
    assert await response_store.delete("a") is True
    assert await response_store.get("a") is None


async def test_response_store_byte_cap(response_store: ResponseStore) -> None:
    """At most 12 bytes of values in all: the least recently used go first, a rewrite counts
    its new size only, and a record over the cap on its own is refused without evicting."""
    assert await response_store.put("a", b"x" * 5, 60.0) == 0
    assert await response_store.put("b", b"y" * 5, 60.0) == 0
    assert await response_store.put("a", b"x" * 6, 60.0) == 0  # 11 bytes in all
    assert await response_store.put("c", b"z" * 4, 60.0) == 1  # 15 > 12: b (oldest) goes
    assert await response_store.get("b") is None
    assert await response_store.put("huge", b"h" * 13, 60.0) == 0
    assert await response_store.get("huge") is None
    assert await response_store.get("a") == b"x" * 6 and await response_store.get("c") == b"z" * 4
    assert await response_store.delete("a") is True
    assert await response_store.put("d", b"d" * 8, 60.0) == 0  # 4 + 8: a's bytes were freed
    assert await response_store.get("c") == b"z" * 4


async def test_memory_response_store_ttl_and_bytes() -> None:
    clock = ManualClock()
    store = MemoryResponseStore(max_entries=10, max_bytes=10, clock=clock)
    await store.put("a", b"12345", 5.0)
    await store.put("b", b"12345", 50.0)
    clock.advance(6)
    assert await store.get("a") is None and await store.get("b") == b"12345"
    assert await store.put("c", b"123456789", 50.0) == 1
    assert await store.get("b") is None
    assert await store.put("huge", b"x" * 11, 50.0) == 0
    assert await store.get("huge") is None
    assert await store.get("c") == b"123456789"  # a record too large alone evicts nothing


# Agents' own session headers (after kvturn's conventions).

@pytest.mark.parametrize(("headers", "expected", "source"), [
    ({"x-dynamo-session-id": "d1", "x-claude-code-session-id": "c1"}, "d1",
     "X-Dynamo-Session-ID"),
    ({"x-claude-code-session-id": "c1"}, "c1", "X-Claude-Code-Session-Id"),
    ({"x-claude-code-session-id": "c1", "x-claude-code-agent-id": "a7"}, "c1:a7",
     "X-Claude-Code-Session-Id"),
    ({"thread-id": "t1"}, "t1", "thread-id"),
    ({"x-deepseek-harness-session-id": "s1"}, "s1", "X-DeepSeek-Harness-Session-Id"),
    # An invalid agent value is no id (not a 400): the next header, or none, counts.
    ({"x-dynamo-session-id": "has space", "thread-id": "t2"}, "t2", "thread-id"),
])
def test_agent_session_headers_name_the_conversation(headers: dict[str, str], expected: str,
                                                     source: str) -> None:
    identity = resolve_identity({}, headers)
    assert identity is not None
    assert (identity.conversation_id, identity.source) == (expected, source)
    assert identity.key == f"-/{expected}"


def test_kvturn_conventions_come_before_agent_headers() -> None:
    identity = resolve_identity({"session_id": "own"}, {"x-claude-code-session-id": "c1"})
    assert identity is not None and identity.conversation_id == "own"
    assert resolve_identity({}, {"x-dynamo-session-id": ""}) is None


async def test_claude_code_turns_reuse_by_their_session_header(
        make_harness: MakeHarness) -> None:
    h = await make_harness()
    _messages_decode(h.cluster.decodes[0])
    headers = {"X-Claude-Code-Session-Id": "0b6f1c2e-claude"}
    await _messages(h, headers=headers)
    again = await _messages(h, headers=headers)
    assert again.headers["X-KVTurn-Conversation"] == "0b6f1c2e-claude"
    assert again.headers["X-KVTurn-Reuse"] == "hit"


async def test_messages_count_tokens_goes_to_a_prefill(make_harness: MakeHarness) -> None:
    h = await make_harness()
    h.cluster.prefills[0].fail_next(lambda body: httpx2.Response(200, json={
        "input_tokens": 7, "seen": sorted(body)}))
    resp = await h.client.post("/v1/messages/count_tokens", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "kv_transfer_params": {"remote_host": "x"}, "conversation_id": "c"})
    assert resp.status_code == 200
    assert resp.json() == {"input_tokens": 7, "seen": ["messages", "model"]}
    assert h.cluster.legs("prefill0")[0].path == "/v1/messages/count_tokens"
    h.cluster.prefills[0].fail_next("connect")
    down = await h.client.post("/v1/messages/count_tokens", json={"model": "m",
                                                                   "messages": []})
    assert down.status_code == 503 and down.json()["type"] == "error"


def test_responses_estimate_leaves_fed_back_logprobs_out() -> None:
    reply = {"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "ok", "logprobs": [{"token": "ok", "logprob": -0.1,
                                                             "top_logprobs": []}] * 50}]}
    with_logprobs = RESPONSES.transcript({"input": [{"role": "user", "content": "hi"}, reply]})
    plain = RESPONSES.transcript({"input": [
        {"role": "user", "content": "hi"},
        {**reply, "content": [{"type": "output_text", "text": "ok"}]}]})
    assert with_logprobs is not None and plain is not None
    assert with_logprobs.sizes == plain.sizes
    assert with_logprobs.roles == ["user", "assistant"]
