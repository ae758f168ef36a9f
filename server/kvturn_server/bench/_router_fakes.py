"""``kvturn bench router``'s fake backends: one uvicorn serving a prefill, a decode and the
decode's control endpoint, each answering from precomputed bytes (run in its own process by
``run_router_bench``), and the per-API turn bodies the client sends them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from kvturn.wire import HEALTH_PATH, PIN, pin_path

try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is in the [router] extra
    _orjson = None  # type: ignore[assignment]


def dumps(obj: Any) -> bytes:
    # Not the router's _json: importing the router package here would slow every `kvturn`.
    if _orjson is not None:
        return _orjson.dumps(obj)
    return json.dumps(obj, separators=(",", ":")).encode()  # pragma: no cover


def loads(data: bytes) -> Any:
    return _orjson.loads(data) if _orjson is not None else json.loads(data)


# What the fakes answer (shapes as in docs/http-api.md; sizes as a small real turn).
_PROMPT = "You are a helpful agent. " * 40

# Per API: (path, the turn's body, the name of its token limit). The same prompt in each.
API_BODIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "chat": ("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "system", "content": _PROMPT},
                                   {"role": "user", "content": "next step?"}],
        "max_tokens": 16, "temperature": 0}, "max_tokens"),
    "messages": ("/v1/messages", {
        "model": "m", "system": _PROMPT, "messages": [{"role": "user", "content": "next step?"}],
        "max_tokens": 16, "temperature": 0}, "max_tokens"),
    # Full input with a conversation id: the router stores each response (store defaults to
    # true), which is part of what it adds on this path.
    "responses": ("/v1/responses", {
        "model": "m", "instructions": _PROMPT,
        "input": [{"role": "user", "content": "next step?"}], "max_output_tokens": 16,
        "temperature": 0}, "max_output_tokens"),
}
API_NAMES = tuple(API_BODIES)


def _fake_replies(stream_chunks: int) -> dict[str, Any]:
    prefill = dumps({
        "id": "cmpl-p", "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                     "finish_reason": "length"}],
        "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": "prefill-engine", "remote_block_ids": [list(range(64))],
            "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": "p-1",
            "kvturn": {"reuse": {"reason": "hit", "reused_tokens": 960, "local_tokens": 0}}}})
    decode = dumps({
        "id": "cmpl-d", "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello " * 16},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 16, "total_tokens": 1016},
        "kv_transfer_params": {"do_remote_decode": True, "remote_engine_id": "decode-engine",
                               "kvturn": {"retained": True, "engine_id": "decode-engine",
                                          "num_tokens": 1016, "expires_in": 480.0}}})
    events = [b"data: " + dumps({
        "id": "cmpl-d", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]})
        + b"\n\n" for i in range(stream_chunks)] + [b"data: [DONE]\n\n"]
    view = {"key": "k", "engine_id": "decode-engine",
            "params": {"remote_engine_id": "decode-engine", "remote_block_ids": [list(range(64))],
                       "remote_host": "127.0.0.1", "remote_port": 5700,
                       "kvturn": {"format": 1, "block_size": 16,
                                  "block_hashes": ["ab" * 16] * 63}},
            "num_tokens": 1016, "num_blocks": 64, "expires_in": 480.0,
            "hold_remaining": 3000.0, "created_ago": 0.0}
    decode_params = loads(decode)["kv_transfer_params"]
    text = "Hello " * 16
    messages_decode = dumps({
        "id": "msg_d", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
        "usage": {"input_tokens": 1000, "output_tokens": 16},
        "kv_transfer_params": decode_params})
    messages_events = [_event("message_start", {"type": "message_start", "message": {
        "id": "msg_d", "type": "message", "role": "assistant", "content": [], "model": "m"}})]
    messages_events += [_event("content_block_delta", {
        "type": "content_block_delta", "index": 0,
        "delta": {"type": "text_delta", "text": f"tok{i} "}}) for i in range(stream_chunks)]
    messages_events += [_event("message_stop", {"type": "message_stop"})]
    output = [{"type": "message", "id": "msg_d", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    response = {"id": "resp_d", "object": "response", "status": "completed", "model": "m",
                "output": output, "usage": {"input_tokens": 1000, "output_tokens": 16}}
    responses_decode = dumps({**response, "kv_transfer_params": decode_params})
    responses_events = [_event("response.output_text.delta", {
        "type": "response.output_text.delta", "delta": f"tok{i} "})
        for i in range(stream_chunks)]
    responses_events += [_event("response.completed", {"type": "response.completed",
                                                       "response": response})]
    return {"prefill": prefill, "decode": decode, "events": events,
            "decode:/v1/messages": messages_decode, "events:/v1/messages": messages_events,
            "decode:/v1/responses": responses_decode,
            "events:/v1/responses": responses_events,
            "retention": dumps(view),
            "pin": dumps({**view, "pin_id": "pin-1", "pin_expires_in": 70.0}),
            "unpin": b'{"pin_id":"pin-1","unpinned":true}',
            "health": b'{"engine_id":"decode-engine","role":"decode"}'}


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + dumps(payload) + b"\n\n"


def _fake_backends_app(roles: dict[int, str], stream_chunks: int) -> Any:
    """A raw ASGI app: the role is the port the request came in on."""
    replies = _fake_replies(stream_chunks)
    json_headers = [(b"content-type", b"application/json")]
    sse_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        role = roles[scope["server"][1]]
        path = scope["path"]
        reply: bytes
        if role == "control":
            if path == HEALTH_PATH:
                reply = replies["health"]
            elif path.endswith("/" + PIN):
                reply = replies["pin"]
            elif path.startswith(pin_path("")):
                reply = replies["unpin"]
            else:
                reply = replies["retention"]
        elif path == HEALTH_PATH:
            reply = b""
        elif role == "prefill":
            reply = replies["prefill"]
        elif b'"stream":true' in body:
            await send({"type": "http.response.start", "status": 200, "headers": sse_headers})
            for event in replies.get("events:" + path, replies["events"]):
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        else:
            reply = replies.get("decode:" + path, replies["decode"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*json_headers, (b"content-length", str(len(reply)).encode())]})
        await send({"type": "http.response.body", "body": reply})

    return app


def serve_fake_backends(stream_chunks: int) -> None:
    """Bind prefill, decode and control sockets, print their ports, serve forever."""
    import uvicorn

    socks = []
    for _ in range(3):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(2048)  # connections queue from now on, even before uvicorn accepts
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    roles = dict(zip(ports, ("prefill", "decode", "control"), strict=True))
    options: dict[str, Any] = {}
    with contextlib.suppress(ImportError):
        import httptools  # noqa: F401

        options["http"] = "httptools"
    config = uvicorn.Config(_fake_backends_app(roles, stream_chunks), lifespan="off",
                            log_level="warning", access_log=False, **options)
    server = uvicorn.Server(config)
    print(json.dumps({"prefill": ports[0], "decode": ports[1],  # noqa: T201
                      "control": ports[2]}), flush=True)
    runner: Callable[[Awaitable[None]], None] = asyncio.run  # type: ignore[assignment]
    with contextlib.suppress(ImportError):
        import uvloop

        runner = uvloop.run  # type: ignore[assignment]
    runner(server.serve(sockets=socks))
