"""The kvturn connector through real prefill and decode vLLM: verified decode -> prefill reuse,
retention leases (expiry, keepalive, release), faults and budgets, each checked against a plain
single-instance run of the same request.

The legs are driven directly, as the router drives them (pin, prefill leg, unpin, decode leg;
docs/http-api.md section B), so that the connector is measured on its own. Prompts are token ids
where exact block counts matter, chat messages where the edit is a chat-level one.
"""

from __future__ import annotations

import os
import random
import signal
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from kvturn_server.local import Stack
from kvturn_server.local._direct import DirectConversation, control, retention_path

from ._greedy import assert_same_choice, assert_same_reply, chat_logprobs, completion_logprobs
from ._helpers import Delta, descendant, metric, post, retention_stats, wait_until
from ._settings import KV_READ_TIMEOUT, RETENTION_TTL

BLOCK = 128  # vLLM's CPU KV block size
THRESHOLD = 64  # kv_recompute_threshold (vLLM's default, kept by the stack)
GENERATE = 160  # several full blocks of output retained per turn; compared token for token


def _conversation(stack: Stack) -> DirectConversation:
    """Both legs ask for the logprobs ``assert_same_choice`` compares with the reference's."""
    cfg = stack.config
    return DirectConversation(cfg.prefill_url, cfg.decode_url, cfg.decode_control_url,
                              cfg.served_model_name, key=f"test/{uuid.uuid4().hex}",
                              extra=completion_logprobs())


def _plain(stack: Stack, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """The reference's completion choice: its ``token_ids``, prompt ids and the logprobs that
    ``assert_same_choice`` needs."""
    cfg = stack.config
    reply = post(f"{cfg.reference_url}/v1/completions", {
        "model": cfg.served_model_name, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, **completion_logprobs()})
    choice: dict[str, Any] = reply["choices"][0]
    return choice


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1600) for _ in range(n)]


def _pin_code(conv: DirectConversation) -> str:
    status, body = control(conv.decode_control_url, "POST", retention_path(conv.key, "pin"),
                           {"ttl": 30})
    if status == 200:
        control(conv.decode_control_url, "DELETE", "/kvturn/v1/pins/" + body["pin_id"])
        return "ok"
    return str(body["error"]["code"])


def test_six_turns_read_the_history_from_the_decode(stack: Stack) -> None:
    """From turn 2 on, the previous prompt and output (all but the last partial block) come
    from the prefill's own cache or the decode's retention; only the new tokens are computed."""
    cfg = stack.config
    conv = _conversation(stack)
    prompt = _tokens(1, 300)
    previous: list[int] = []
    for turn in range(6):
        reference = _plain(stack, prompt, GENERATE)
        with Delta(cfg.prefill_url) as p:
            result = conv.turn(prompt, GENERATE)
        assert p.value is not None
        if turn:
            retained = (len(previous) + GENERATE - 1) // BLOCK * BLOCK
            local = len(previous) // BLOCK * BLOCK  # the prefill's own cache: last prompt
            assert result.gone is None, turn
            assert p.value.local_cache == local, (turn, p.value)
            assert p.value.transferred == retained - local, (turn, p.value)
            assert p.value.computed == len(prompt) - retained, (turn, p.value)
            assert result.reuse["reason"] in ("hit", "partial"), result.reuse
            assert 0 < result.reuse["reused_tokens"] == retained - local, (turn, result.reuse)
            # The cost model weighed the read (compute pinned: _settings.PREFILL_CONNECTOR_EXTRA;
            # the read side is a default until calibrated, which makes the source "default").
            cost = result.reuse["cost"]
            assert cost["tokens"] == retained - local, cost
            assert cost["source"] in ("default", "configured"), cost
            assert cost["read_ms"] < cost["compute_ms"], cost
            assert_same_choice(result.decode["choices"][0], reference)
        else:
            assert result.gone == "no_retention" and result.reuse["reason"] == "miss"
            assert "cost" not in result.reuse
        previous = prompt
        prompt = prompt + result.token_ids + _tokens(100 + turn, 70)
    assert conv.release()[0] == 200
    # The prefill calibrated its cost model on its own engine steps and reads: the first read
    # from a decode (the NIXL handshake) is left out, so this test's five reads give four or
    # more samples.
    status, stats = control(cfg.prefill_control_url, "GET", "/kvturn/v1/stats")
    assert status == 200, stats
    model = stats["cost_model"]
    assert model["compute_tokens_per_s"]["samples"] >= 5, model
    assert model["compute_tokens_per_s"]["calibrated"] > 0, model
    assert model["read_fixed_ms"]["samples"] >= 4, model
    assert model["read_fixed_ms"]["source"] == "calibrated", model
    assert model["compute_tokens_per_s"]["source"] == "configured", model


def test_an_edit_inside_the_history_reads_only_the_verified_prefix(stack: Stack) -> None:
    cfg = stack.config
    conv = _conversation(stack)
    first = _tokens(2, 300)  # blocks 0-1 full, 44 tokens of block 2
    out = conv.turn(first, GENERATE).token_ids
    # Change one generated token in block 3 (positions 384-511): blocks 0-2 still verify.
    # vLLM's own bidirectional mode would read the tail of the decode's blocks instead.
    edited = first + out
    edited[450] = (edited[450] + 1) % 1500 + 10
    second = edited + _tokens(3, 100)  # block 3 is full in the new prompt, and differs
    reference = _plain(stack, second, GENERATE)
    with Delta(cfg.prefill_url) as p:
        result = conv.turn(second, GENERATE)
    assert_same_choice(result.decode["choices"][0], reference)
    assert p.value is not None
    assert p.value.local_cache == 2 * BLOCK, p.value
    assert p.value.transferred == 1 * BLOCK, p.value
    assert p.value.computed == len(second) - 3 * BLOCK, p.value
    report = dict(result.reuse)
    assert report.pop("cost")["tokens"] == BLOCK, result.reuse
    assert report == {"reason": "partial", "reused_tokens": BLOCK, "local_tokens": 2 * BLOCK}
    conv.release()


def test_an_edit_before_the_prefills_own_cache_reads_nothing(stack: Stack) -> None:
    cfg = stack.config
    conv = _conversation(stack)
    first = _tokens(4, 300)
    out = conv.turn(first, GENERATE).token_ids
    edited = first + out
    edited[200] = (edited[200] + 1) % 1500 + 10  # inside block 1
    second = edited + _tokens(5, 40)
    reference = _plain(stack, second, GENERATE)
    with Delta(cfg.prefill_url) as p:
        result = conv.turn(second, GENERATE)
    assert_same_choice(result.decode["choices"][0], reference)
    assert p.value is not None and p.value.transferred == 0, p.value
    assert p.value.local_cache == 1 * BLOCK, p.value
    assert result.reuse["reused_tokens"] == 0
    conv.release()


# Chat-level edits: what an agent framework actually does to a history between turns.

SYSTEM = "You are a careful agent. " + " ".join(f"rule {i}: check step {i}." for i in range(90))
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a record up",
    "parameters": {"type": "object", "properties": {"id": {"type": "string"}},
                   "required": ["id"]}}}]


def _history() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Find record 7 and record 9. " * 6},
        {"role": "assistant", "content": "<think>Record 7 first, then 9. " * 8 + "</think>"
                                         "I will look both up.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "lookup", "arguments": '{"id": "7"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "record 7: blue, 12 kg, shelf A. " * 4},
        {"role": "user", "content": "Now summarise record 7 for me in one line. " * 3},
    ]


def _chat_turn(stack: Stack, conv: DirectConversation,
               messages: list[dict[str, Any]]) -> tuple[dict[str, Any], list[int], Any]:
    """One chat turn through the legs; (decode reply, the prompt's token ids, P's sources)."""
    cfg = stack.config
    body = {"model": cfg.served_model_name, "messages": messages, "tools": TOOLS,
            "temperature": 0, "max_tokens": 48, "ignore_eos": True, **chat_logprobs()}
    pinned, _ = conv._pin()
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
    if pinned is not None:
        params = {**pinned["params"], "do_remote_decode": True, "do_remote_prefill": False}
    with Delta(cfg.prefill_url) as p:
        try:
            prefilled = post(f"{cfg.prefill_url}/v1/chat/completions",
                             {**body, "max_tokens": 1, "kv_transfer_params": params})
        finally:
            if pinned is not None:
                control(conv.decode_control_url, "DELETE", "/kvturn/v1/pins/" + pinned["pin_id"])
    leg = {**prefilled["kv_transfer_params"], "kvturn": {"conversation": conv.key}}
    decoded = post(f"{cfg.decode_url}/v1/chat/completions", {**body, "kv_transfer_params": leg})
    return decoded, list(prefilled["prompt_token_ids"]), p.value


def _expected_read(retained: list[int], prompt: list[int], local: float) -> int:
    """Tokens a verified read should take: whole blocks of the common prefix of the retained
    tokens and the prompt (less its last token), beyond the prefill's own cache hit."""
    common = 0
    for a, b in zip(retained, prompt[:-1], strict=False):
        if a != b:
            break
        common += 1
    verified = common // BLOCK * BLOCK
    read = max(0, verified - int(local))
    return read if read >= THRESHOLD else 0


def _edit_case(stack: Stack, edit: Callable[[list[dict[str, Any]]], list[dict[str, Any]]],
               ) -> tuple[int, int]:
    """Turn 1 on the full history, turn 2 on the edited history plus the model's answer; the
    second turn must match the plain run and read exactly the verified prefix."""
    cfg = stack.config
    conv = _conversation(stack)
    messages = _history()
    first, first_prompt, _ = _chat_turn(stack, conv, messages)
    answer = first["choices"][0]["message"]["content"] or ""
    status, retention = conv.describe()
    assert status == 200, retention
    retained = (first_prompt + first["choices"][0]["token_ids"])[:retention["num_tokens"]]

    second_messages = [*edit(messages), {"role": "assistant", "content": answer},
                       {"role": "user", "content": "Thanks. And record 9?"}]
    reference = post(f"{cfg.reference_url}/v1/chat/completions", {
        "model": cfg.served_model_name, "messages": second_messages, "tools": TOOLS,
        "temperature": 0, "max_tokens": 48, "ignore_eos": True, **chat_logprobs()})
    second, second_prompt, sources = _chat_turn(stack, conv, second_messages)
    assert_same_reply(second, reference)
    expected = _expected_read(retained, second_prompt, sources.local_cache)
    assert sources.transferred == expected, (sources, expected)
    assert sources.computed + sources.local_cache + sources.transferred == len(second_prompt)
    conv.release()
    return int(sources.transferred), len(second_prompt)


def test_removed_middle_message_reuses_only_the_shared_prefix(stack: Stack) -> None:
    # The assistant's tool call and its result are dropped from the middle of the history.
    read, _ = _edit_case(stack, lambda m: [m[0], m[1], m[4]])
    assert read == 0  # what is still shared is already in the prefill's own cache


def test_changed_tool_result_reuses_up_to_the_change(stack: Stack) -> None:
    def change(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        edited = [dict(m) for m in messages]
        edited[3]["content"] = "record 7: red, 3 kg, shelf C. " * 4
        return edited

    _edit_case(stack, change)


def test_stripped_reasoning_reuses_up_to_the_assistant_turn(stack: Stack) -> None:
    def strip(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        edited = [dict(m) for m in messages]
        edited[2]["content"] = "I will look both up."
        return edited

    _edit_case(stack, strip)


def test_a_re_rendered_answer_reuses_what_still_matches(stack: Stack) -> None:
    # No edit at all: the next turn re-renders the model's own answer as text, whose tokens
    # may differ from the generated ids; only verified blocks may be read either way.
    _edit_case(stack, lambda m: m)


# Leases.


def test_an_expired_retention_is_recomputed_with_the_same_output(stack: Stack) -> None:
    cfg = stack.config
    conv = _conversation(stack)
    first = _tokens(6, 300)
    out = conv.turn(first, GENERATE).token_ids
    expired_before = metric(cfg.decode_url, "kvturn:retention_events_total", event="expired")
    wait_until(lambda: conv.describe()[0] == 404, RETENTION_TTL + 10, "the retention to expire")
    assert conv.describe()[1]["error"]["code"] == "expired"
    second = first + out + _tokens(7, 40)
    reference = _plain(stack, second, GENERATE)
    with Delta(cfg.prefill_url) as p:
        result = conv.turn(second, GENERATE)
    assert result.gone == "expired"
    assert p.value is not None and p.value.transferred == 0
    assert_same_choice(result.decode["choices"][0], reference)
    conv.release()
    wait_until(lambda: metric(cfg.decode_url, "kvturn:retention_events_total",
                              event="expired") > expired_before, 10, "the expiry metric")


def test_keepalive_holds_a_retention_past_its_ttl(stack: Stack) -> None:
    cfg = stack.config
    conv = _conversation(stack)
    first = _tokens(8, 300)
    out = conv.turn(first, GENERATE).token_ids
    status, held = conv.describe()
    assert status == 200 and held["expires_in"] <= RETENTION_TTL
    # Renew at a third of the TTL until one and a half TTLs have passed (a long tool call).
    renewals = 0
    while renewals * RETENTION_TTL / 3 < 1.5 * RETENTION_TTL:
        wait_until(lambda: conv.describe()[1].get("expires_in", 0) <= 2 * RETENTION_TTL / 3,
                   RETENTION_TTL, "the lease to run down a third")
        status, renewed = conv.keepalive()
        assert status == 200 and renewed["expires_in"] > 0.9 * RETENTION_TTL, renewed
        renewals += 1
    assert conv.describe()[1]["created_ago"] > RETENTION_TTL
    second = first + out + _tokens(9, 40)
    reference = _plain(stack, second, GENERATE)
    with Delta(cfg.prefill_url) as p:
        result = conv.turn(second, GENERATE)
    assert result.gone is None and p.value is not None and p.value.transferred > 0
    assert_same_choice(result.decode["choices"][0], reference)
    assert metric(cfg.decode_url, "kvturn:retention_events_total", event="renewed") >= renewals
    conv.release()


def test_release_frees_the_blocks_and_the_next_turn_recomputes(stack: Stack) -> None:
    cfg = stack.config
    baseline = retention_stats(cfg.decode_control_url)["held_blocks"]
    conv = _conversation(stack)
    first = _tokens(10, 600)
    out = conv.turn(first, GENERATE).token_ids
    held = retention_stats(cfg.decode_control_url)["held_blocks"]
    assert held == baseline + (600 + GENERATE - 1) // BLOCK
    assert conv.release() == (200, {"key": conv.key, "released": True})
    # The decode is idle now: the frees still happen, on its engine thread.
    wait_until(lambda: retention_stats(cfg.decode_control_url)["held_blocks"] == baseline, 10,
               "the released blocks to be freed")
    assert conv.describe()[1]["error"]["code"] == "released"
    assert conv.release()[0] == 404
    second = first + out + _tokens(11, 40)
    reference = _plain(stack, second, GENERATE)
    with Delta(cfg.prefill_url) as p:
        result = conv.turn(second, GENERATE)
    assert result.gone == "released" and p.value is not None and p.value.transferred == 0
    assert_same_choice(result.decode["choices"][0], reference)
    conv.release()


def test_a_retention_is_multi_use_until_released(stack: Stack) -> None:
    """A retried turn reads the same retention again (vLLM's own mode frees it on first read).

    The first turn runs on the decode alone, so the prefill has never seen it and its first
    read takes every retained token from the decode. After that read the prefill's own cache
    holds them (and a cache salt would now fail verification: the chain covers it), so the
    second use shows the retention pinned and verified whole again, with every retained token
    read or found locally and none computed.
    """
    cfg = stack.config
    conv = _conversation(stack)
    first = _tokens(12, 300)
    held = post(f"{cfg.decode_url}/v1/completions",
                conv.body(first, GENERATE, {"kvturn": {"conversation": conv.key}}))
    out = held["choices"][0]["token_ids"]
    second = first + out + _tokens(13, 40)
    status, retention = conv.describe()
    assert status == 200
    tokens = retention["num_tokens"]
    seen = []
    for _ in range(2):
        pinned, _ = conv._pin()
        assert pinned is not None
        body = conv.body(second, 1, {**pinned["params"], "do_remote_decode": True,
                                     "do_remote_prefill": False})
        with Delta(cfg.prefill_url) as p:
            answer = post(f"{cfg.prefill_url}/v1/completions", body)
        control(cfg.decode_control_url, "DELETE", "/kvturn/v1/pins/" + pinned["pin_id"])
        assert p.value is not None
        report = answer["kv_transfer_params"]["kvturn"]["reuse"]
        # "hit": every retained block verified (read, or found locally: coverage, not bytes).
        assert report["reason"] == "hit", report
        assert report["reused_tokens"] + report["local_tokens"] >= tokens, report
        seen.append((report["reused_tokens"], p.value.transferred, p.value.local_cache))
    assert seen[0] == (tokens, tokens, 0)  # all from the decode
    assert seen[1][1] + seen[1][2] >= tokens  # verified whole again; none of it computed
    conv.release()


# Faults.


def test_a_decode_that_stops_mid_read_costs_one_deadline_and_changes_nothing(
        stack: Stack) -> None:
    """The decode's worker is paused while the prefill reads its retention: the read cannot
    finish, the prefill abandons it at kv_read_timeout, recomputes, and says so."""
    cfg = stack.config
    conv = _conversation(stack)
    first = _tokens(14, 300)
    out = conv.turn(first, GENERATE).token_ids
    second = first + out + _tokens(15, 40)
    reference = _plain(stack, second, GENERATE)
    timeouts = metric(cfg.prefill_url, "kvturn:read_timeouts_total")
    fallbacks = metric(cfg.prefill_url, "kvturn:fallbacks_total", reason="read_failed")
    pinned, _ = conv._pin()
    assert pinned is not None
    worker = descendant(stack.pid("decode"), "VLLM::Worker")
    os.kill(worker, signal.SIGSTOP)
    try:
        with Delta(cfg.prefill_url) as p:
            prefilled = post(f"{cfg.prefill_url}/v1/completions", conv.body(second, 1, {
                **pinned["params"], "do_remote_decode": True, "do_remote_prefill": False}),
                timeout=KV_READ_TIMEOUT + 60)
    finally:
        os.kill(worker, signal.SIGCONT)
        control(cfg.decode_control_url, "DELETE", "/kvturn/v1/pins/" + pinned["pin_id"])
    report = prefilled["kv_transfer_params"]["kvturn"]["reuse"]
    assert report["reason"] == "stale" and report["reused_tokens"] == 0, report
    assert p.value is not None and p.value.transferred == 0
    leg = {**prefilled["kv_transfer_params"], "kvturn": {"conversation": conv.key}}
    decoded = post(f"{cfg.decode_url}/v1/completions", conv.body(second, GENERATE, leg))
    assert_same_choice(decoded["choices"][0], reference)
    wait_until(lambda: metric(cfg.prefill_url, "kvturn:read_timeouts_total") > timeouts, 10,
               "the read-timeout metric")
    assert metric(cfg.prefill_url, "kvturn:fallbacks_total", reason="read_failed") > fallbacks
    # The decode is back: the next turn reuses again.
    third = second + decoded["choices"][0]["token_ids"] + _tokens(16, 40)
    with Delta(cfg.prefill_url) as p3:
        conv.turn(third, 8)
    assert p3.value is not None and p3.value.transferred > 0
    conv.release()


def test_hostile_params_read_nothing_and_change_nothing(stack: Stack) -> None:
    cfg = stack.config
    conv = _conversation(stack)
    first = _tokens(17, 300)
    out = conv.turn(first, GENERATE).token_ids
    second = first + out + _tokens(18, 40)
    reference = _plain(stack, second, 16)
    pinned, _ = conv._pin()
    assert pinned is not None
    params = {**pinned["params"], "do_remote_decode": True, "do_remote_prefill": False}
    # Another conversation's hashes, block ids far outside the decode's pool.
    params["kvturn"] = {**params["kvturn"],
                        "block_hashes": [bytes(16).hex()] * len(params["kvturn"]["block_hashes"])}
    params["remote_block_ids"] = [[10**6 + i for i in range(len(params["remote_block_ids"][0]))]]
    try:
        with Delta(cfg.prefill_url) as p:
            prefilled = post(f"{cfg.prefill_url}/v1/completions", conv.body(second, 1, params))
    finally:
        control(cfg.decode_control_url, "DELETE", "/kvturn/v1/pins/" + pinned["pin_id"])
    assert prefilled["kv_transfer_params"]["kvturn"]["reuse"]["reason"] == "unverified"
    assert p.value is not None and p.value.transferred == 0
    leg = {**prefilled["kv_transfer_params"], "kvturn": {"conversation": conv.key}}
    decoded = post(f"{cfg.decode_url}/v1/completions", conv.body(second, 16, leg))
    assert_same_choice(decoded["choices"][0], reference)
    conv.release()


# Budget and live requests.


def _no_retentions_left(stack: Stack) -> None:
    """Earlier tests' retentions (released or expiring) would change LRU order and free room."""
    wait_until(lambda: retention_stats(stack.config.decode_control_url)["held_blocks"] == 0,
               RETENTION_TTL + 10, "earlier retentions to go")


def test_over_budget_retentions_are_evicted_least_recently_used(stack: Stack) -> None:
    cfg = stack.config
    _no_retentions_left(stack)
    budget = retention_stats(cfg.decode_control_url)["budget_blocks"]
    evicted_before = metric(cfg.decode_url, "kvturn:retention_events_total", event="evicted")
    per = (1200 + 16 - 1) // BLOCK  # blocks one conversation retains
    conversations = [_conversation(stack) for _ in range(budget // per + 3)]
    for i, conv in enumerate(conversations):
        conv.turn(_tokens(200 + i, 1200), 16)
        assert retention_stats(cfg.decode_control_url)["retained_blocks"] <= budget
    codes = [_pin_code(conv) for conv in conversations]
    assert codes[:3] == ["evicted"] * 3, codes  # the oldest went first
    assert codes[-1] == "ok"
    wait_until(lambda: metric(cfg.decode_url, "kvturn:retention_events_total",
                              event="evicted") >= evicted_before + 3, 10, "the eviction metric")
    # An evicted conversation's next turn recomputes, with the same output.
    first = _tokens(200, 1200)
    out = _plain(stack, first, 16)["token_ids"]
    second = first + out + _tokens(300, 40)
    reference = _plain(stack, second, 16)
    result = conversations[0].turn(second, 16)
    assert result.gone == "evicted"
    assert_same_choice(result.decode["choices"][0], reference)
    for conv in conversations:
        conv.release()


def test_live_requests_evict_retentions_instead_of_being_preempted(stack: Stack) -> None:
    """Retentions fill their budget; then concurrent long requests need more blocks than the
    rest of the decode's cache. They must all run without a single preemption."""
    from concurrent.futures import ThreadPoolExecutor

    cfg = stack.config
    _no_retentions_left(stack)
    stats = retention_stats(cfg.decode_control_url)
    per = (1500 + 16 - 1) // BLOCK
    fillers = [_conversation(stack) for _ in range(stats["budget_blocks"] // per)]
    for i, conv in enumerate(fillers):
        conv.turn(_tokens(400 + i, 1500), 16)
    held = retention_stats(cfg.decode_control_url)["held_blocks"]
    evicted_before = retention_stats(cfg.decode_control_url)["events"]["evicted"]
    preempted_before = metric(cfg.decode_url, "vllm:num_preemptions_total")

    # Each live request needs ~45 blocks; together they need more than is free besides the
    # retentions (the decode has 400 blocks, block 0 is vLLM's).
    prompts = [_tokens(500 + i, 5600) for i in range(8)]
    references = [_plain(stack, prompt, 8) for prompt in prompts]
    need = sum((len(p) + 8) // BLOCK + 1 for p in prompts)
    assert need + held > 399, (need, held)

    def run(i: int) -> dict[str, Any]:
        conv = _conversation(stack)
        choice: dict[str, Any] = conv.turn(prompts[i], 8).decode["choices"][0]
        return choice

    with ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(pool.map(run, range(len(prompts))))
    for output, reference in zip(outputs, references, strict=True):
        assert_same_choice(output, reference)
    assert metric(cfg.decode_url, "vllm:num_preemptions_total") == preempted_before
    assert retention_stats(cfg.decode_control_url)["events"]["evicted"] > evicted_before
    for conv in fillers:
        conv.release()


# Restart (run last, see conftest: it replaces the decode process the other tests use).


@pytest.mark.restarts_decode
def test_a_restarted_decode_is_stale_and_never_read(stack: Stack, say: Any) -> None:
    cfg = stack.config
    conv = _conversation(stack)
    first = _tokens(19, 300)
    out = conv.turn(first, GENERATE).token_ids
    pinned, _ = conv._pin()
    assert pinned is not None
    control(cfg.decode_control_url, "DELETE", "/kvturn/v1/pins/" + pinned["pin_id"])
    old_engine = pinned["engine_id"]
    say("restarting the decode (new engine id)")
    stack.restart("decode")
    status, health = control(cfg.decode_control_url, "GET", "/health")
    assert status == 200 and health["engine_id"] != old_engine
    assert _pin_code(conv) == "no_retention"
    # A router that kept the old params (it must not) would still not read garbage: the old
    # engine's NIXL agent is gone, so the read fails (at worst at kv_read_timeout) and the
    # prefill recomputes.
    second = first + out + _tokens(20, 40)
    reference = _plain(stack, second, GENERATE)
    with Delta(cfg.prefill_url) as p:
        prefilled = post(f"{cfg.prefill_url}/v1/completions", conv.body(second, 1, {
            **pinned["params"], "do_remote_decode": True, "do_remote_prefill": False}),
            timeout=KV_READ_TIMEOUT + 60)
    assert p.value is not None and p.value.transferred == 0
    assert prefilled["kv_transfer_params"]["kvturn"]["reuse"]["reused_tokens"] == 0
    leg = {**prefilled["kv_transfer_params"], "kvturn": {"conversation": conv.key}}
    decoded = post(f"{cfg.decode_url}/v1/completions", conv.body(second, GENERATE, leg))
    assert_same_choice(decoded["choices"][0], reference)
    # And the conversation reuses again on the new decode.
    third = second + decoded["choices"][0]["token_ids"] + _tokens(21, 40)
    with Delta(cfg.prefill_url) as p3:
        result = conv.turn(third, 8)
    assert result.gone is None and p3.value is not None and p3.value.transferred > 0
    conv.release()
