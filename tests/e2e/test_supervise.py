"""``kill -9`` of the decode's API server on the real stack, supervised as ``kvturn up`` runs it.

What happened before supervision and the router's engine tie: vLLM's engine core and workers
lived on for minutes after their API server died, holding the control and NIXL ports; the
router kept pinning through the still-answering control endpoint, the prefill read the dead
server's blocks and the router reported ``hit`` while the client got a 502; the decode could not
restart on its ports. Now: the supervisor stops the whole process group within seconds and
restarts the decode on the same ports, the router reports no ``hit`` for the dead server, and
the conversation goes on: a recompute, then reuse again from the new engine.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import pytest
from openai import OpenAI

from kvturn_server.local import Stack
from kvturn_server.local._direct import control
from kvturn_server.local._process import is_healthy, port_is_free

from ._helpers import descendant, plain_chat, wait_until
from ._turns import assert_same_answer, chat_turn

MAX_TOKENS = 16
LONG_REPLY = 160
SYSTEM = "You are a careful agent. " + " ".join(
    f"Step {i} checks item {i} of the list." for i in range(30))
QUESTIONS = ["List the first item.", "Now the second one.", "And the third.",
             "Then the fourth.", "Finally the fifth."]
# The old group must be gone well before a restart could even begin (SIGTERM, then SIGKILL
# after the supervisor's 5 s grace).
GROUP_GONE_WITHIN = 30.0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _raw_turn(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str]]:
    """A turn through the router with urllib: the status and headers, also of a 502."""
    request = urllib.request.Request(f"{url}/v1/chat/completions", method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json",
                                              "authorization": "Bearer supervise"})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            resp.read()
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as exc:
        with exc:
            exc.read()
            return exc.code, {k.lower(): v for k, v in exc.headers.items()}


@pytest.mark.restarts_decode
def test_a_killed_decode_api_server_is_cleaned_up_restarted_and_never_reported_hit(
        stack: Stack, say: Any) -> None:
    cfg = stack.config
    model = cfg.served_model_name
    client = OpenAI(base_url=f"{cfg.router_url}/v1", api_key="supervise", max_retries=0)
    conversation = f"supervise-{uuid.uuid4().hex}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{conversation}. {SYSTEM}"}]

    def turn(question: str, max_tokens: int = MAX_TOKENS) -> Any:
        messages.append({"role": "user", "content": question})
        # ignore_eos: every reply is max_tokens long (the long one must fill a block).
        reference = plain_chat(cfg.reference_url, model, messages, max_tokens,
                               ignore_eos=True)
        result = chat_turn(client, model, conversation, messages, False,
                           max_tokens=max_tokens, extra_body={"ignore_eos": True})
        assert_same_answer(result, reference)
        messages.append({"role": "assistant", "content": result.text})
        return result

    turn(QUESTIONS[0])
    second = turn(QUESTIONS[1])
    assert second.reuse in ("hit", "partial") and second.reused > 0, second.headers

    api_server = stack.pid("decode")
    engine_core = descendant(api_server, "VLLM::EngineCore")
    status, health = control(cfg.decode_control_url, "GET", "/health")
    assert status == 200
    old_engine = health["engine_id"]
    say(f"kill -9 of the decode's API server (pid {api_server}; engine core {engine_core})")
    killed_at = time.monotonic()
    os.kill(api_server, signal.SIGKILL)

    # The turn right after: whatever the router still believed, no hit for the dead server.
    messages.append({"role": "user", "content": QUESTIONS[2]})
    status, headers = _raw_turn(cfg.router_url, {
        "model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS,
        "conversation_id": conversation})
    messages.pop()
    assert status in (502, 503), (status, headers)
    assert headers["x-kvturn-reuse"] != "hit" and headers["x-kvturn-reused-tokens"] == "0", \
        headers

    # The whole group (engine core, workers) is gone, and the decode is back on its ports.
    wait_until(lambda: not _group_alive(api_server), GROUP_GONE_WITHIN,
               "the killed decode's process group gone")
    assert not _group_alive(engine_core) and not os.path.exists(f"/proc/{engine_core}")
    say(f"old decode process group gone after {time.monotonic() - killed_at:.1f} s")
    wait_until(lambda: stack.pid("decode") != api_server, 30, "decode relaunched")
    wait_until(lambda: is_healthy(f"{cfg.decode_url}/health"), cfg.startup_timeout,
               "restarted decode healthy")
    say(f"decode healthy again {time.monotonic() - killed_at:.0f} s after the kill")
    status, health = control(cfg.decode_control_url, "GET", "/health")
    assert status == 200 and health["engine_id"] != old_engine  # the control port: new engine
    # The NIXL side channel is bound again.
    assert not port_is_free(cfg.host_of("decode"), cfg.decode_side_channel_port)
    log_path = cfg.state_dir / "logs" / "decode.log"
    # The supervisor writes its last line after its own health poll (up to 0.5 s later).
    wait_until(lambda: "healthy again" in log_path.read_text(errors="replace"), 10,
               "the supervisor's 'healthy again' line")
    log = log_path.read_text(errors="replace")
    assert f"decode (pid {api_server}) exited killed by SIGKILL" in log
    assert "its ports are free" in log

    # The conversation goes on: the new engine holds nothing of it (recompute), then reuses.
    # A reply longer than a KV block (128 tokens), so that the new decode's retention holds a
    # full block the prefill's own cache lacks: the next turn must read it from the decode.
    third = turn(QUESTIONS[2], max_tokens=LONG_REPLY)
    assert third.reuse in ("stale", "miss", "below-threshold") and third.reused == 0, \
        third.headers
    fourth = turn(QUESTIONS[3])
    assert fourth.reuse in ("hit", "partial") and fourth.reused > 0, fourth.headers
