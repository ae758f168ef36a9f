"""The router through the real stack: conversations captured from streaming and non-streaming
turns, reuse headers, keepalive and release, tenants, and a two-prefill two-decode fleet that
loses a decode mid-run. Every answer is compared with a plain single-instance run.

Clients are the stock ``openai`` package: the router must work with it unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx2
import pytest
from openai import OpenAI

from kvturn_server.local import Stack, StackConfig, free_port
from kvturn_server.local._direct import control, retention_path
from kvturn_server.local._launch import server_specs
from kvturn_server.local._process import ServerSpec, launch, stop_group, wait_healthy

from ._helpers import Delta, plain_chat, wait_until
from ._settings import RETENTION_TTL
from ._turns import Turn, assert_same_answer, chat_turn

MAX_TOKENS = 140  # past one KV block: every turn has decode-generated blocks to read
SYSTEM = "You are a planning agent. " + " ".join(f"Rule {i}: write step {i}." for i in range(60))
QUESTIONS = [
    "Plan the move of the archive to the new building.",
    "What should happen first, and who does it?",
    "List the risks of the second step.",
    "Summarise the plan in three lines.",
    "Which step needs the most people?",
]


def _client(base_url: str, api_key: str = "tenant-a") -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)


def _conversation_call(base_url: str, method: str, conversation: str, action: str = "",
                       api_key: str = "tenant-a") -> httpx2.Response:
    """The router's conversation endpoints, with the same tenant credential as the turns."""
    path = f"/kvturn/v1/conversations/{conversation}" + (f"/{action}" if action else "")
    return httpx2.request(method, base_url + path, timeout=30,
                          headers={"Authorization": f"Bearer {api_key}"})


def _plain(stack: Stack, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    cfg = stack.config
    return plain_chat(cfg.reference_url, cfg.served_model_name, messages, MAX_TOKENS, **extra)


def _text(reply: dict[str, Any]) -> str:
    text: str = reply["choices"][0]["message"]["content"]
    return text


def _turn(client: OpenAI, model: str, conversation: str, messages: list[dict[str, Any]],
          stream: bool, **extra: Any) -> Turn:
    return chat_turn(client, model, conversation, messages, stream, max_tokens=MAX_TOKENS,
                     **extra)


def _conversation(stack: Stack, stream: bool, turns: int = 4, client: OpenAI | None = None,
                  ) -> tuple[str, list[Turn], Any, list[dict[str, Any]]]:
    cfg = stack.config
    client = client or _client(cfg.router_url)
    conversation = f"router-{uuid.uuid4().hex}"
    # A history of its own: another test's identical turns would sit in the prefill's cache.
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{conversation}. {SYSTEM}"}]
    done: list[Turn] = []
    sources = []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        reference = _plain(stack, messages)
        with Delta(cfg.prefill_url) as p:
            turn = _turn(client, cfg.served_model_name, conversation, messages, stream)
        assert_same_answer(turn, reference)
        done.append(turn)
        sources.append(p.value)
        messages.append({"role": "assistant", "content": turn.text})
    return conversation, done, sources, messages


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_turns_capture_the_retention_and_the_next_turn_reuses(stack: Stack, stream: bool) -> None:
    conversation, turns, sources, _ = _conversation(stack, stream)
    assert turns[0].reuse == "miss" and turns[0].reused == 0
    for i, (turn, p) in enumerate(zip(turns[1:], sources[1:], strict=True), start=1):
        assert turn.reuse in ("hit", "partial"), (i, turn.headers)
        assert turn.reused > 0 and turn.reused == p.transferred, (i, turn.reused, p)
        assert turn.headers["x-kvturn-conversation"] == conversation
    assert _conversation_call(stack.config.router_url, "DELETE", conversation).json()[
        "released"] is True


def _stop_string_after(text: str, words: int) -> str:
    """A word of ``text`` (with its leading space) whose first occurrence is at or after word
    number ``words``: as a stop string it cuts ``text`` there."""
    for number, match in enumerate(re.finditer(r" \S+", text)):
        if number >= words and text.find(match.group()) == match.start():
            return match.group()
    raise AssertionError(f"no word after {words} occurs first there: {text!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_a_turn_ended_by_a_stop_string_is_reused(stack: Stack, stream: bool) -> None:
    # vLLM ends a stop-string match as an abort in the decode's engine, after the reply went
    # out: the decode still retains the turn, and the router still captures it.
    cfg = stack.config
    client = _client(cfg.router_url)
    conversation = f"stop-{uuid.uuid4().hex}"
    # A prompt under one block: whatever the next turn reads was generated by the decode.
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"{conversation}. You plan."},
        {"role": "user", "content": QUESTIONS[0]}]
    stop = _stop_string_after(_text(_plain(stack, messages)), words=110)
    reference = _plain(stack, messages, stop=[stop])
    assert reference["choices"][0]["finish_reason"] == "stop"
    first = _turn(client, cfg.served_model_name, conversation, messages, stream, stop=[stop])
    assert_same_answer(first, reference)
    assert first.reuse == "miss"

    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": QUESTIONS[1]}]
    with Delta(cfg.prefill_url) as p:
        second = _turn(client, cfg.served_model_name, conversation, messages, stream)
    assert_same_answer(second, _plain(stack, messages))
    assert second.reuse in ("hit", "partial"), second.headers
    assert second.reused >= 128 and second.reused == p.value.transferred, (second.reused, p.value)
    _conversation_call(cfg.router_url, "DELETE", conversation)


def test_keepalive_and_release_reach_the_decode(stack: Stack) -> None:
    cfg = stack.config
    client = _client(cfg.router_url)
    conversation, _, _, history = _conversation(stack, stream=False, turns=1, client=client)
    kept = _conversation_call(cfg.router_url, "POST", conversation, "keepalive")
    assert kept.status_code == 200 and kept.json()["retained"] is True, kept.text
    assert 0 < kept.json()["expires_in"] <= RETENTION_TTL
    # Another tenant cannot see or release it.
    assert _conversation_call(cfg.router_url, "POST", conversation, "keepalive",
                              api_key="tenant-b").status_code == 404
    released = _conversation_call(cfg.router_url, "DELETE", conversation)
    assert released.json() == {"conversation_id": conversation, "released": True}
    again = _conversation_call(cfg.router_url, "DELETE", conversation)
    assert again.json() == {"conversation_id": conversation, "released": False}
    messages = [*history, {"role": "user", "content": "Go on."}]
    turn = _turn(client, cfg.served_model_name, conversation, messages, stream=False)
    assert turn.reuse == "miss"
    assert_same_answer(turn, _plain(stack, messages))


def test_no_reuse_hint_and_tenants(stack: Stack) -> None:
    cfg = stack.config
    client = _client(cfg.router_url)
    conversation, _, _, history = _conversation(stack, stream=False, turns=1, client=client)
    messages = [*history, {"role": "user", "content": QUESTIONS[1]}]
    reference = _plain(stack, messages)
    # Another tenant with the same conversation id shares nothing.
    other = _turn(_client(cfg.router_url, api_key="tenant-b"), cfg.served_model_name,
                  conversation, messages, stream=False)
    assert other.reuse == "miss"
    assert_same_answer(other, reference)
    # The client says the history does not continue the last turn: no read, same answer.
    hinted = _turn(client, cfg.served_model_name, conversation, messages, stream=False,
                   extra_headers={"X-KVTurn-No-Reuse": "edited"})
    assert hinted.reuse == "disabled" and hinted.reused == 0
    assert_same_answer(hinted, reference)
    # The hinted turn was still retained: the next one reuses.
    messages += [{"role": "assistant", "content": hinted.text},
                 {"role": "user", "content": QUESTIONS[2]}]
    after = _turn(client, cfg.served_model_name, conversation, messages, stream=True)
    assert after.reuse in ("hit", "partial") and after.reused > 0, after.headers
    assert_same_answer(after, _plain(stack, messages))


def test_an_expired_retention_is_reported_and_recomputed(stack: Stack) -> None:
    cfg = stack.config
    client = _client(cfg.router_url)
    conversation, _, _, history = _conversation(stack, stream=False, turns=1, client=client)
    key = f"{hashlib.sha256(b'Bearer tenant-a').hexdigest()[:16]}/{conversation}"
    wait_until(lambda: control(cfg.decode_control_url, "GET", retention_path(key))[0] == 404,
               RETENTION_TTL + 10, "the retention to expire")
    messages = [*history, {"role": "user", "content": QUESTIONS[1]}]
    turn = _turn(client, cfg.served_model_name, conversation, messages, stream=True)
    assert turn.reuse == "expired" and turn.reused == 0
    assert_same_answer(turn, _plain(stack, messages))


# A fleet of two prefills and two decodes, one decode killed mid-run.


@dataclass
class Fleet:
    router_url: str
    prefills: list[str]
    decodes: list[tuple[str, str]]  # (url, control url)
    decode2_pid: int


def _second(spec: ServerSpec, name: str) -> ServerSpec:
    return replace(spec, name=name, log_path=spec.log_path.with_name(f"{name}.log"))


@pytest.fixture(scope="module")
def fleet(stack: Stack, tmp_path_factory: pytest.TempPathFactory,
          say: Callable[[str], None]) -> Iterator[Fleet]:
    cfg = stack.config
    state = tmp_path_factory.mktemp("fleet")
    # A second pair and its router on addresses of their own, like more hosts of the fleet.
    hosts = {"prefill_host": "127.0.0.6", "decode_host": "127.0.0.7", "router_host": "127.0.0.8"}
    ports = {f"{member}_{what}": free_port(hosts[f"{member}_host"]) for member, what in (
        ("prefill", "port"), ("decode", "port"), ("prefill", "side_channel_port"),
        ("decode", "side_channel_port"), ("prefill", "control_port"), ("decode", "control_port"),
        ("router", "port"))}
    second: StackConfig = replace(cfg, state_dir=state, with_reference=False, with_router=False,
                                  model_dir=cfg.model_path, **hosts, **ports)
    specs = {s.name: s for s in server_specs(second)}
    prefill2, decode2 = _second(specs["prefill"], "prefill2"), _second(specs["decode"], "decode2")
    router = ServerSpec(
        name="fleet-router", port=second.router_port,
        health_url=f"{second.router_url}/health", log_path=state / "logs" / "router.log",
        env={"PYTHONUNBUFFERED": "1"},
        argv=[sys.executable, "-m", "kvturn_server.cli", "router",
              "--host", second.host_of("router"), "--port", str(second.router_port),
              "--prefill", cfg.prefill_url, "--prefill", second.prefill_url,
              "--decode", f"{cfg.decode_url},control={cfg.decode_control_url}",
              "--decode", f"{second.decode_url},control={second.decode_control_url}",
              "--retention-ttl", f"{cfg.decoder_kv_blocks_ttl:g}",
              # Every turn takes a prefill leg: placement across two prefills is what these
              # tests check (turns the decode continues alone: test_placement.py).
              "--decode-continue-tokens", "0",
              "--health-interval", "1", "--eject-after", "1"])
    procs = {}
    try:
        say("starting a second prefill and decode for the fleet test")
        for spec in (prefill2, decode2):
            procs[spec.name] = (spec, launch(spec, die_with_parent=True))
        wait_healthy(procs, timeout=cfg.startup_timeout)
        procs[router.name] = (router, launch(router, die_with_parent=True))
        wait_healthy({router.name: procs[router.name]}, timeout=60)
        yield Fleet(second.router_url, [cfg.prefill_url, second.prefill_url],
                    [(cfg.decode_url, cfg.decode_control_url),
                                        (second.decode_url, second.decode_control_url)],
                    procs["decode2"][1].pid)
    finally:
        for _, proc in procs.values():
            stop_group(proc.pid)


def _holder(fleet: Fleet, key: str) -> int | None:
    for i, (_, control_url) in enumerate(fleet.decodes):
        try:
            if control(control_url, "GET", retention_path(key), timeout=2)[0] == 200:
                return i
        except OSError:
            continue
    return None


def test_the_next_turn_lands_on_the_prefill_that_holds_it_and_reads_only_what_it_lacks(
        stack: Stack, fleet: Fleet) -> None:
    client = _client(fleet.router_url)
    conversation = f"placed-{uuid.uuid4().hex}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{conversation}. {SYSTEM}"}]
    holder: str | None = None
    for number, question in enumerate(QUESTIONS[:3], start=1):
        messages.append({"role": "user", "content": question})
        reference = _plain(stack, messages)
        with contextlib.ExitStack() as measuring:
            deltas = [measuring.enter_context(Delta(url)) for url in fleet.prefills]
            turn = _turn(client, stack.config.served_model_name, conversation, messages, False)
        assert_same_answer(turn, reference)
        messages.append({"role": "assistant", "content": turn.text})
        worked = [url for url, d in zip(fleet.prefills, deltas, strict=True)
                  if d.value is not None and d.value.computed > 0]
        assert len(worked) == 1, [d.value for d in deltas]
        if holder is None:
            holder = worked[0]
            continue
        assert worked == [holder], (number, worked, holder)
        assert turn.headers["x-kvturn-prefill-choice"] == "holder", turn.headers
        (p,) = [d.value for url, d in zip(fleet.prefills, deltas, strict=True) if url == holder]
        assert p is not None
        # Its own cache held the previous prompt; the decode supplied only the reply's blocks.
        assert p.local_cache > 0 and turn.reused > 0 and turn.reused == p.transferred, \
            (number, turn.reused, p)
        assert turn.reused <= MAX_TOKENS + 128, (turn.reused, p)
    _conversation_call(fleet.router_url, "DELETE", conversation)


def test_a_decode_killed_mid_run_loses_only_its_in_flight_requests(
        stack: Stack, fleet: Fleet) -> None:
    cfg = stack.config
    client = _client(fleet.router_url)
    tenant = hashlib.sha256(b"Bearer tenant-a").hexdigest()[:16]
    names = [f"fleet-{i}-{uuid.uuid4().hex[:8]}" for i in range(6)]
    histories: dict[str, list[dict[str, Any]]] = {
        n: [{"role": "system", "content": f"{n}. {SYSTEM}"}] for n in names}

    def turn(name: str, question: str, stream: bool) -> Turn:
        messages = [*histories[name], {"role": "user", "content": question}]
        result = _turn(client, cfg.served_model_name, name, messages, stream)
        reference = _plain(stack, messages)
        assert_same_answer(result, reference)
        histories[name] = [*messages, {"role": "assistant", "content": result.text}]
        # Six agents, each in a "tool call" while the others take their turns: each keeps
        # its lease alive, as the SDK's pause() would (the round takes about one lease).
        for other in names:
            _conversation_call(fleet.router_url, "POST", other, "keepalive")
        return result

    for q in QUESTIONS[:2]:
        for i, name in enumerate(names):
            turn(name, q, stream=bool(i % 2))
    holders = {n: _holder(fleet, f"{tenant}/{n}") for n in names}
    assert set(holders.values()) == {0, 1}, holders  # conversations spread over both decodes
    on_second = [n for n in names if holders[n] == 1]

    # One request in flight on the second decode when it dies: that one may fail.
    victim = on_second[0]
    started = threading.Event()
    outcome: list[BaseException | None] = []

    def in_flight() -> None:
        messages = [*histories[victim], {"role": "user", "content": QUESTIONS[2]}]
        try:
            with client.chat.completions.with_streaming_response.create(
                    model=cfg.served_model_name, messages=messages, temperature=0,
                    max_tokens=400, stream=True,
                    extra_body={"conversation_id": victim, "ignore_eos": True}) as response:
                for _ in response.parse():
                    started.set()
            outcome.append(None)
        except Exception as exc:  # the stream breaks: expected for the one in flight
            outcome.append(exc)
        finally:
            started.set()

    thread = threading.Thread(target=in_flight)
    thread.start()
    assert started.wait(60)
    os.killpg(fleet.decode2_pid, signal.SIGKILL)
    thread.join(60)

    # Every other conversation goes on: the next turn recomputes on the surviving decode...
    after_kill = {n: turn(n, QUESTIONS[3], stream=True) for n in names}
    for name in on_second:
        assert after_kill[name].reuse in ("stale", "miss"), after_kill[name].headers
    for name in names:
        if name not in on_second:
            assert after_kill[name].reuse in ("hit", "partial"), after_kill[name].headers
            assert after_kill[name].reused > 0, after_kill[name].headers
    # ... and the one after reuses again, from there.
    again = {n: turn(n, QUESTIONS[4], stream=False) for n in names}
    for name in names:
        assert again[name].reuse in ("hit", "partial") and again[name].reused > 0, name
        assert _holder(fleet, f"{tenant}/{name}") == 0
