"""Two router replicas sharing one real redis-server in front of the session's prefill and
decode (issue 14, item 2): a conversation whose turns alternate between the routers reuses its
KV on every turn; killing one router mid-run loses only the requests it had in flight."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from kvturn_server.local import Stack
from kvturn_server.local._process import stop_group

from ._helpers import plain_chat
from ._helpers import start_router as extra_router
from ._turns import assert_same_answer, chat_turn

MAX_TOKENS = 24
SYSTEM = "You are a terse assistant. " + " ".join(
    f"Fact {i}: item {i} weighs {i} kilograms." for i in range(24))
QUESTIONS = ["What does item 3 weigh?", "And item 7?", "Add those two weights.",
             "Which is heavier?"]

Launch = Callable[[str], tuple[str, int]]


@pytest.fixture(scope="module")
def start_router(stack: Stack, redis_server: str,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    """Starts router replicas over the session stack, all on one Redis state store."""
    cfg = stack.config
    logs: Path = tmp_path_factory.mktemp("replicas")
    pids: list[int] = []

    def start(name: str) -> tuple[str, int]:
        url, proc = extra_router(
            cfg, name, logs, "--state", redis_server, "--state-prefix", "replicas:",
            # The prefill path, as the session router: turns 2+ read the retention.
            "--decode-continue-tokens", "0", "--health-interval", "1", health="/ready")
        pids.append(proc.pid)
        return url, proc.pid

    yield start
    for pid in pids:
        stop_group(pid, grace=5)


def _client(url: str) -> OpenAI:
    # One tenant: the conversation key is scoped by the credential, the same on both routers.
    return OpenAI(base_url=f"{url}/v1", api_key="tenant-replicas", max_retries=0)


def test_turns_alternating_between_two_routers_reuse_every_turn(
        stack: Stack, start_router: Launch) -> None:
    cfg = stack.config
    routers = [_client(start_router("router-a")[0]), _client(start_router("router-b")[0])]
    conversation = f"replicas-{uuid.uuid4().hex}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{conversation}. {SYSTEM}"}]
    for number, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        reference = plain_chat(cfg.reference_url, cfg.served_model_name, messages, MAX_TOKENS)
        turn = chat_turn(routers[number % 2], cfg.served_model_name, conversation, messages,
                         stream=number % 2 == 1, max_tokens=MAX_TOKENS)
        assert_same_answer(turn, reference)
        if number:
            # The other router recorded the last turn in Redis: without that record a turn
            # is a "miss". With it, this router pins and reads the decode's retention, or (the
            # prefill it picks computed the last turn and still caches it all: kv-aware
            # placement, also from the record) skips the read; either way a hit.
            assert turn.reuse in ("hit", "partial"), (number, turn.headers)
        messages.append({"role": "assistant", "content": turn.text})


def test_killing_one_router_loses_only_its_in_flight_requests(
        stack: Stack, start_router: Launch) -> None:
    cfg = stack.config
    survivor = _client(start_router("router-survivor")[0])
    doomed_url, doomed_pid = start_router("router-doomed")
    doomed = _client(doomed_url)
    conversation = f"replicas-kill-{uuid.uuid4().hex}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{conversation}. {SYSTEM}"},
                                      {"role": "user", "content": QUESTIONS[0]}]
    first = chat_turn(doomed, cfg.served_model_name, conversation, messages, stream=False,
                      max_tokens=MAX_TOKENS)
    messages.append({"role": "assistant", "content": first.text})

    # A stream on each router; the doomed one dies after its stream's first chunk.
    other = f"replicas-other-{uuid.uuid4().hex}"
    other_messages = [{"role": "system", "content": f"{other}. {SYSTEM}"},
                      {"role": "user", "content": QUESTIONS[1]}]
    survived: dict[str, Any] = {}
    go = threading.Event()

    def on_survivor() -> None:
        go.wait(60)
        survived["turn"] = chat_turn(survivor, cfg.served_model_name, other, other_messages,
                                     stream=True, max_tokens=MAX_TOKENS)

    thread = threading.Thread(target=on_survivor)
    thread.start()
    lost = False
    with doomed.chat.completions.create(
            model=cfg.served_model_name, stream=True, temperature=0, max_tokens=200,
            messages=[*messages, {"role": "user", "content": QUESTIONS[2]}],
            extra_body={"conversation_id": f"replicas-lost-{uuid.uuid4().hex}"}) as stream:
        try:
            for _ in stream:
                if not go.is_set():
                    go.set()
                    os.killpg(doomed_pid, signal.SIGKILL)
        except Exception:  # the connection broke: the doomed router's request is lost
            lost = True
    thread.join(120)
    assert lost, "the killed router's stream ended cleanly"
    stop_group(doomed_pid, grace=1)

    # The other router's request was not disturbed...
    reference = plain_chat(cfg.reference_url, cfg.served_model_name, other_messages,
                           MAX_TOKENS)
    assert_same_answer(survived["turn"], reference)
    # ...and the conversation the dead router served goes on there, reusing its last turn.
    messages.append({"role": "user", "content": QUESTIONS[1]})
    reference = plain_chat(cfg.reference_url, cfg.served_model_name, messages, MAX_TOKENS)
    turn = chat_turn(survivor, cfg.served_model_name, conversation, messages, stream=False,
                     max_tokens=MAX_TOKENS)
    assert_same_answer(turn, reference)
    assert turn.reuse in ("hit", "partial"), turn.headers
