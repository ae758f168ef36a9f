"""Reuse never crosses what vLLM's prefix cache keeps apart: LoRA adapters and cache salts.

A conversation that changes adapter (or salt) between turns has the same token ids as before,
so a chain over token ids alone verifies the decode's retention and the prefill reads KV that
was computed under the other adapter: the answer silently changes. Every instance of the session
stack serves two locally built adapters (conftest.py); each turn is held to the plain reference
instance under the same adapter, token for token and logprob for logprob.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from openai import OpenAI

from kvturn_server.local import Stack

from ._helpers import Delta, plain_chat
from ._turns import Turn, assert_same_answer, chat_turn

MAX_TOKENS = 140  # past one KV block: every turn leaves decode-generated blocks to read
SYSTEM = "You are a careful assistant. " + " ".join(
    f"Note {i}: keep item {i} in mind." for i in range(40))
QUESTIONS = ["Describe the first item.", "And the second one?", "Compare the two."]


def _turns(stack: Stack, steps: list[dict[str, Any]]) -> list[tuple[Turn, int]]:
    """One conversation, one turn per step (``model``: the adapter or base model, ``body``:
    more request fields); each turn equals the plain run of its own step. Returns every turn
    with the prompt tokens the prefill received from the decode."""
    cfg = stack.config
    client = OpenAI(base_url=f"{cfg.router_url}/v1", api_key="tenant-a", max_retries=0)
    conversation = f"extra-keys-{uuid.uuid4().hex}"
    # A history of its own: no other test's turns sit in the prefill's cache.
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{conversation}. {SYSTEM}"}]
    done = []
    for question, step in zip(QUESTIONS, steps, strict=True):
        messages.append({"role": "user", "content": question})
        model, body = step.get("model", cfg.served_model_name), step.get("body", {})
        reference = plain_chat(cfg.reference_url, model, messages, MAX_TOKENS, **body)
        with Delta(cfg.prefill_url) as p:
            turn = chat_turn(client, model, conversation, messages, False,
                             max_tokens=MAX_TOKENS, extra_body={"conversation_id": conversation,
                                                                **body})
        assert_same_answer(turn, reference)
        assert p.value is not None
        done.append((turn, int(p.value.transferred)))
        messages.append({"role": "assistant", "content": turn.text})
    return done


def _reads_nothing(turn: Turn, transferred: int) -> None:
    assert turn.reuse == "unverified", turn.headers
    assert turn.reused == 0 and transferred == 0, (turn.reused, transferred)


def _reads(turn: Turn, transferred: int) -> None:
    assert turn.reuse in ("hit", "partial"), turn.headers
    assert turn.reused > 0 and turn.reused == transferred, (turn.reused, transferred)


def test_a_conversation_that_switches_adapter_reads_nothing_across_adapters(
        stack: Stack) -> None:
    first, switched, kept = _turns(stack, [{"model": "adapter-a"}, {"model": "adapter-b"},
                                           {"model": "adapter-b"}])
    assert first[0].reuse == "miss"
    _reads_nothing(*switched)  # adapter-a's KV under adapter-b: never verified
    _reads(*kept)  # the same adapter again: its own KV verifies and is read


def test_an_adapter_turn_after_a_base_model_turn_reads_nothing(stack: Stack) -> None:
    _, switched, back = _turns(stack, [{}, {"model": "adapter-a"}, {}])
    _reads_nothing(*switched)
    _reads_nothing(*back)  # the retention now holds adapter-a's KV


@pytest.mark.parametrize("salts", [("tenant-1", "tenant-2"), (None, "tenant-2")],
                         ids=["other salt", "salt added"])
def test_a_cache_salt_change_reads_nothing(stack: Stack,
                                           salts: tuple[str | None, str]) -> None:
    before, after = ({"body": {"cache_salt": salt}} if salt else {} for salt in salts)
    _, changed, kept = _turns(stack, [before, after, after])
    _reads_nothing(*changed)
    _reads(*kept)
