"""``kvturn_agents`` over the fake router: a Runner run of the OpenAI Agents SDK is one kvturn
conversation on both of the SDK's OpenAI models (Chat Completions and Responses, plain and
streamed): every model call carries the run's id, turns after the first reuse, the lease is
renewed while the run's tools execute and released when the run ends (also when it fails);
``provider.conversation()`` lends one conversation to the runs of an SDK Session."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest
from agents import (
    Agent,
    ModelSettings,
    RunConfig,
    Runner,
    SQLiteSession,
    UserError,
    function_tool,
)
from agents.models import _run_context
from agents.models.interface import Model, ModelTracing

import kvturn
from kvturn_agents import KVTurnModel, KVTurnModelProvider
from tests.fakes.agent_clients import KEEPALIVE
from tests.fakes.router_api import BASE_URL
from tests.integrations._router import FakeRouter, breaks

APIS = ["chat", "responses"]
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}


@pytest.fixture
async def client(router: FakeRouter) -> AsyncIterator[kvturn.AsyncOpenAI]:
    aio = kvturn.AsyncOpenAI(base_url=BASE_URL, api_key="tenant", keepalive_interval=KEEPALIVE,
                             http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(
                                 router)), max_retries=0)
    yield aio
    await aio.close()


class Turns:
    """``on_turn``: each answered model call's (conversation id, reuse outcome)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []

    def __call__(self, conversation: kvturn.AsyncConversation) -> None:
        turn = conversation.last_turn
        self.seen.append((conversation.id, None if turn is None else turn.reuse))


def _agent(tools: list[Any], name: str = "planner") -> Agent[Any]:
    return Agent(name=name, instructions="Plan carefully.", tools=tools, model="kvturn-tiny")


def _heartbeats() -> list[str]:
    return [t.get_name() for t in asyncio.all_tasks()
            if t.get_name().startswith("kvturn-keepalive:") and not t.done()]


async def _run(agent: Agent[Any], provider: KVTurnModelProvider, text: str, *,
               stream: bool, **kwargs: Any) -> Any:
    config = RunConfig(model_provider=provider, tracing_disabled=True)
    if not stream:
        return await Runner.run(agent, text, run_config=config, **kwargs)
    result = Runner.run_streamed(agent, text, run_config=config, **kwargs)
    async for _ in result.stream_events():
        pass
    return result


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("api", APIS)
async def test_a_run_is_one_conversation_kept_alive_by_its_tools_and_released(
        router: FakeRouter, client: kvturn.AsyncOpenAI, api: Any, stream: bool) -> None:
    turns = Turns()
    provider = KVTurnModelProvider(client, api=api, on_turn=turns)
    renewed: list[bool] = []

    @function_tool
    async def lookup(aisle: str) -> str:
        """Count the boxes in one aisle."""
        # The tool runs between two turns: the run's conversation is being kept alive.
        [conversation] = {c for c, _ in turns.seen}
        renewed.append(await asyncio.to_thread(
            router.wait_for, lambda: bool(router.keepalives(conversation))))
        return "30 boxes"

    result = await _run(_agent([lookup]), provider, "Count aisle 3.", stream=stream)

    assert result.final_output == "final answer 3"
    assert [r.path for r in router.turns()] == [PATHS[api]] * 3
    [conversation] = {r.conversation for r in router.turns()}
    assert conversation is not None and conversation.startswith("kvt-")
    assert turns.seen == [(conversation, "miss"), (conversation, "hit"), (conversation, "hit")]
    assert renewed == [True, True]
    # The run's end released its conversation and stopped the keepalive.
    assert router.releases() == [conversation]
    assert _heartbeats() == []


async def test_each_run_gets_its_own_conversation(router: FakeRouter,
                                                  client: kvturn.AsyncOpenAI) -> None:
    router.tool_rounds = 0
    provider = KVTurnModelProvider(client)
    await _run(_agent([]), provider, "one", stream=False)
    await _run(_agent([]), provider, "two", stream=False)
    first, second = router.turn_ids()
    assert first != second
    assert router.releases() == [first, second]


@pytest.mark.parametrize("api", APIS)
async def test_a_failed_run_still_releases(router: FakeRouter, client: kvturn.AsyncOpenAI,
                                           api: Any) -> None:
    provider = KVTurnModelProvider(client, api=api)

    @function_tool(failure_error_function=None)
    def lookup(aisle: str) -> str:
        """Count the boxes in one aisle."""
        raise RuntimeError("the warehouse is closed")

    with pytest.raises(Exception, match="warehouse is closed"):
        await _run(_agent([lookup]), provider, "Count aisle 3.", stream=False)
    [conversation] = set(router.turn_ids())
    assert router.releases() == [conversation]
    assert _heartbeats() == []


@pytest.mark.parametrize("api", APIS)
async def test_a_session_scope_shares_one_conversation_across_runs(
        router: FakeRouter, client: kvturn.AsyncOpenAI, api: Any) -> None:
    router.tool_rounds = 1
    turns = Turns()
    provider = KVTurnModelProvider(client, api=api, on_turn=turns)

    @function_tool
    def lookup(aisle: str) -> str:
        """Count the boxes in one aisle."""
        return "30 boxes"

    session = SQLiteSession("trip-7")
    agent = _agent([lookup])
    async with provider.conversation("trip-7") as conversation:
        assert conversation.id == "trip-7"
        await _run(agent, provider, "Count aisle 3.", stream=False, session=session)
        assert router.releases() == []  # the scope holds it between the user's messages
        await _run(agent, provider, "Now aisle 4.", stream=True, session=session)
    assert turns.seen == [("trip-7", "miss")] + [("trip-7", "hit")] * 3
    # The second run's first turn extends the first run's last, exactly.
    assert breaks(router) == []
    assert router.releases() == ["trip-7"]


async def test_an_agent_run_as_a_tool_gets_its_own_conversation(
        router: FakeRouter, client: kvturn.AsyncOpenAI) -> None:
    router.tool_rounds = 1
    provider = KVTurnModelProvider(client)
    helper = _agent([], name="helper").as_tool(tool_name="helper",
                                                tool_description="Ask the helper.")
    # The nested run starts while the outer one holds the scope.
    async with provider.conversation("outer"):
        await _run(_agent([helper]), provider, "Ask the helper.", stream=False)
    ids = router.turn_ids()
    assert ids[0] == ids[-1] == "outer"
    [inner] = set(ids) - {"outer"}
    assert inner is not None and inner.startswith("kvt-")
    assert router.releases() == [inner, "outer"]


async def test_a_call_outside_a_run_is_a_conversation_of_its_own(
        router: FakeRouter, client: kvturn.AsyncOpenAI) -> None:
    router.tool_rounds = 0
    model = KVTurnModelProvider(client).get_model("kvturn-tiny")
    assert isinstance(model, KVTurnModel)
    await model.get_response(None, "hi", ModelSettings(), [], None, [], ModelTracing.DISABLED,
                             previous_response_id=None, conversation_id=None, prompt=None)
    [conversation] = router.turn_ids()
    assert router.releases() == [conversation]


def test_models_and_arguments(client: kvturn.AsyncOpenAI) -> None:
    provider = KVTurnModelProvider(client, model="kvturn-tiny")
    assert provider.get_model(None) is provider.get_model("kvturn-tiny")
    with pytest.raises(UserError, match="names no model"):
        KVTurnModelProvider(client).get_model(None)
    with pytest.raises(ValueError, match="'chat' or 'responses'"):
        KVTurnModelProvider(client, api="messages")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"kvturn\.AsyncOpenAI"):
        KVTurnModelProvider(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a conversation"):
        KVTurnModelProvider(client.conversation("c"))


def test_canary_the_sdk_internals_used() -> None:
    """kvturn_agents relies on two private hooks of openai-agents 0.24: the run owner of the
    model call executing now, and the run-end cleanup every resolved model gets."""
    assert callable(_run_context.get_model_run_owner)
    assert _run_context.get_model_run_owner() is None
    assert "owner" in Model._cleanup_on_run_end.__code__.co_varnames
