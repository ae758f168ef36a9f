"""examples/openai_agents_sdk.py against the fake router: per user message a forced tool call
then an answer, per-turn reports, one conversation for the session with reuse after the first
turn (Chat Completions and Responses), keepalive while a tool runs, release at the end."""

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

EXAMPLE = Path(__file__).parents[2] / "examples" / "openai_agents_sdk.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("openai_agents_sdk", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["openai_agents_sdk"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def router() -> FakeRouter:
    return FakeRouter(tool_rounds=1)  # the SDK lets the model choose after the forced call


async def run(example: ModuleType, router: FakeRouter, **kwargs: Any) -> list[Any]:
    client = httpx2.AsyncClient(transport=httpx2.MockTransport(router))
    reports: list[Any] = await example.arun_agent(BASE_URL, "kvturn-tiny", http_client=client,
                                                  **kwargs)
    return reports


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_forced_tool_then_answer_per_run_one_conversation(
        example: ModuleType, router: FakeRouter, api: str) -> None:
    calls: list[Any] = []
    reports = await run(example, router, runs=3, api=api, session_id="s-1", tool_latency=0.0,
                        on_call=calls.append)

    names = [name for name, _, _ in example.TOOLS]
    assert [(r.run, r.tool) for r in reports] == [
        (1, names[0]), (1, None), (2, names[1]), (2, None), (3, names[2]), (3, None)]
    assert [r.output for r in reports[::2]] == ["{}"] * 3
    assert all(r.output.startswith("final answer") for r in reports[1::2])
    assert [r.reuse for r in reports] == ["miss"] + ["hit"] * 5
    assert all(r.reused_tokens > 0 for r in reports[1:])
    assert all(r.ttft is not None and r.ttft >= 0 for r in reports)
    assert {r.conversation_id for r in reports} == {"s-1"}
    assert calls == [x for r in reports for x in (None, r)]

    turns = router.turns()
    assert {t.path for t in turns} == {"/v1/chat/completions" if api == "chat"
                                       else "/v1/responses"}
    assert all(t.body["stream"] and t.body["temperature"] == 0 for t in turns)
    assert breaks(router) == []  # each turn resent the last one and its reply exactly
    assert router.releases() == ["s-1"]


async def test_slow_tools_keep_the_lease_alive(example: ModuleType,
                                               router: FakeRouter) -> None:
    await run(example, router, runs=1, session_id="s-2", tool_latency=0.5,
              keepalive_interval=0.01)
    assert router.keepalives("s-2")


async def test_plain_runs_are_untouched(example: ModuleType, router: FakeRouter) -> None:
    reports = await run(example, router, runs=2, plain=True)
    assert [r.reuse for r in reports] == [None] * 4
    assert router.turn_ids() == [None] * 4
    assert router.releases() == [] and router.keepalives() == []
