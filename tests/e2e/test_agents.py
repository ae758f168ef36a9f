"""Agents through the real stack with the decode's lease set to seconds (_settings.RETENTION_TTL),
so that turn gaps are simulated in seconds: issue 7's scenarios. Every turn's answer is compared
with a plain single-instance run; reuse outcomes come from the router's headers, token counts
from the instances' metrics and control endpoints.

Gaps and tool calls here wait on purpose: the wait *is* the scenario (a tool that runs longer
than the lease, a user who comes back after it ran out), not a hope that something finished.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

import kvturn
from kvturn_server.local import Stack
from kvturn_server.local._direct import control, retention_path

from ._greedy import assert_same_reply
from ._helpers import Delta, metric, plain_chat, retention_stats, wait_until
from ._settings import RETENTION_TTL
from ._turns import answer_fields, answer_of, assert_same_answer

MAX_TOKENS = 140  # past one KV block: each turn leaves decode-generated blocks to read
BLOCK = 128
SYSTEM = "You are an agent that plans and calls tools. " + " ".join(
    f"Policy {i}: confirm step {i} before acting." for i in range(25))
TASKS = ["Plan the inventory count.", "Call the stock tool for aisle 3.",
         "The tool says 40 boxes. What next?", "Check aisle 4 as well.",
         "It says 12 boxes. Compare both.", "Write the final report.", "Any risks left?"]


def _plain(stack: Stack, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    cfg = stack.config
    return plain_chat(cfg.reference_url, cfg.served_model_name, messages, MAX_TOKENS, **extra)


def _key(conversation: str, api_key: str) -> str:
    tenant = hashlib.sha256(f"Bearer {api_key}".encode()).hexdigest()[:16]
    return f"{tenant}/{conversation}"


def _history(tag: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": f"{tag}. {SYSTEM}"}]


def _chat_turn(chat: Any, model: str, messages: list[dict[str, Any]], stream: bool) -> Any:
    result = chat.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_tokens=MAX_TOKENS, stream=stream,
                                          **answer_fields())
    return answer_of(result, stream)


def _run_turn(stack: Stack, chat: Any, messages: list[dict[str, Any]], task: str,
              stream: bool = False) -> tuple[str, Any]:
    """One agent turn: append the task, answer it, compare with the plain run, keep the
    answer in the history; returns (answer, the SDK's report of the turn)."""
    messages.append({"role": "user", "content": task})
    reference = _plain(stack, messages)
    answer = _chat_turn(chat, stack.config.served_model_name, messages, stream)
    assert_same_answer(answer, reference)
    messages.append({"role": "assistant", "content": answer.text})
    return answer.text, chat.last_turn


def test_gaps_well_under_the_ttl_reuse_on_every_turn(stack: Stack) -> None:
    cfg = stack.config
    client = kvturn.OpenAI(base_url=f"{cfg.router_url}/v1", api_key="agents")
    with client.conversation() as chat:
        messages = _history(chat.id)
        for turn, task in enumerate(TASKS[:6]):
            with Delta(cfg.prefill_url) as p:
                _, info = _run_turn(stack, chat, messages, task, stream=bool(turn % 2))
            if turn:
                assert info.reuse in ("hit", "partial") and info.reused_tokens > 0, (turn, info)
                assert p.value is not None and p.value.transferred == info.reused_tokens
            time.sleep(RETENTION_TTL / 12)  # a short tool gap, well inside the lease


def test_a_gap_over_the_ttl_recomputes_cleanly_as_expired(stack: Stack) -> None:
    cfg = stack.config
    client = kvturn.OpenAI(base_url=f"{cfg.router_url}/v1", api_key="agents")
    with client.conversation() as chat:
        messages = _history(chat.id)
        _run_turn(stack, chat, messages, TASKS[0])
        key = _key(chat.id, "agents")
        expired = metric(cfg.router_url, "kvturn_router_lost_entries_total", outcome="expired")
        # The user comes back after the lease ran out (no pause, so no keepalive).
        wait_until(lambda: control(cfg.decode_control_url, "GET", retention_path(key))[0]
                   == 404, RETENTION_TTL + 10, "the lease to run out")
        # The router follows the decode's lost log: it knows before the next turn comes.
        wait_until(lambda: metric(cfg.router_url, "kvturn_router_lost_entries_total",
                                  outcome="expired") > expired, 5, "the router to learn it")
        with Delta(cfg.prefill_url) as p:
            _, info = _run_turn(stack, chat, messages, TASKS[1])
        assert info.reuse == "expired" and info.reused_tokens == 0
        assert p.value is not None and p.value.transferred == 0
        # The expired turn was retained again: the next one reuses.
        _, info = _run_turn(stack, chat, messages, TASKS[2])
        assert info.reuse in ("hit", "partial") and info.reused_tokens > 0
        assert chat.stats.misses.get("expired") == 1


def test_a_tool_longer_than_the_ttl_keeps_the_lease_with_keepalive(stack: Stack) -> None:
    cfg = stack.config
    client = kvturn.OpenAI(base_url=f"{cfg.router_url}/v1", api_key="agents",
                           keepalive_interval=RETENTION_TTL / 4)
    with client.conversation() as chat:
        messages = _history(chat.id)
        _run_turn(stack, chat, messages, TASKS[0])
        started = time.monotonic()
        with chat.pause("slow_stock_tool"):
            time.sleep(1.5 * RETENTION_TTL)  # the tool runs longer than the lease
        assert time.monotonic() - started > RETENTION_TTL
        messages.append({"role": "tool", "tool_call_id": "call-1", "content": "aisle 3: 40"})
        _, info = _run_turn(stack, chat, messages, TASKS[2])
        assert info.reuse in ("hit", "partial") and info.reused_tokens > 0, info
        assert chat.stats.keepalives >= 4 and chat.stats.keepalive_failures == 0


def test_end_of_run_release_frees_the_retained_blocks(stack: Stack) -> None:
    cfg = stack.config
    client = kvturn.OpenAI(base_url=f"{cfg.router_url}/v1", api_key="agents")
    chat = client.conversation()
    messages = _history(chat.id)
    for task in TASKS[:3]:
        _run_turn(stack, chat, messages, task)
    key = _key(chat.id, "agents")
    status, retention = control(cfg.decode_control_url, "GET", retention_path(key))
    assert status == 200
    held = retention_stats(cfg.decode_control_url)["held_blocks"]
    chat.close()
    # Other tests' retentions may expire meanwhile, so at least this one's blocks are gone.
    wait_until(lambda: retention_stats(cfg.decode_control_url)["held_blocks"]
               <= held - retention["num_blocks"], 10, "the released blocks to be freed")
    status, gone = control(cfg.decode_control_url, "GET", retention_path(key))
    assert status == 404 and gone["error"]["code"] == "released"
    assert chat.stats.release_failures == 0


def test_eight_concurrent_agents_with_random_gaps_match_plain_runs(stack: Stack) -> None:
    cfg = stack.config
    client = kvturn.OpenAI(base_url=f"{cfg.router_url}/v1", api_key="agents",
                           keepalive_interval=RETENTION_TTL / 4)
    budget = retention_stats(cfg.decode_control_url)["budget_blocks"]
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], retention_stats(cfg.decode_control_url)["retained_blocks"])

    def agent(number: int) -> list[Any]:
        rng = random.Random(number)
        reports = []
        with client.conversation() as chat:
            messages = [{"role": "system", "content": f"Agent {chat.id}. You plan briefly."}]
            for turn, task in enumerate(TASKS[:6]):
                _, info = _run_turn(stack, chat, messages, task, stream=rng.random() < 0.5)
                reports.append(info)
                with chat.pause("tool"):
                    time.sleep(rng.uniform(0, RETENTION_TTL / 4))  # a tool of random length
                if turn % 2:
                    messages.append({"role": "tool", "tool_call_id": f"c{turn}",
                                     "content": f"tool result {rng.randrange(100)}"})
        return reports

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(agent, range(8)))
    finally:
        done.set()
    for number, reports in enumerate(results):
        assert reports[0].reuse == "miss", number
        for turn, info in enumerate(reports[1:], start=1):
            assert info.reuse in ("hit", "partial") and info.reused_tokens > 0, \
                (number, turn, info)
    assert 0 < peak[0] <= budget


def test_a_conversation_resumed_in_a_new_process_keeps_its_id_and_reuses(
        stack: Stack) -> None:
    cfg = stack.config
    first_process = f"""
import json, kvturn
client = kvturn.OpenAI(base_url="{cfg.router_url}/v1", api_key="agents")
chat = client.conversation()
messages = [{{"role": "system", "content": chat.id + ". {SYSTEM}"}},
            {{"role": "user", "content": {TASKS[0]!r}}}]
reply = chat.chat.completions.create(model="{cfg.served_model_name}", messages=messages,
                                     temperature=0, max_tokens={MAX_TOKENS})
messages.append({{"role": "assistant", "content": reply.choices[0].message.content}})
print(json.dumps({{"id": chat.id, "messages": messages}}))
"""  # the process ends without closing: the retention outlives it, under its lease
    out = subprocess.run([sys.executable, "-c", first_process], capture_output=True, text=True,
                         timeout=120, check=True)
    saved = json.loads(out.stdout.strip().splitlines()[-1])
    client = kvturn.OpenAI(base_url=f"{cfg.router_url}/v1", api_key="agents")
    with client.conversation(id=saved["id"]) as chat:
        messages = saved["messages"]
        _, info = _run_turn(stack, chat, messages, TASKS[1])
        assert chat.id == saved["id"]
        assert info.reuse in ("hit", "partial") and info.reused_tokens > 0, info


@pytest.mark.parametrize("sdk", [False, True], ids=["openai", "kvturn"])
def test_history_edited_mid_run_reuses_only_the_verified_prefix(stack: Stack, sdk: bool) -> None:
    """A framework trims the last answer, through a plain openai client or a kvturn
    conversation (which sends it as written, no hint). The prefill reads the decode's blocks
    up to the edit and no further."""
    cfg = stack.config
    conversation = f"edited-{uuid.uuid4().hex}"
    client: Any = openai.OpenAI(base_url=f"{cfg.router_url}/v1", api_key="agents",
                                max_retries=0)
    if sdk:
        client = kvturn.OpenAI(base_url=f"{cfg.router_url}/v1", api_key="agents",
                               max_retries=0).conversation(conversation)
    messages = _history(conversation)
    fields = answer_fields(conversation_id=conversation)
    generated: list[int] = []
    prompt_ids: list[int] = []
    for task in TASKS[:2]:
        messages.append({"role": "user", "content": task})
        raw = client.chat.completions.with_raw_response.create(
            model=cfg.served_model_name, messages=messages,  # type: ignore[arg-type]
            temperature=0, max_tokens=MAX_TOKENS, **fields)
        reply = raw.parse()
        assert_same_reply(reply.model_dump(), _plain(stack, messages))
        prompt_ids = list((reply.model_extra or {})["prompt_token_ids"])
        generated = list((reply.choices[0].model_extra or {})["token_ids"])
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    retained = (prompt_ids + generated)[:(len(prompt_ids) + len(generated) - 1) // BLOCK * BLOCK]
    # The framework keeps only the first two thirds of the last answer.
    answer = messages[-1]["content"]
    messages[-1] = {"role": "assistant", "content": answer[:2 * len(answer) // 3]}
    messages.append({"role": "user", "content": TASKS[2]})
    reference = _plain(stack, messages)
    new_prompt = reference["prompt_token_ids"]
    with Delta(cfg.prefill_url) as p:
        raw = client.chat.completions.with_raw_response.create(
            model=cfg.served_model_name, messages=messages,  # type: ignore[arg-type]
            temperature=0, max_tokens=MAX_TOKENS, **fields)
    assert_same_reply(raw.parse().model_dump(), reference)
    reused = int(raw.headers["x-kvturn-reused-tokens"])
    assert p.value is not None and reused == p.value.transferred
    common = next((i for i, (a, b) in enumerate(zip(retained, new_prompt[:-1], strict=False))
                   if a != b), min(len(retained), len(new_prompt) - 1))
    verified = common // BLOCK * BLOCK
    expected = max(0, verified - int(p.value.local_cache))
    assert reused == (expected if expected >= 64 else 0), (reused, verified, p.value)
    assert raw.headers["x-kvturn-reuse"] in ("partial", "hit") and reused > 0, raw.headers
    if sdk:
        assert "x-kvturn-no-reuse" not in raw.http_request.headers
        assert client.last_turn.reused_tokens == reused
        assert client.last_turn.no_reuse_reason is None
        client.close()


@pytest.mark.restarts_decode
def test_a_decode_restarted_between_turns_is_stale_then_reuses_again(
        stack: Stack, say: Any) -> None:
    cfg = stack.config
    client = kvturn.OpenAI(base_url=f"{cfg.router_url}/v1", api_key="agents")
    with client.conversation() as chat:
        messages = _history(chat.id)
        _run_turn(stack, chat, messages, TASKS[0])
        _run_turn(stack, chat, messages, TASKS[1])
        say("restarting the decode between two turns")
        stack.restart("decode")
        _, info = _run_turn(stack, chat, messages, TASKS[2])
        assert info.reuse == "stale" and info.reused_tokens == 0, info
        _, info = _run_turn(stack, chat, messages, TASKS[3])
        assert info.reuse in ("hit", "partial") and info.reused_tokens > 0, info
