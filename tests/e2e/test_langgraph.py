"""The LangGraph agent (examples/langgraph_agent.py) through the real stack: a create_agent
tool loop of six model turns reuses on every turn after the first, a tool slower than the
retention's TTL does not lose the lease (its calls keep it alive), every model output equals
the same graph run with a stock ChatOpenAI against the plain reference instance, and the end of
the run releases the decode's retention."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import uuid
from pathlib import Path
from types import ModuleType

import pytest

from kvturn_server.local import Stack
from kvturn_server.local._direct import control, retention_path

from ._helpers import Delta
from ._settings import RETENTION_TTL

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langgraph_agent.py"
API_KEY = "langgraph-e2e"
TURNS = 6
# Per tool call (five, one per forced turn): the third outlives an unrenewed lease (TTL 12 s),
# so the turn after it reuses only because the tool call kept the lease alive.
TOOL_LATENCY = [0.2, 0.2, RETENTION_TTL + 2.0, 0.2, 0.2]


@pytest.fixture(scope="module")
def agent() -> ModuleType:
    spec = importlib.util.spec_from_file_location("langgraph_agent", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["langgraph_agent"] = module
    spec.loader.exec_module(module)
    return module


def _tenant_key(conversation: str) -> str:
    return f"{hashlib.sha256(f'Bearer {API_KEY}'.encode()).hexdigest()[:16]}/{conversation}"


def test_agent_reuses_every_turn_matches_a_plain_run_and_releases(
        stack: Stack, agent: ModuleType) -> None:
    cfg = stack.config
    thread = f"langgraph-{uuid.uuid4().hex}"
    # The same tag in both runs: the same prompts; a tag of its own: no prefix shared with
    # another test's prompts in any cache.
    tag = thread

    with Delta(cfg.prefill_url) as p:
        routed = agent.run_agent(f"{cfg.router_url}/v1", cfg.served_model_name, TURNS,
                                 api_key=API_KEY, thread_id=thread, tool_latency=TOOL_LATENCY,
                                 keepalive_interval=RETENTION_TTL / 4, tag=tag)
    plain = agent.run_agent(f"{cfg.reference_url}/v1", cfg.served_model_name, TURNS,
                            plain=True, tool_latency=0.0, tag=tag)

    # Six model turns: five forced tool calls in schedule order, then an answer.
    names = [name for name, _, _ in agent.TOOLS]
    assert [r.tool for r in routed] == [*names, None], routed
    assert [r.tool for r in plain] == [*names, None], plain
    # Every output (tool-call arguments, the final text) equals the plain run's.
    for ours, theirs in zip(routed, plain, strict=True):
        assert ours.output == theirs.output, (ours, theirs)
    assert routed[-1].output.strip()

    # One conversation, the thread's; reuse from the second turn on (the slow tool included).
    assert {r.conversation_id for r in routed} == {thread}
    assert routed[0].reuse == "miss", routed[0]
    for report in routed[1:]:
        assert report.reuse in ("hit", "partial"), report
    # The reads reported are the reads made. A turn after a short tool call may read nothing
    # and still be a hit: the prefill's own cache covers every full block (the reason is
    # coverage, not bytes moved; connector/_reuse.py), so no count per turn is asserted.
    assert p.value is not None
    assert sum(r.reused_tokens for r in routed) == p.value.transferred, (routed, p.value)
    assert all(r.reuse is None for r in plain)

    # The run's end released the decode's retention.
    status, gone = control(cfg.decode_control_url, "GET", retention_path(_tenant_key(thread)))
    assert status == 404 and gone["error"]["code"] == "released", (status, gone)
