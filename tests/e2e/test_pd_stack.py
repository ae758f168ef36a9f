"""Prefill -> decode over real NIXL: output equal to a plain run, KV received rather than
recomputed, no stalled transfers, and a stalled transfer ending in a bounded recompute.

Runs against real vLLM processes (CPU build) on loopback addresses; see conftest.py.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from openai import OpenAI

from kvturn_server.local import Stack

from ._greedy import TOP, assert_same_reply, assert_same_text, chat_logprobs
from ._helpers import Delta, descendant, failed_transfers, post
from ._settings import KV_READ_TIMEOUT

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i % 97} step {i}" for i in range(n))


CASES: dict[str, dict[str, Any]] = {
    "short chat": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three rivers."}]},
    "long chat": {"messages": [
        {"role": "user", "content": "Summarise this log:\n" + _words("event", 400)},
        {"role": "assistant", "content": "It is a long log of numbered events."},
        {"role": "user", "content": "Which event came last?"}]},
    "tool turn": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Lima and Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Lima: 19 C, cloudy"},
        {"role": "user", "content": "And Oslo?"}]},
}


def _chat(base_url: str, model: str, case: dict[str, Any], max_tokens: int = 64,
          **extra: Any) -> dict[str, Any]:
    return post(f"{base_url}/v1/chat/completions",
                {"model": model, "temperature": 0, "max_tokens": max_tokens, **case,
                 **chat_logprobs(), **extra})


def _answer(response: dict[str, Any]) -> tuple[Any, Any]:
    message = response["choices"][0]["message"]
    return message.get("content"), message.get("tool_calls")


def _assert_same_answer(got: dict[str, Any], reference: dict[str, Any]) -> None:
    """Tool calls exactly; text, token ids and logprobs up to a near-tie and teacher-forced
    past it (``_greedy``)."""
    content, calls = _answer(got)
    if calls or _answer(reference)[1]:
        assert (content, calls) == _answer(reference)
    else:
        assert_same_reply(got, reference)


def test_router_output_equals_plain_run_and_kv_arrives_over_nixl(stack: Stack) -> None:
    cfg = stack.config
    failures_before = failed_transfers(cfg.decode_url)
    for name, case in CASES.items():
        reference = _chat(cfg.reference_url, cfg.served_model_name, case)
        with Delta(cfg.prefill_url) as p, Delta(cfg.decode_url) as d:
            routed = _chat(cfg.router_url, cfg.served_model_name, case)
        _assert_same_answer(routed, reference)
        prompt = routed["usage"]["prompt_tokens"]
        assert prompt == reference["usage"]["prompt_tokens"], name
        assert p.value is not None and d.value is not None
        # The prefill computed the prompt (or found it in its own cache) ...
        assert p.value.computed + p.value.local_cache == prompt, (name, p.value)
        # ... and the decode received it over NIXL instead of computing it.
        assert d.value.computed == 0, (name, d.value)
        assert d.value.transferred > 0, (name, d.value)
        assert d.value.transferred + d.value.local_cache == prompt, (name, d.value)
    assert failed_transfers(cfg.decode_url) == failures_before


def test_streaming_through_the_router_matches_plain_run(stack: Stack) -> None:
    cfg = stack.config
    case = {"messages": [{"role": "user", "content": "Stream a story: " + _words("once", 60)}]}
    reference = _chat(cfg.reference_url, cfg.served_model_name, case, max_tokens=32)
    client = OpenAI(base_url=f"{cfg.router_url}/v1", api_key="test", max_retries=0)
    with Delta(cfg.decode_url) as d:
        stream = client.chat.completions.create(
            model=cfg.served_model_name, messages=case["messages"], temperature=0,
            max_tokens=32, stream=True, logprobs=True, top_logprobs=TOP,
            extra_body={"return_token_ids": True})
        chunks = [c.choices[0] for c in stream if c.choices]
    text = "".join(c.delta.content or "" for c in chunks)
    ids = [t for c in chunks for t in (c.model_extra or {}).get("token_ids") or []]
    pairs = [(t.token, t.logprob) for c in chunks for t in
             ((c.logprobs.content or []) if c.logprobs else [])]
    assert_same_text(text, reference, ids, pairs)
    assert d.value is not None and d.value.computed == 0 and d.value.transferred > 0


def test_ten_consecutive_requests_all_complete_over_nixl(stack: Stack) -> None:
    cfg = stack.config
    failures_before = failed_transfers(cfg.decode_url)
    for i in range(10):
        # Distinct prompts of growing length, so every request needs a fresh transfer.
        content = f"Request {i}: " + _words(f"r{i}x", 20 + 60 * i)
        case = {"messages": [{"role": "user", "content": content}]}
        with Delta(cfg.decode_url) as d:
            routed = _chat(cfg.router_url, cfg.served_model_name, case, max_tokens=8)
        assert routed["choices"][0]["finish_reason"] == "length", i
        assert d.value is not None and d.value.transferred > 0 and d.value.computed == 0, i
    assert failed_transfers(cfg.decode_url) == failures_before


def test_a_stalled_transfer_is_abandoned_and_recomputed_in_bounded_time(stack: Stack) -> None:
    """The prefill stops answering after handing over its blocks (its worker is paused): the
    decode's read can never finish. It must give up after kv_read_timeout and recompute,
    with the same output, and the stack must keep working once the prefill is back."""
    cfg = stack.config
    case = {"messages": [{"role": "user", "content": "Stall test: " + _words("stall", 300)}]}
    body = {"model": cfg.served_model_name, "temperature": 0, "max_tokens": 16, **case,
            **chat_logprobs()}
    reference = post(f"{cfg.reference_url}/v1/chat/completions", body)
    prefilled = post(f"{cfg.prefill_url}/v1/chat/completions", {
        **body, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    params = prefilled["kv_transfer_params"]
    assert params and params["remote_block_ids"]

    worker = descendant(stack.pid("prefill"), "VLLM::Worker")
    failures_before = failed_transfers(cfg.decode_url)
    os.kill(worker, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with Delta(cfg.decode_url) as d:
            decoded = post(f"{cfg.decode_url}/v1/chat/completions",
                           {**body, "kv_transfer_params": params},
                           timeout=KV_READ_TIMEOUT + 60)
        elapsed = time.monotonic() - started
    finally:
        os.kill(worker, signal.SIGCONT)

    _assert_same_answer(decoded, reference)
    assert d.value is not None and d.value.computed > 0
    assert failed_transfers(cfg.decode_url) > failures_before
    assert elapsed >= KV_READ_TIMEOUT * 0.9, "the read was abandoned before its deadline"

    # The prefill is back: the next request goes over NIXL again.
    again = {"messages": [{"role": "user", "content": "After the stall: " + _words("ok", 80)}]}
    with Delta(cfg.decode_url) as d2:
        _chat(cfg.router_url, cfg.served_model_name, again, max_tokens=4)
    assert d2.value is not None and d2.value.transferred > 0 and d2.value.computed == 0
