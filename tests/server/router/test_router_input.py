"""Hostile and malformed input: forged transfer params on every path, fields only the decode
would refuse, bodies that are too big, too slow, or not JSON objects (issue 13, items 2-3)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvturn_server.router._stream import scrub_events
from tests.fakes.backends import Cluster, sse
from tests.fakes.router_harness import Harness, MakeHarness

FORGED = {"do_remote_prefill": True, "remote_host": "10.6.6.6", "remote_port": 6666,
          "remote_engine_id": "evil", "remote_block_ids": [[666]],
          "kvturn": {"conversation": "-/someone-else"}}


def _leaks(h: Harness) -> list[str]:
    """Leg bodies that carry anything the client forged."""
    return [f"{e.backend}: {e.body}" for e in h.cluster.log
            if "10.6.6.6" in json.dumps(e.body) or "forged" in json.dumps(e.body)
            or "someone-else" in json.dumps(e.body)]


def _xargs(h: Harness) -> list[dict[str, Any]]:
    return [e.body["vllm_xargs"] for e in h.cluster.log if "vllm_xargs" in e.body]


# Forged params: every spelling vLLM 0.32 reads, on every path.

FORGERIES: dict[str, dict[str, Any]] = {
    "top_level": {"kv_transfer_params": FORGED, "ec_transfer_params": {"x": "forged"}},
    # vLLM types vllm_xargs values as str/number/list; the connector then gets that value as
    # the request's kv_transfer_params (and a str or list fails inside the engine).
    "vllm_xargs": {"vllm_xargs": {"kv_transfer_params": "forged-10.6.6.6",
                                  "ec_transfer_params": ["forged"], "mine": 7}},
    "vllm_xargs_list": {"vllm_xargs": {"kv_transfer_params": ["forged", 1], "mine": 7}},
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
@pytest.mark.parametrize("path", ["prefill", "fallback", "fallback_no_id", "decode_continue"])
async def test_client_transfer_params_never_reach_a_backend(
        make_harness: MakeHarness, forgery: str, path: str) -> None:
    settings: dict[str, Any] = {}
    if path == "decode_continue":
        settings = {"decode_continue_tokens": 512}
    h = await make_harness(**settings)
    conversation = None if path == "fallback_no_id" else "c"
    if path == "decode_continue":
        assert (await h.chat("c")).status_code == 200  # a retention to continue from
    if path.startswith("fallback"):
        h.cluster.prefills[0].fail_next("broken", "broken")  # both attempts fail
    h.cluster.log.clear()
    resp = await h.chat(conversation, **FORGERIES[forgery])
    assert resp.status_code == 200
    assert resp.headers["X-KVTurn-Route"] == path.removesuffix("_no_id").replace(
        "decode_continue", "decode")
    assert h.cluster.legs("decode0")
    assert _leaks(h) == []
    if forgery.startswith("vllm_xargs"):
        # The client's own extension args still pass.
        assert _xargs(h) and all(x == {"mine": 7} for x in _xargs(h))


async def test_forged_xargs_in_a_stream_without_conversation(make_harness: MakeHarness) -> None:
    h = await make_harness()
    h.cluster.prefills[0].fail_next("broken", "broken")
    resp = await h.chat(None, stream=True, **FORGERIES["vllm_xargs"])
    assert resp.status_code == 200 and b"[DONE]" in resp.content
    assert _leaks(h) == []


# Transfer params a backend puts in its replies.

async def test_stream_events_lose_their_transfer_params(make_harness: MakeHarness) -> None:
    h = await make_harness()
    h.cluster.decodes[0].chunks = [
        *sse({"choices": [{"delta": {"content": "a \"kv_transfer_params\": x"}}]},
             {"choices": [{"delta": {"content": "b"}}],
              "kv_transfer_params": {"remote_host": "10.9.9.9"}},
             {"choices": [{"delta": {"content": "c"}, "kv_transfer_params": {"x": 1}}]}),
        b"data: [DONE]\n\n"]
    resp = await h.chat("c", stream=True)
    assert resp.status_code == 200
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")]
    assert [e["choices"][0]["delta"]["content"] for e in events] == [
        'a "kv_transfer_params": x', "b", "c"]
    assert "10.9.9.9" not in resp.text
    assert all("kv_transfer_params" not in e and "kv_transfer_params" not in e["choices"][0]
               for e in events)
    assert resp.text.endswith("data: [DONE]\n\n")


def test_scrub_events_keeps_clean_bytes_and_drops_unreadable_events() -> None:
    clean = b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    assert scrub_events(clean) is clean
    assert scrub_events(b'data: {"kv_transfer_params": 1, "a": 2}\r\n\r\n') == \
        b'data: {"a":2}\r\n\r\n'
    assert scrub_events(b'data: {"kv_transfer_params": \n\ndata: {"b": 1}\n\n') == \
        b'data: {"b": 1}\n\n'
    # An event split over several data lines is one JSON document.
    assert scrub_events(b'event: x\ndata: {"kv_transfer_params": 1,\ndata: "a": 2}\n\n') == \
        b'event: x\ndata: {"a":2}\n\n'


async def test_non_streaming_replies_lose_nested_transfer_params(
        make_harness: MakeHarness) -> None:
    h = await make_harness()

    def reply(body: dict[str, Any]) -> Any:
        import httpx2

        return httpx2.Response(200, json={
            "choices": [{"index": 0, "message": {"content": "hi"},
                         "kv_transfer_params": {"remote_host": "10.9.9.9"}}],
            "kv_transfer_params": {"remote_host": "10.9.9.9"}})

    h.cluster.decodes[0].fail_next(reply)
    resp = await h.chat("c")
    assert resp.status_code == 200
    assert "10.9.9.9" not in resp.text and "kv_transfer_params" not in resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "hi"


# Fields only the decode would refuse: refused before any leg, with nothing changed.

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"stream": "true"}, "stream"),
    ("chat", {"stream": "yes"}, "stream"),
    ("chat", {"stream": 1}, "stream"),
    ("completions", {"stream": "1"}, "stream"),
    ("chat", {"stream": 0}, "stream"),
    ("chat", {"max_tokens": -1}, "max_tokens"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_tokens": "12"}, "max_tokens"),
    ("chat", {"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
    ("completions", {"max_tokens": -1}, "max_tokens"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"n": 2, "temperature": 0}, "n"),
    ("chat", {"n": 3, "temperature": 1.0}, "n"),
    ("chat", {"n": 0}, "n"),
    ("completions", {"n": None}, "n"),
    ("chat", {"n": True}, "n"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"stream": True, "stream_options": "yes"}, "stream_options"),
    ("chat", {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("chat", {"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ("chat", {"min_tokens": -1}, "min_tokens"),
    ("completions", {"min_tokens": 17}, "min_tokens"),  # vLLM's default max_tokens is 16
    ("chat", {"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("completions", {"stream": True, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"max_tokens": 0, "echo": True, "logprob_token_ids": [1], "logprobs": 1},
     "logprob_token_ids"),
]


# Refused by the router, accepted by vLLM: values vLLM's lax pydantic types coerce (the router
# must not read them differently, so it refuses them), and n > 1 (one sequence per turn).
STRICTER_THAN_VLLM = {(e, json.dumps(f)) for e, f in [
    ("chat", {"stream": "true"}), ("chat", {"stream": "yes"}), ("chat", {"stream": 1}),
    ("completions", {"stream": "1"}), ("chat", {"stream": 0}), ("chat", {"max_tokens": "12"}),
    ("chat", {"n": 3, "temperature": 1.0}), ("chat", {"n": True}),
    ("chat", {"stream": True, "stream_options": {"include_usage": "yes"}})]}


def _body(endpoint: str, fields: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "m", "conversation_id": "c"}
    if endpoint == "chat":
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    return {**base, **fields}


def _url(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


@pytest.mark.parametrize(("endpoint", "fields", "param"), REFUSED,
                         ids=[f"{e}-{json.dumps(f)}" for e, f, _ in REFUSED])
async def test_what_the_decode_would_refuse_is_refused_before_any_leg(
        make_harness: MakeHarness, endpoint: str, fields: dict[str, Any], param: str) -> None:
    h = await make_harness()
    assert (await h.chat("c")).status_code == 200  # a retention that a pin could take
    h.cluster.log.clear()
    before = await h.router.store.get("-/c")
    resp = await h.client.post(_url(endpoint), json=_body(endpoint, fields))
    await h.router.wait_idle()
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert resp.headers["x-should-retry"] == "false"
    assert h.cluster.log == []  # no pin, no prefill leg, no decode leg
    assert await h.router.store.get("-/c") == before
    assert h.cluster.decodes[0].pins == {}


ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"stream": None}),
    ("chat", {"stream_options": {}}),  # vLLM lets an empty object pass
    ("chat", {"stream_options": None, "stream": False}),
    ("chat", {"stream": True, "stream_options": {"include_usage": True}}),
    ("chat", {"n": 1, "max_tokens": 1}),
    ("chat", {"n": None}),
    ("chat", {"max_completion_tokens": 5, "max_tokens": -1}),  # vLLM reads the first only
    ("chat", {"min_tokens": 5, "max_tokens": 5, "prompt_logprobs": 1}),
    ("chat", {"stream": True, "prompt_logprobs": 0}),
    ("completions", {"max_tokens": 0, "echo": True}),
    ("completions", {"min_tokens": 16}),
    ("completions", {"max_tokens": None, "n": 1}),
]


@pytest.mark.parametrize(("endpoint", "fields"), ACCEPTED,
                         ids=[f"{e}-{json.dumps(f)}" for e, f in ACCEPTED])
async def test_what_vllm_accepts_still_runs(make_harness: MakeHarness, endpoint: str,
                                            fields: dict[str, Any]) -> None:
    h = await make_harness()
    resp = await h.client.post(_url(endpoint), json=_body(endpoint, fields))
    assert resp.status_code == 200, resp.text
    [d_body] = h.cluster.bodies("decode0")
    for name, value in fields.items():
        assert d_body[name] == value


def test_the_refused_cases_are_refused_by_vllm_too() -> None:
    """The router's checks against vLLM 0.32's own request models and SamplingParams: every
    refusal above is one vLLM makes, except the deliberate ones (values vLLM coerces, and
    n > 1 under sampling); every accepted case vLLM accepts."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    def vllm_accepts(endpoint: str, fields: dict[str, Any]) -> bool:
        body = _body(endpoint, fields)
        del body["conversation_id"]
        model = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
        try:
            request = model.model_validate(body)
            if endpoint == "chat":
                limit = request.max_completion_tokens if request.max_completion_tokens \
                    is not None else request.max_tokens
            else:
                limit = request.max_tokens
            if limit is None:
                limit = 1000
            if endpoint == "completions" and limit == 0 and request.echo:
                return True  # vLLM answers echo-only requests without sampling
            request.to_sampling_params(limit, {"temperature": 0.0})
        except (ValueError, VLLMValidationError):  # pydantic's ValidationError is a ValueError
            return False
        return True

    for endpoint, fields, _ in REFUSED:
        if (endpoint, json.dumps(fields)) in STRICTER_THAN_VLLM:
            assert vllm_accepts(endpoint, fields), (endpoint, fields)
        else:
            assert not vllm_accepts(endpoint, fields), (endpoint, fields)
    for endpoint, fields in ACCEPTED:
        assert vllm_accepts(endpoint, fields), (endpoint, fields)


# Bodies: too big (as they arrive), too slow, not JSON, not an object.

class _Body:
    """An ASGI receive() that sends a body in chunks and counts what was read."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks
        self.read = 0

    async def receive(self) -> dict[str, Any]:
        try:
            chunk = await self.chunks.__anext__()
        except StopAsyncIteration:
            return {"type": "http.request", "body": b"", "more_body": False}
        self.read += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}


async def _call(app: Any, receive: Any, headers: list[tuple[bytes, bytes]] | None = None,
                path: str = "/v1/chat/completions") -> tuple[int, dict[str, str], bytes]:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json")] if headers is None
             else headers,
             "scheme": "http", "server": ("router", 80), "client": ("127.0.0.1", 1),
             "root_path": ""}
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


async def test_a_chunked_body_is_refused_once_it_passes_the_cap(
        make_harness: MakeHarness) -> None:
    h = await make_harness(max_body_bytes=1 << 20)
    chunk = b"x" * 65536

    async def endless() -> AsyncIterator[bytes]:
        yield b'{"messages": "'
        for _ in range(4096):  # 256 MiB if all of it were read
            yield chunk

    body = _Body(endless())
    async with asyncio.timeout(10):
        status, headers, content = await _call(h.app, body.receive)
    assert status == 413
    assert json.loads(content)["error"]["code"] == "body_too_large"
    assert body.read <= (1 << 20) + 2 * len(chunk)
    assert headers["connection"] == "close"
    assert h.cluster.log == []


async def test_a_body_that_never_completes_times_out(make_harness: MakeHarness) -> None:
    h = await make_harness(body_timeout=0.2)

    async def stalled() -> AsyncIterator[bytes]:
        yield b'{"model": "m", '
        await asyncio.Event().wait()
        yield b""  # pragma: no cover

    async with asyncio.timeout(5):
        status, headers, content = await _call(h.app, _Body(stalled()).receive)
    assert status == 408
    assert json.loads(content)["error"]["code"] == "body_timeout"
    assert headers["connection"] == "close"
    assert h.cluster.log == []


MALFORMED: list[tuple[bytes, list[tuple[bytes, bytes]], int, str]] = [
    (b"{not json", [], 400, "invalid_json"),
    (b"[1, 2]", [], 400, "invalid_json"),
    (b'"a string"', [], 400, "invalid_json"),
    (b"", [], 400, "invalid_json"),
    (b'{"model": "\xff\xfe"}', [], 400, "invalid_json"),
    (b'{"a": ' + b"[" * 300 + b"]" * 300 + b"}", [], 400, "invalid_json"),
    (b'{"model": "m"}', [(b"content-type", b"text/plain")], 415, "unsupported_media_type"),
    (b'{"model": "m"}', [(b"content-type", b"application/x-www-form-urlencoded")], 415,
     "unsupported_media_type"),
]


@pytest.mark.parametrize(("raw", "headers", "status", "code"), MALFORMED,
                         ids=[str(i) for i in range(len(MALFORMED))])
async def test_malformed_bodies_get_openai_shaped_errors(
        make_harness: MakeHarness, raw: bytes, headers: list[tuple[bytes, bytes]],
        status: int, code: str) -> None:
    h = await make_harness()

    async def once() -> AsyncIterator[bytes]:
        yield raw

    got, _, content = await _call(h.app, _Body(once()).receive,
                                  headers or [(b"content-type", b"application/json")])
    assert got == status
    error = json.loads(content)["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"
    assert h.cluster.log == []


@pytest.mark.parametrize("ctype", [b"application/json; charset=utf-8", b"application/vnd+json",
                                   None])
async def test_json_content_types_are_read(make_harness: MakeHarness,
                                           ctype: bytes | None) -> None:
    h = await make_harness(cluster=Cluster())
    raw = json.dumps(_body("chat", {})).encode()

    async def once() -> AsyncIterator[bytes]:
        yield raw

    headers = [] if ctype is None else [(b"content-type", ctype)]
    status, _, _ = await _call(h.app, _Body(once()).receive, headers)
    assert status == 200
