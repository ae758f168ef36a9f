"""examples/langgraph_agent.py against the fake router: the forced-tool schedule, per-turn
reports, reuse after the first turn, keepalive while a tool runs, release at the end."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx2
import pytest

from tests.fakes.router_api import BASE_URL
from tests.integrations._router import FakeRouter, breaks

EXAMPLE = Path(__file__).parents[2] / "examples" / "langgraph_agent.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("langgraph_agent", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["langgraph_agent"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run(example: ModuleType, router: FakeRouter, **kwargs: Any) -> list[Any]:
    client = httpx2.Client(transport=httpx2.MockTransport(router))
    reports: list[Any] = example.run_agent(BASE_URL, "kvturn-tiny", http_client=client,
                                           **kwargs)
    return reports


def test_six_turns_forced_tools_then_an_answer(example: ModuleType,
                                               router: FakeRouter) -> None:
    reports = run(example, router, turns=6, thread_id="demo-1", tool_latency=0.0)

    names = [name for name, _, _ in example.TOOLS]
    assert [r.tool for r in reports] == [*names, None]
    assert [r.output for r in reports[:5]] == ["{}"] * 5
    assert reports[5].output.startswith("final answer")
    assert [r.reuse for r in reports] == ["miss"] + ["hit"] * 5
    assert all(r.reused_tokens > 0 for r in reports[1:])
    assert all(r.ttft is not None and r.ttft >= 0 for r in reports)
    assert {r.conversation_id for r in reports} == {"demo-1"}

    turns = router.turns()
    assert [t.body.get("tool_choice") for t in turns] == [
        *({"type": "function", "function": {"name": name}} for name in names), None]
    assert all(t.body["stream"] and t.body["temperature"] == 0 for t in turns)
    assert all(t.body["max_completion_tokens"] == 140 for t in turns)
    assert breaks(router) == []  # each turn resent the last one and its reply exactly
    assert router.releases() == ["demo-1"]


def test_slow_tools_keep_the_lease_alive(example: ModuleType, router: FakeRouter) -> None:
    # One slow tool, a keepalive interval well inside it: the router sees renewals.
    run(example, router, turns=2, thread_id="demo-2", tool_latency=[0.5],
        keepalive_interval=0.01)
    assert router.keepalives("demo-2")


def test_plain_runs_are_untouched(example: ModuleType, router: FakeRouter) -> None:
    reports = run(example, router, turns=3, plain=True)
    assert [r.reuse for r in reports] == [None] * 3
    assert router.turn_ids() == [None] * 3
    assert router.releases() == [] and router.keepalives() == []


def test_a_plain_run_can_send_the_thread_as_its_conversation(example: ModuleType,
                                                            router: FakeRouter) -> None:
    # Stock conditional disaggregation's client: the header on every turn, nothing else.
    reports = run(example, router, turns=3, plain=True, conversation_header=True,
                  thread_id="stock-1")
    assert [r.reuse for r in reports] == [None] * 3
    assert router.turn_ids() == ["stock-1"] * 3
    assert router.releases() == [] and router.keepalives() == []
    with pytest.raises(ValueError, match="plain runs"):
        run(example, router, turns=1, conversation_header=True)
