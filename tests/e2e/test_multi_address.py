"""Multi-host correctness on loopback: the session stack's router, prefill, decode and reference
each listen on a 127.0.0.x address of their own (``_settings.HOSTS``), every address and port
passed as the README's multi-host recipe passes them, and the prefill and the decode use the
same side-channel and control port numbers, as two hosts of a fleet do.

This file checks the addresses themselves: each member binds its own address only (never the
wildcard, never 127.0.0.1), what the decode advertises for a read names the decode's address,
and a conversation reuses the decode's KV from turn 2 on with answers equal to the plain
reference. Every other e2e test runs on the same spread-out stack.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any

from openai import OpenAI

from kvturn_server.local import Stack
from kvturn_server.local._direct import control, retention_path
from kvturn_server.local._process import port_is_free

from ._helpers import Delta, plain_chat, wait_until
from ._turns import assert_same_answer, chat_turn

MAX_TOKENS = 140  # past one KV block (128 tokens): turn 2 has decode-generated blocks to read
API_KEY = "tenant-multi-address"
SYSTEM = "You route parcels between depots. " + " ".join(
    f"Depot {i} ships to depot {i + 1}." for i in range(40))
QUESTIONS = ["Which depot ships first?", "And after that one?", "Name the last depot."]


def _listeners(port: int) -> set[str]:
    """The IPv4 addresses that listen on ``port`` here (/proc/net/tcp, state 0A = LISTEN)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


def test_every_member_binds_its_own_address_and_no_other(stack: Stack) -> None:
    cfg = stack.config
    hosts = {m: cfg.host_of(m) for m in ("router", "prefill", "decode", "reference")}
    assert len(set(hosts.values())) == 4 and "127.0.0.1" not in hosts.values(), hosts
    # The same numbers on two addresses: only a bind to each member's own address lets both
    # start (a wildcard or 127.0.0.1 bind of one would take the other's port).
    assert cfg.prefill_side_channel_port == cfg.decode_side_channel_port
    assert cfg.prefill_control_port == cfg.decode_control_port
    for what, (host, port) in cfg.binds().items():
        assert not port_is_free(host, port), f"{what}: nothing listens on {host}:{port}"
        assert "0.0.0.0" not in _listeners(port), f"{what}: port {port} bound on every address"
    for member, (spec, _) in stack.member_procs().items():
        assert spec.host == hosts[member]
        assert spec.health_url == f"http://{hosts[member]}:{spec.port}/health"


def test_a_conversation_across_addresses_reads_the_decodes_kv_from_turn_two(
        stack: Stack) -> None:
    cfg = stack.config
    model = cfg.served_model_name
    client = OpenAI(base_url=f"{cfg.router_url}/v1", api_key=API_KEY, max_retries=0)
    conversation = f"multi-address-{uuid.uuid4().hex}"
    key = f"{hashlib.sha256(f'Bearer {API_KEY}'.encode()).hexdigest()[:16]}/{conversation}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{conversation}. {SYSTEM}"}]
    for number, question in enumerate(QUESTIONS, start=1):
        messages.append({"role": "user", "content": question})
        reference = plain_chat(cfg.reference_url, model, messages, MAX_TOKENS)
        with Delta(cfg.prefill_url) as prefill:
            turn = chat_turn(client, model, conversation, messages, stream=number % 2 == 0,
                             max_tokens=MAX_TOKENS)
        assert_same_answer(turn, reference)
        assert prefill.value is not None
        if number == 1:
            assert turn.reuse == "miss" and turn.reused == 0, turn.headers
        else:
            # The prefill on 127.0.0.3 read the turn's KV from the decode on 127.0.0.4.
            assert turn.reuse in ("hit", "partial"), (number, turn.headers)
            assert turn.reused > 0 and turn.reused == prefill.value.transferred, (
                number, turn.reused, prefill.value)
        messages.append({"role": "assistant", "content": turn.text})

        _assert_advertises_its_own_address(stack, key, number)


def _assert_advertises_its_own_address(stack: Stack, key: str, turn: int) -> None:
    """What the decode hands a prefill for the next read names the decode's address and ports
    (the NIXL side channel the prefill dials, the control URL), never a default."""
    cfg = stack.config
    retention: dict[str, Any] = {}

    def described() -> bool:
        status, body = control(cfg.decode_control_url, "GET", retention_path(key))
        retention.update(body)
        return status == 200

    wait_until(described, 10, f"the decode's retention of turn {turn}")
    params = retention["params"]
    assert (params["remote_host"], params["remote_port"]) == (
        cfg.host_of("decode"), cfg.decode_side_channel_port)
    assert params["kvturn"]["control"] == cfg.decode_control_url
