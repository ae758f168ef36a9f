"""Decode -> prefill reuse reads only content-verified blocks (vLLM bidirectional mode plus
kvturn's block hashes), and every turn's output equals a plain run of the same conversation.

The legs are sent directly to the prefill and decode (the router's conversation handling is
its own issue). Prompts are token ids so that each turn extends the previous one exactly.
"""

from __future__ import annotations

import random
from typing import Any

from kvturn_server.local import Stack

from ._helpers import Delta, post

NULL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}
BLOCK = 128  # vLLM's CPU KV block size
GENERATE = 300  # long enough that each turn retains several full blocks on the decode
# Outputs of reuse turns are compared with the plain run on their first COMPARE tokens. Past
# that, greedy continuations of the random-weight model can part on near-ties for a reason that
# has nothing to do with reuse: a disaggregated decode computes the last prompt token with the
# decode attention kernel, a single instance inside the prefill (different bf16 rounding).
# Measured on plain prefill -> decode turns without any reuse: first difference at token 38 of
# 300 for one prompt, within the first 24 for another. The first turn of each conversation has
# no reuse and is not compared here (test_pd_stack.py checks prefill -> decode against the plain
# run on short outputs). Every compared token depends on the reused KV, so a wrongly read block
# still shows.
COMPARE = 24


def _complete(base_url: str, model: str, prompt: list[int], max_tokens: int,
              params: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return post(f"{base_url}/v1/completions", body)


def _ids(response: dict[str, Any]) -> list[int]:
    ids: list[int] = response["choices"][0]["token_ids"]
    return ids


class Conversation:
    """Runs turns through prefill + decode and, for comparison, through the reference."""

    def __init__(self, stack: Stack) -> None:
        self.cfg = stack.config
        self.decode_params: dict[str, Any] | None = None

    def turn(self, prompt: list[int]) -> tuple[list[int], list[int], Any]:
        cfg, model = self.cfg, self.cfg.served_model_name
        reference = _ids(_complete(cfg.reference_url, model, prompt, GENERATE))
        params = dict(NULL_PARAMS) if self.decode_params is None else {
            **self.decode_params, "do_remote_decode": True, "do_remote_prefill": False}
        with Delta(cfg.prefill_url) as p:
            prefilled = _complete(cfg.prefill_url, model, prompt, 1, params)
        decoded = _complete(cfg.decode_url, model, prompt, GENERATE,
                            prefilled["kv_transfer_params"])
        self.decode_params = decoded["kv_transfer_params"]
        assert self.decode_params and "kvturn" in self.decode_params
        return _ids(decoded), reference, p.value


def _same_start(out: list[int], reference: list[int]) -> bool:
    return out[:COMPARE] == reference[:COMPARE]


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1600) for _ in range(n)]


def test_growing_conversation_reads_the_decodes_blocks(stack: Stack) -> None:
    conv = Conversation(stack)
    prompt = _prompt(1, 300)
    previous: list[int] = []
    for turn in range(4):
        out, reference, p = conv.turn(prompt)
        if turn:
            assert _same_start(out, reference), f"turn {turn}: output differs from the plain run"
            # The decode retained previous + generated tokens (minus the last sampled one);
            # the prefill already holds `previous` in its own cache and reads the rest.
            retained_blocks = (len(previous) + GENERATE - 1) // BLOCK
            local_blocks = len(previous) // BLOCK
            assert p.local_cache == local_blocks * BLOCK, (turn, p)
            assert p.transferred == (retained_blocks - local_blocks) * BLOCK, (turn, p)
            assert p.computed == len(prompt) - retained_blocks * BLOCK, (turn, p)
        previous = prompt
        prompt = prompt + out + _prompt(100 + turn, 70)


def test_edited_history_reads_only_the_verified_prefix(stack: Stack) -> None:
    conv = Conversation(stack)
    first = _prompt(2, 300)  # blocks 0-1 full, 44 tokens of block 2
    out, _, _ = conv.turn(first)
    # Edit one generated token in block 3 (positions 384-511): blocks 0-2 still verify.
    # vLLM's unverified mode would read the tail of the decode's blocks instead.
    edited = first + out
    edited[450] = (edited[450] + 1) % 1500 + 10
    second = edited + _prompt(3, 40)
    out2, reference2, p = conv.turn(second)
    assert _same_start(out2, reference2)
    assert p.local_cache == 2 * BLOCK, p
    assert p.transferred == 1 * BLOCK, p
    assert p.computed == len(second) - 3 * BLOCK, p


def test_history_edited_before_the_prefills_own_cache_reads_nothing(stack: Stack) -> None:
    conv = Conversation(stack)
    first = _prompt(4, 300)
    out, _, _ = conv.turn(first)
    edited = first + out
    edited[200] = (edited[200] + 1) % 1500 + 10  # inside block 1
    out2, reference2, p = conv.turn(edited + _prompt(5, 40))
    assert _same_start(out2, reference2)
    assert p.transferred == 0, p
    assert p.local_cache == 1 * BLOCK, p
