"""Hostile input through the real stack (issue 13): forged transfer params on the path where
the router sends none of its own, and a ``stream`` value vLLM would coerce."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from kvturn_server.local import Stack, free_port

from ._greedy import assert_same_text, chat_logprobs
from ._helpers import plain_chat

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def fallback_router(stack: Stack) -> Iterator[str]:
    """A router whose only prefill is down: every turn falls back to the decode computing the
    prompt, and without a conversation id the router sends the decode no transfer params."""
    cfg = stack.config
    port = free_port()
    env = {**os.environ}
    env.setdefault("PYTHONPATH", os.pathsep.join(
        str(ROOT / p) for p in ("server", "sdk", "integrations")))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvturn_server.router",
         "--prefill", f"http://127.0.0.1:{free_port()}",
         "--decode", f"{cfg.decode_url},control={cfg.decode_control_url}",
         "--port", str(port), "--connect-timeout", "1", "--health-interval", "3600"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx2.get(url + "/health", timeout=1)
                break
            except httpx2.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _messages(tag: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"{tag}: name three colours of the sea."}]


@pytest.mark.parametrize("forged", ["not-a-dict", ["a", 1]], ids=["string", "list"])
def test_forged_xargs_transfer_params_never_reach_the_decode(
        stack: Stack, fallback_router: str, forged: Any) -> None:
    """vLLM hands ``vllm_xargs.kv_transfer_params`` to the connector as the request's
    transfer params; on main this reached the decode on the fallback path (a value the
    connector cannot read, failing the request inside the engine)."""
    cfg = stack.config
    messages = _messages(f"xargs-{forged!r}")
    reference = plain_chat(cfg.reference_url, cfg.served_model_name, messages, MAX_TOKENS)
    resp = httpx2.post(f"{fallback_router}/v1/chat/completions", timeout=120, json={
        "model": cfg.served_model_name, "messages": messages, "temperature": 0,
        "max_tokens": MAX_TOKENS, "vllm_xargs": {"kv_transfer_params": forged},
        **chat_logprobs()})
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-KVTurn-Route"] == "fallback"
    assert_same_text(resp.json()["choices"][0]["message"]["content"], reference)
    assert "kv_transfer_params" not in resp.json()
    # The decode is still serving.
    assert httpx2.get(cfg.decode_url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("value", ["true", "yes", 1])
def test_a_stream_value_vllm_would_coerce_is_refused_before_any_leg(
        stack: Stack, value: Any) -> None:
    """vLLM streams ``"stream": "true"``; the router used to read it as non-streaming (the
    whole stream buffered, nothing captured). Now it is refused, and nothing ran."""
    cfg = stack.config

    def prefill_requests() -> float:
        text = httpx2.get(cfg.prefill_url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total"))

    before = prefill_requests()
    resp = httpx2.post(f"{cfg.router_url}/v1/chat/completions", timeout=60, json={
        "model": cfg.served_model_name, "messages": _messages("stream"), "stream": value,
        "max_tokens": MAX_TOKENS, "conversation_id": f"stream-{value!r}"})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "stream"
    assert prefill_requests() == before
    # The boolean streams as before.
    with httpx2.stream("POST", f"{cfg.router_url}/v1/chat/completions", timeout=120, json={
            "model": cfg.served_model_name, "messages": _messages("stream"), "stream": True,
            "max_tokens": MAX_TOKENS}) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert "data: [DONE]" in stream.read().decode()
