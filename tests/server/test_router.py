"""The router's two legs, over mocked prefill and decode backends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx2
import pytest

from kvturn_server.router import RouterConfig, create_app

P = "http://prefill:8100"
D = "http://decode:8200"
P_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p-engine",
            "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1", "remote_port": 5600}
SSE = [b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n',
       b'data: {"choices":[{"delta":{"content":"lo"}}]}\n\n', b"data: [DONE]\n\n"]


@dataclass
class Backends:
    """Scripted prefill and decode; records every request they receive."""

    prefill: Callable[[dict[str, Any]], httpx2.Response] = field(
        default=lambda body: httpx2.Response(200, json={"kv_transfer_params": P_PARAMS}))
    decode: Callable[[dict[str, Any]], httpx2.Response] = field(
        default=lambda body: httpx2.Response(200, json={"choices": [{"text": "ok"}]}))
    seen: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        url = str(request.url)
        body = json.loads(request.content) if request.content else {}
        backend = "P" if url.startswith(P) else "D"
        self.seen.append((backend, request.url.path, body))
        if request.method == "GET":
            return httpx2.Response(200, json={"data": [{"id": "m"}]})
        return self.prefill(body) if backend == "P" else self.decode(body)

    def bodies(self, backend: str) -> list[dict[str, Any]]:
        return [b for name, _, b in self.seen if name == backend]


@pytest.fixture
def backends() -> Backends:
    return Backends()


@pytest.fixture
async def client(backends: Backends) -> AsyncIterator[httpx2.AsyncClient]:
    upstream = httpx2.AsyncClient(transport=httpx2.MockTransport(backends.handle))
    app = create_app(RouterConfig(prefill=(P,), decode=(D,)), client=upstream)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                  base_url="http://router") as c:
        yield c
    await upstream.aclose()


async def test_prefill_leg_then_decode_leg_with_its_params(
        client: httpx2.AsyncClient, backends: Backends) -> None:
    resp = await client.post("/v1/completions", json={
        "model": "m", "prompt": "hi", "max_tokens": 20, "temperature": 0, "stream": False,
        "stream_options": {"include_usage": True}})
    assert resp.status_code == 200
    assert resp.json() == {"choices": [{"text": "ok"}]}
    [p_body] = backends.bodies("P")
    [d_body] = backends.bodies("D")
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert "stream_options" not in p_body
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert p_body["kv_transfer_params"]["remote_engine_id"] is None
    assert d_body["kv_transfer_params"] == P_PARAMS
    assert d_body["max_tokens"] == 20 and d_body["temperature"] == 0


async def test_chat_prefill_caps_max_completion_tokens_too(
        client: httpx2.AsyncClient, backends: Backends) -> None:
    await client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 50, "tools": [{"type": "function", "function": {"name": "f"}}]})
    [p_body] = backends.bodies("P")
    [d_body] = backends.bodies("D")
    assert p_body["max_completion_tokens"] == 1
    assert d_body["max_completion_tokens"] == 50
    assert d_body["tools"] == [{"type": "function", "function": {"name": "f"}}]
    assert backends.seen[0][1] == "/v1/chat/completions"


async def test_client_transfer_params_are_never_forwarded(
        client: httpx2.AsyncClient, backends: Backends) -> None:
    backends.prefill = lambda body: httpx2.Response(500, json={"error": {}})
    await client.post("/v1/completions", json={
        "model": "m", "prompt": "hi", "kv_transfer_params": {"remote_host": "10.0.0.1"},
        "kvturn": {"handle": "forged"}})
    for _, _, body in backends.seen:
        assert "kvturn" not in body
        assert body.get("kv_transfer_params", {}).get("remote_host") != "10.0.0.1"


async def test_streaming_is_relayed_unchanged(
        client: httpx2.AsyncClient, backends: Backends) -> None:
    async def sse() -> AsyncIterator[bytes]:
        for chunk in SSE:
            yield chunk

    backends.decode = lambda body: httpx2.Response(
        200, headers={"content-type": "text/event-stream"}, content=sse())
    async with client.stream("POST", "/v1/chat/completions", json={
            "model": "m", "messages": [], "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        received = b"".join([chunk async for chunk in resp.aiter_raw()])
    assert received == b"".join(SSE)
    [p_body] = backends.bodies("P")
    [d_body] = backends.bodies("D")
    assert p_body["stream"] is False
    assert d_body["stream"] is True and d_body["kv_transfer_params"] == P_PARAMS


@pytest.mark.parametrize("failure", [
    lambda body: httpx2.Response(500, json={"error": {"message": "boom"}}),
    lambda body: httpx2.Response(200, json={"choices": []}),
    lambda body: httpx2.Response(200, text="not json"),
])
async def test_prefill_failure_falls_back_to_decode_computing_the_prompt(
        client: httpx2.AsyncClient, backends: Backends,
        failure: Callable[[dict[str, Any]], httpx2.Response]) -> None:
    backends.prefill = failure
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert resp.status_code == 200
    [d_body] = backends.bodies("D")
    assert "kv_transfer_params" not in d_body


async def test_prefill_connection_error_falls_back(
        client: httpx2.AsyncClient, backends: Backends) -> None:
    def refuse(body: dict[str, Any]) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused")

    backends.prefill = refuse
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert resp.status_code == 200
    assert "kv_transfer_params" not in backends.bodies("D")[0]


async def test_client_errors_from_prefill_are_returned_without_a_decode_leg(
        client: httpx2.AsyncClient, backends: Backends) -> None:
    error = {"error": {"message": "model 'x' does not exist", "type": "NotFoundError"}}
    backends.prefill = lambda body: httpx2.Response(404, json=error)
    resp = await client.post("/v1/completions", json={"model": "x", "prompt": "hi"})
    assert resp.status_code == 404
    assert resp.json() == error
    assert backends.bodies("D") == []


async def test_decode_unreachable_is_a_retryable_openai_error(
        client: httpx2.AsyncClient, backends: Backends) -> None:
    def refuse(body: dict[str, Any]) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused")

    backends.decode = refuse
    for stream in (False, True):
        resp = await client.post("/v1/completions",
                                 json={"model": "m", "prompt": "hi", "stream": stream})
        assert resp.status_code == 502
        assert resp.headers["x-should-retry"] == "true"
        assert "Retry-After" in resp.headers
        assert resp.json()["error"]["type"] == "server_error"


async def test_decode_http_errors_pass_through(
        client: httpx2.AsyncClient, backends: Backends) -> None:
    backends.decode = lambda body: httpx2.Response(400, json={"error": {"message": "bad"}})
    for stream in (False, True):
        resp = await client.post("/v1/completions",
                                 json={"model": "m", "prompt": "hi", "stream": stream})
        assert resp.status_code == 400
        assert resp.json() == {"error": {"message": "bad"}}


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]"])
async def test_bad_bodies_get_an_openai_shaped_400(
        client: httpx2.AsyncClient, backends: Backends, raw: bytes) -> None:
    resp = await client.post("/v1/chat/completions", content=raw,
                             headers={"content-type": "application/json"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert backends.seen == []


async def test_models_and_health(client: httpx2.AsyncClient, backends: Backends) -> None:
    assert (await client.get("/health")).json() == {"status": "ok"}
    models = await client.get("/v1/models")
    assert models.json() == {"data": [{"id": "m"}]}
    assert backends.seen[0][:2] == ("D", "/v1/models")


def test_config_needs_backends() -> None:
    with pytest.raises(ValueError, match="at least one prefill"):
        RouterConfig(prefill=(), decode=(D,))
    with pytest.raises(ValueError, match="http"):
        RouterConfig(prefill=("prefill:8100",), decode=(D,))
