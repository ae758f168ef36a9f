"""The kvturn SDK through the real stack: a conversation reuses from its second turn, its
answers equal a plain run, and closing it releases the decode's retention."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kvturn
from kvturn_server.local import Stack
from kvturn_server.local._direct import control, retention_path

from ._helpers import plain_chat
from ._turns import answer_fields, answer_of, assert_same_answer

MAX_TOKENS = 140
SYSTEM = "You answer in short plans. " + " ".join(f"Step {i} is checked." for i in range(50))
QUESTIONS = ["Plan a library move.", "Who packs the books?", "What can go wrong?",
             "How long will it take?", "Summarise."]
ROOT = Path(__file__).resolve().parents[2]


def _plain(stack: Stack, messages: list[dict[str, Any]]) -> dict[str, Any]:
    cfg = stack.config
    return plain_chat(cfg.reference_url, cfg.served_model_name, messages, MAX_TOKENS)


def _tenant_key(conversation: str, api_key: str) -> str:
    import hashlib

    return f"{hashlib.sha256(f'Bearer {api_key}'.encode()).hexdigest()[:16]}/{conversation}"


def test_a_conversation_reuses_from_turn_two_and_releases_at_close(stack: Stack) -> None:
    cfg = stack.config
    client = kvturn.OpenAI(base_url=f"{cfg.router_url}/v1", api_key="sdk-e2e")
    with client.conversation() as chat:
        messages: list[dict[str, Any]] = [{"role": "system", "content": f"{chat.id}. {SYSTEM}"}]
        for turn, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            reference = _plain(stack, messages)
            stream = bool(turn % 2)
            answer = answer_of(chat.chat.completions.create(
                model=cfg.served_model_name, messages=messages,  # type: ignore[arg-type]
                temperature=0, max_tokens=MAX_TOKENS, stream=stream, **answer_fields()), stream)
            assert_same_answer(answer, reference)
            text = answer.text
            info = chat.last_turn
            assert info is not None and info.no_reuse_reason is None
            if turn:
                assert info.reuse in ("hit", "partial") and info.reused_tokens > 0, (turn, info)
            else:
                assert info.reuse == "miss"
            messages.append({"role": "assistant", "content": text})
        key = _tenant_key(chat.id, "sdk-e2e")
        assert control(cfg.decode_control_url, "GET", retention_path(key))[0] == 200
        assert chat.stats.turns == 5 and chat.stats.hits == 4
    status, gone = control(cfg.decode_control_url, "GET", retention_path(key))
    assert status == 404 and gone["error"]["code"] == "released"
    assert chat.stats.release_failures == 0


def test_the_quickstart_runs_against_the_stack(stack: Stack) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"),
         "--base-url", f"{stack.config.router_url}/v1", "--model",
         stack.config.served_model_name],
        capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("turn ")]
    assert len(lines) == 5 and "reuse=miss" in lines[0], out.stdout
    assert all("reuse=hit" in line or "reuse=partial" in line for line in lines[1:]), out.stdout
    read = [re.search(r"reused_tokens=\s*(\d+)", line) for line in lines[1:]]
    assert all(m is not None and int(m.group(1)) > 0 for m in read), out.stdout
    assert "released conversation" in out.stdout
