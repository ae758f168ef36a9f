"""Turns the decode continues itself, through the real stack (router/_placement.py).

A second router over the session's prefill and decode runs with the defaults a user gets
(kv-aware placement, decode continuation of turns up to 512 new tokens). Every answer is held to
the plain reference run, text and logprobs.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from kvturn_server.local import Stack
from kvturn_server.local._process import stop_group

from ._helpers import Delta, plain_chat, start_router
from ._turns import assert_same_answer, chat_turn

MAX_TOKENS = 64
SYSTEM = "You are a careful tool agent. " + " ".join(
    f"Tool {i} reads file {i} and reports line {i}." for i in range(40))
STEPS = ["Read the first file.", "Now read the second file.", "Compare the two reports.",
         "Write the summary of both files."]


@pytest.fixture(scope="module")
def router_url(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("placement-router")
    url, proc = start_router(stack.config, "placement-router", logs)
    try:
        yield url
    finally:
        stop_group(proc.pid)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_short_turns_run_on_the_decode_alone_and_long_ones_read_what_the_prefill_lacks(
        stack: Stack, router_url: str, stream: bool) -> None:
    cfg = stack.config
    client = OpenAI(base_url=f"{router_url}/v1", api_key="tenant-p", max_retries=0)
    conversation = f"placement-{uuid.uuid4().hex}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{conversation}. {SYSTEM}"}]
    for number, step in enumerate(STEPS, start=1):
        messages.append({"role": "user", "content": step})
        reference = plain_chat(cfg.reference_url, cfg.served_model_name, messages, MAX_TOKENS)
        with Delta(cfg.prefill_url) as p, Delta(cfg.decode_url) as d:
            turn = chat_turn(client, cfg.served_model_name, conversation, messages, stream,
                             max_tokens=MAX_TOKENS)
        text, headers = turn.text, turn.headers
        assert_same_answer(turn, reference)
        assert p.value is not None and d.value is not None
        if number == 1:
            assert headers["x-kvturn-route"] == "prefill", headers
        else:
            # No prefill leg: the prefill saw nothing; the decode computed only the new part
            # (its partial last block and the new message), the rest from its own cache.
            assert headers["x-kvturn-route"] == "decode", (number, headers)
            assert headers["x-kvturn-reuse"] in ("hit", "partial"), headers
            # The decode's prefix cache supplied the history: the turn says it read some.
            # (A streamed turn's header is the router's estimate, sent before the decode ran.)
            assert turn.reused > 0, headers
            assert p.value.computed == 0 and p.value.transferred == 0, p.value
            assert 0 < d.value.computed < 256, d.value
            assert d.value.local_cache > 0 and d.value.transferred == 0, d.value
        messages.append({"role": "assistant", "content": text})
    # A long tool result: past the continuation bound, so a prefill leg computes it, reading
    # from the decode the blocks its own cache lacks (the turns it never saw).
    messages.append({"role": "user", "content": " ".join(["file"] * 700)})
    reference = plain_chat(cfg.reference_url, cfg.served_model_name, messages, MAX_TOKENS)
    with Delta(cfg.prefill_url) as p:
        turn = chat_turn(client, cfg.served_model_name, conversation, messages, stream,
                         max_tokens=MAX_TOKENS)
    headers = turn.headers
    assert_same_answer(turn, reference)
    assert headers["x-kvturn-route"] == "prefill", headers
    assert headers["x-kvturn-prefill-choice"] == "holder", headers
    assert headers["x-kvturn-reuse"] in ("hit", "partial"), headers
    reused = int(headers["x-kvturn-reused-tokens"])
    assert p.value is not None and reused > 0 and reused == p.value.transferred, (reused, p.value)
    # The prefill's own cache supplied the first turn's prompt; the decode what came after.
    assert p.value.local_cache > 0, p.value
