"""Teacher-forced certification (``_forced``) against the real reference instance: the
reference's own greedy answer is its greedy choice at every token, with the logprobs it gave
while generating it; an answer that goes on from a changed token as if nothing changed is
caught at a token the reference would not have picked. No near-tie of these tests counts for
the session's budget (a tally of their own)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvturn_server.local import Stack

from ._forced import certify_rest, session_scorer
from ._greedy import TIE, completion_logprobs
from ._helpers import post
from ._ties import Tally

GENERATE = 96


def _reference(stack: Stack, prompt: list[int]) -> dict[str, Any]:
    cfg = stack.config
    reply = post(f"{cfg.reference_url}/v1/completions", {
        "model": cfg.served_model_name, "prompt": prompt, "max_tokens": GENERATE,
        "temperature": 0, "ignore_eos": True, **completion_logprobs()})
    choice: dict[str, Any] = reply["choices"][0]
    return choice


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1600) for _ in range(200)]


def test_the_reference_s_own_answer_is_certified_with_its_own_logprobs(stack: Stack) -> None:
    prompt = _prompt(31)
    reference = _reference(stack, prompt)
    forced = certify_rest(prompt, reference["token_ids"], 0, session_scorer(), Tally())
    generated = reference["logprobs"]["token_logprobs"]
    assert len(forced) == GENERATE
    # Teacher-forced (one prefill) and generated (token by token) differ by rounding only.
    assert max(abs(a - b) for a, b in zip(forced, generated, strict=True)) <= TIE


def test_an_answer_that_ignores_a_changed_token_is_caught(stack: Stack) -> None:
    prompt = _prompt(32)
    reference = _reference(stack, prompt)
    ids = list(reference["token_ids"])
    changed = GENERATE // 3
    # The reference's second choice there, and then its old continuation unchanged: what a
    # decode that read a wrong block past a parting could produce.
    second = sorted(reference["logprobs"]["top_logprobs"][changed].items(),
                    key=lambda item: -item[1])[1][0]
    ids[changed] = int(second.removeprefix("token_id:"))
    with pytest.raises(AssertionError, match="is not the reference's greedy choice"):
        certify_rest(prompt, ids, changed + 1, session_scorer(), Tally())
