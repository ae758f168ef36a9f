"""The OpenAI Agents SDK agent (examples/openai_agents_sdk.py) through the real stack, on the
SDK's Chat Completions model and on its Responses model: a session of two ``Runner`` runs (a
forced tool call, then an answer, each) is one kvturn conversation whose turns reuse from the
second on (the prefill reads from the decode what it reports), every model output equals the
same session run on the SDK's stock provider against the plain reference instance, and the
end of the session releases the decode's retention."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvturn_server.local import Stack
from kvturn_server.local._direct import control, retention_path

from ._greedy import TOP, assert_same_text
from ._helpers import Delta

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agents_sdk.py"
API_KEY = "agents-sdk-e2e"
RUNS = 2  # four model turns: tool, answer, tool, answer
# Answers long enough to fill a 128-token block with generated tokens: the next run's first
# turn then reads that block from the decode (the prefill never computed it).
MAX_TOKENS = 140


@pytest.fixture(scope="module")
def agent() -> ModuleType:
    spec = importlib.util.spec_from_file_location("openai_agents_sdk", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["openai_agents_sdk"] = module
    spec.loader.exec_module(module)
    return module


def _tenant_key(conversation: str) -> str:
    return f"{hashlib.sha256(f'Bearer {API_KEY}'.encode()).hexdigest()[:16]}/{conversation}"


def _reference(report: Any) -> dict[str, Any]:
    """A plain run's answer as the chat-shaped reference ``assert_same_text`` reads."""
    entries = [{"token": token, "logprob": logprob,
                "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top]}
               for token, logprob, top in report.logprobs]
    return {"choices": [{"message": {"content": report.output},
                         "logprobs": {"content": entries}}]}


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_session_reuses_matches_a_plain_run_and_releases(
        stack: Stack, agent: ModuleType, api: str) -> None:
    cfg = stack.config
    session = f"agents-{api}-{uuid.uuid4().hex}"
    common: dict[str, Any] = {"api": api, "tool_latency": 0.0, "max_tokens": MAX_TOKENS,
                              "logprobs": TOP, "tag": session}

    with Delta(cfg.prefill_url) as p:
        routed = agent.run_agent(f"{cfg.router_url}/v1", cfg.served_model_name, RUNS,
                                 api_key=API_KEY, session_id=session, **common)
    plain = agent.run_agent(f"{cfg.reference_url}/v1", cfg.served_model_name, RUNS,
                            plain=True, **common)

    # Per run: the forced tool call, then an answer.
    names = [name for name, _, _ in agent.TOOLS[:RUNS]]
    expected = [tool for name in names for tool in (name, None)]
    assert [r.tool for r in routed] == expected, routed
    assert [r.tool for r in plain] == expected, plain
    for ours, theirs in zip(routed, plain, strict=True):
        if ours.tool is None:
            assert_same_text(ours.output, _reference(theirs), None,
                             [(token, logprob) for token, logprob, _ in ours.logprobs])
        else:  # structured arguments carry no logprobs: they must equal the reference's
            assert_same_text(ours.output, {"choices": [{"message": {
                "content": theirs.output}}]})

    # One conversation, the session's; reuse from the second turn on, in both runs.
    assert {r.conversation_id for r in routed} == {session}
    assert routed[0].reuse == "miss", routed[0]
    for report in routed[1:]:
        assert report.reuse in ("hit", "partial"), report
    # The reads reported are the reads made (the prefill read them from the decode).
    assert p.value is not None
    assert sum(r.reused_tokens for r in routed) == p.value.transferred, (routed, p.value)
    assert p.value.transferred > 0, p.value
    assert all(r.reuse is None for r in plain)

    # The session's end released the decode's retention.
    status, gone = control(cfg.decode_control_url, "GET", retention_path(_tenant_key(session)))
    assert status == 404 and gone["error"]["code"] == "released", (status, gone)
