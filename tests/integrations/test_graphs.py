"""The integration end to end over a fake router: conversation ids, forks, keepalive and
release for create_agent, a StateGraph + ToolNode loop, subgraphs, Send branches, tools that
call the model, streaming, async, interrupts and a resume in "another process".

Nothing sleeps and hopes: keepalive intervals are 10 ms, and a tool that must see its lease
renewed waits for the router to have received a keepalive (with a timeout).
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Callable
from typing import Annotated, Any, TypedDict

import httpx2
import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware, wrap_model_call
from langchain_core.messages import AIMessage, AIMessageChunk, AnyMessage, HumanMessage
from langchain_core.tools import BaseTool, tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import tools_condition
from langgraph.types import Command, Send, interrupt

import kvturn
from kvturn_langgraph import (
    KVTurnChatOpenAI,
    KVTurnMiddleware,
    KVTurnToolNode,
    LeasePolicy,
    current_conversation,
    kvturn_node,
)
from tests.fakes.agent_clients import ModelFactory
from tests.fakes.router_api import BASE_URL
from tests.integrations._router import FakeRouter, breaks

Clients = tuple[kvturn.OpenAI, kvturn.AsyncOpenAI]


@tool
def search(q: str) -> str:
    """Search the web."""
    return f"found {q}"


def renewal_tool(router: FakeRouter, conversation: str) -> BaseTool:
    """A tool that only returns once the router has seen the conversation's lease renewed."""

    @tool
    def slow_lookup(q: str) -> str:
        """Look something up (slowly)."""
        renewed = router.wait_for(lambda: bool(router.keepalives(conversation)), timeout=5)
        return "renewed" if renewed else "lease not renewed"

    return slow_lookup


def arenewal_tool(router: FakeRouter, conversation: str) -> BaseTool:
    @tool
    async def slow_lookup(q: str) -> str:
        """Look something up (slowly)."""
        renewed = await until(lambda: bool(router.keepalives(conversation)))
        return "renewed" if renewed else "lease not renewed"

    return slow_lookup


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Wait for ``predicate`` without blocking the event loop (background work must run)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.001)
    return True


def thread(name: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": name}}


def tool_loop(model: Any, tools: list[BaseTool], **compile_kwargs: Any) -> Any:
    """A hand-written agent: model node, KVTurnToolNode, back to the model."""
    bound = model.bind_tools(tools)

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [bound.invoke(state["messages"])]}

    async def aagent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent, afunc=aagent)  # type: ignore[call-overload]
    builder.add_node("tools", KVTurnToolNode(tools))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(**compile_kwargs)


def assert_extends(router: FakeRouter) -> None:
    """Every chat turn extended its conversation's previous one exactly (``breaks``)."""
    assert breaks(router) == []


# --- create_agent ------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True], ids=["invoke", "stream-messages"])
def test_create_agent_with_tools(router: FakeRouter, model: KVTurnChatOpenAI,
                                 streamed: bool) -> None:
    agent = create_agent(model, [renewal_tool(router, "trip-1")],
                         middleware=[KVTurnMiddleware()], checkpointer=InMemorySaver())
    inputs = {"messages": [HumanMessage("Plan my trip")]}
    if streamed:
        chunks = [chunk for chunk, _ in agent.stream(inputs, thread("trip-1"),
                                                     stream_mode="messages")]
        assert any(isinstance(chunk, AIMessageChunk) and chunk.tool_call_chunks
                   for chunk in chunks)
        messages = agent.get_state(thread("trip-1")).values["messages"]
    else:
        messages = agent.invoke(inputs, thread("trip-1"))["messages"]

    assert router.turn_ids() == ["trip-1"] * 3
    assert all(turn.body["conversation_id"] == "trip-1" for turn in router.turns())
    assert [turn.body.get("stream", False) for turn in router.turns()] == [streamed] * 3
    assert_extends(router)
    replies = [m for m in messages if isinstance(m, AIMessage)]
    assert [m.response_metadata["kvturn"]["reuse"] for m in replies] == ["miss", "hit", "hit"]
    assert [m.content for m in messages if m.type == "tool"] == ["renewed", "renewed"]
    # The tool-call arguments went back exactly as the server wrote them (compact JSON).
    sent = router.turns()[2].body["messages"]
    assert [call["function"]["arguments"] for m in sent for call in m.get("tool_calls", ())] \
        == ['{"q":"slow_lookup-1"}', '{"q":"slow_lookup-2"}']
    assert router.releases() == ["trip-1"]


def test_middleware_with_a_plain_chat_openai(router: FakeRouter, clients: Clients) -> None:
    transport = httpx2.MockTransport(router)
    plain = ChatOpenAI(model="kvturn-tiny", base_url=BASE_URL, api_key="tenant",
                       http_client=httpx2.Client(transport=transport),
                       extra_body={"top_k": 5})
    per_call = wrap_model_call(lambda request, handler: handler(
        request.override(model_settings={"extra_body": {"min_p": 0.2}})))
    agent = create_agent(plain, [renewal_tool(router, "plain-1")],
                         middleware=[per_call, KVTurnMiddleware(client=clients[0],
                                                                async_client=clients[1])])
    agent.invoke({"messages": [HumanMessage("hi")]}, thread("plain-1"))

    turns = router.turns()
    assert [turn.body["conversation_id"] for turn in turns] == ["plain-1"] * 3
    # the model's extra_body and the per-call one, merged (ChatOpenAI would keep only one)
    assert [(turn.body["top_k"], turn.body["min_p"]) for turn in turns] == [(5, 0.2)] * 3
    assert router.keepalives("plain-1") and router.releases() == ["plain-1"]


# --- StateGraph + ToolNode, streaming, async ---------------------------------------------------


def test_state_graph_tool_node_loop_streams(router: FakeRouter,
                                            model: KVTurnChatOpenAI) -> None:
    graph = tool_loop(model, [renewal_tool(router, "loop-1")], checkpointer=InMemorySaver())
    chunks = list(graph.stream({"messages": [HumanMessage("go")]}, thread("loop-1"),
                               stream_mode="messages"))
    assert chunks
    state = graph.get_state(thread("loop-1")).values["messages"]
    assert [m.content for m in state if m.type == "tool"] == ["renewed", "renewed"]
    assert router.turn_ids() == ["loop-1"] * 3
    assert all(turn.body["stream"] for turn in router.turns())
    assert_extends(router)
    assert router.releases() == ["loop-1"]


async def test_async_invoke_and_astream(router: FakeRouter, model: KVTurnChatOpenAI) -> None:
    agent = create_agent(model, [arenewal_tool(router, "async-1")],
                         middleware=[KVTurnMiddleware()])
    result = await agent.ainvoke({"messages": [HumanMessage("hi")]}, thread("async-1"))
    assert [m.content for m in result["messages"] if m.type == "tool"] == ["renewed"] * 2
    assert await until(lambda: router.releases() == ["async-1"])

    graph = tool_loop(model, [arenewal_tool(router, "async-2")])
    chunks = [chunk async for chunk in graph.astream({"messages": [HumanMessage("hi")]},
                                                     thread("async-2"), stream_mode="messages")]
    assert chunks
    assert router.turn_ids() == ["async-1"] * 3 + ["async-2"] * 3
    assert_extends(router)
    assert await until(lambda: router.releases() == ["async-1", "async-2"])


# --- subgraphs and parallel branches ------------------------------------------------------------


def test_a_subgraph_gets_a_fork_and_is_released_with_its_thread(
        router: FakeRouter, model: KVTurnChatOpenAI) -> None:
    research = tool_loop(model, [search])

    def plan(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("plan", plan)
    builder.add_node("research", research)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "research")
    builder.compile().invoke({"messages": [HumanMessage("go")]}, thread("sub-1"))

    assert router.turn_ids() == ["sub-1"] + ["sub-1/research"] * 3
    assert set(router.releases()) == {"sub-1", "sub-1/research"}


class FanOut(TypedDict):
    topics: list[str]
    summaries: Annotated[list[str], operator.add]


def test_send_branches_get_forked_ids(router: FakeRouter, model: KVTurnChatOpenAI) -> None:
    seen: list[str | None] = []

    def summarize(state: dict[str, Any]) -> dict[str, Any]:
        reply = model.invoke([HumanMessage(f"summarize {state['topic']}")])
        seen.append(reply.response_metadata["kvturn"]["conversation_id"])
        return {"summaries": [str(reply.content)]}

    builder = StateGraph(FanOut)
    builder.add_node("summarize", summarize)
    builder.add_conditional_edges(
        START, lambda state: [Send("summarize", {"topic": t}) for t in state["topics"]])
    builder.add_edge("summarize", END)
    builder.compile().invoke({"topics": ["a", "b", "c"], "summaries": []}, thread("fan-1"))

    expected = {"fan-1/summarize:0", "fan-1/summarize:1", "fan-1/summarize:2"}
    assert set(router.turn_ids()) == set(seen) == expected
    assert set(router.releases()) == expected


def test_subgraphs_started_by_send_get_one_fork_each(router: FakeRouter,
                                                     model: KVTurnChatOpenAI) -> None:
    research = tool_loop(model, [search])

    builder = StateGraph(MessagesState)
    builder.add_node("research", research)
    builder.add_conditional_edges(START, lambda state: [
        Send("research", {"messages": [HumanMessage(topic)]}) for topic in ("a", "b")])
    builder.add_edge("research", END)
    builder.compile().invoke({"messages": []}, thread("sends-1"))

    ids = router.turn_ids()
    assert sorted(ids) == ["sends-1/research:0"] * 3 + ["sends-1/research:1"] * 3
    assert_extends(router)  # each branch is one linear sequence
    assert set(router.releases()) == {"sends-1/research:0", "sends-1/research:1"}


def test_tools_that_call_the_model_get_forks(router: FakeRouter,
                                             model: KVTurnChatOpenAI) -> None:
    router.parallel = 2
    router.tool_rounds = 1

    @tool
    def ask_expert(q: str) -> str:
        """Ask a sub-agent."""
        return str(model.invoke([HumanMessage(q)]).content)

    @tool
    def ask_critic(q: str) -> str:
        """Ask another sub-agent."""
        return str(model.invoke([HumanMessage(q)]).content)

    graph = tool_loop(model, [ask_expert, ask_critic])
    graph.invoke({"messages": [HumanMessage("go")]}, thread("par-1"))

    ids = router.turn_ids()
    assert ids[0] == ids[-1] == "par-1"
    assert sorted(ids[1:-1]) == ["par-1/call_1_0", "par-1/call_1_1"]
    assert set(router.releases()) == {"par-1", "par-1/call_1_0", "par-1/call_1_1"}


# --- node wrapper, raw SDK nodes -----------------------------------------------------------------


def test_node_wrapper_forks_and_pauses(router: FakeRouter, model: KVTurnChatOpenAI) -> None:
    def critic(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    def run_tools(state: MessagesState) -> dict[str, Any]:
        renewed = router.wait_for(lambda: bool(router.keepalives("node-1/critic")))
        return {"messages": [HumanMessage("renewed" if renewed else "not renewed")]}

    builder = StateGraph(MessagesState)
    builder.add_node("critic", kvturn_node(critic, fork="critic"))
    builder.add_node("run_tools", kvturn_node(fork="critic", pause="bench")(run_tools))
    builder.add_edge(START, "critic")
    builder.add_edge("critic", "run_tools")
    result = builder.compile().invoke({"messages": [HumanMessage("go")]}, thread("node-1"))

    assert result["messages"][-1].content == "renewed"
    assert router.turn_ids() == ["node-1/critic"]
    assert router.releases() == ["node-1/critic"]


def test_raw_sdk_nodes_get_their_conversation(router: FakeRouter, clients: Clients) -> None:
    sync = clients[0]

    def agent(state: MessagesState) -> dict[str, Any]:
        chat = current_conversation(sync)
        assert chat is not None
        reply = chat.chat.completions.create(model="kvturn-tiny", messages=[
            {"role": "user", "content": str(state["messages"][-1].content)}])
        return {"messages": [AIMessage(reply.choices[0].message.content or "")]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    builder.compile().invoke({"messages": [HumanMessage("go")]}, thread("raw-1"))
    assert router.turn_ids() == ["raw-1"]
    assert router.releases() == ["raw-1"]


# --- lifecycle: fallback ids, policies, interrupts, resume --------------------------------------


def test_without_thread_id_each_invoke_is_one_conversation(router: FakeRouter,
                                                           model: KVTurnChatOpenAI) -> None:
    graph = tool_loop(model, [search])
    graph.invoke({"messages": [HumanMessage("a")]})
    graph.invoke({"messages": [HumanMessage("b")]})

    ids = router.turn_ids()
    first, second = ids[0], ids[3]
    assert ids == [first] * 3 + [second] * 3 and first != second
    assert first is not None and first.startswith("kvt-") and len(first) == 36
    assert router.releases() == [first, second]


def test_keep_policy_leaves_the_lease_and_the_next_run_reuses(
        router: FakeRouter, make_model: ModelFactory) -> None:
    model = make_model(policy=LeasePolicy(on_end="keep"))
    graph = tool_loop(model, [search], checkpointer=InMemorySaver())
    graph.invoke({"messages": [HumanMessage("a")]}, thread("keep-1"))
    graph.invoke({"messages": [HumanMessage("b")]}, thread("keep-1"))

    assert router.releases() == []
    assert router.turn_ids() == ["keep-1"] * 6
    assert_extends(router)  # the second run's first turn extends the first run's last
    assert [t.conversation for t in router.turns()] == ["keep-1"] * 6
    assert model.release("keep-1") and router.releases() == ["keep-1"]


class Approval(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def approval_graph(model: KVTurnChatOpenAI, saver: InMemorySaver) -> Any:
    """model → human approval (interrupt) → model."""

    def agent(state: Approval) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    def approve(state: Approval) -> dict[str, Any]:
        answer = interrupt("approve?")
        return {"messages": [HumanMessage(f"human says {answer}")]}

    builder = StateGraph(Approval)
    builder.add_node("draft", agent)
    builder.add_node("approve", approve)
    builder.add_node("final", agent)
    builder.add_edge(START, "draft")
    builder.add_edge("draft", "approve")
    builder.add_edge("approve", "final")
    return builder.compile(checkpointer=saver)


def test_interrupt_holds_the_lease_and_a_new_process_resumes_it(
        router: FakeRouter, make_model: ModelFactory) -> None:
    saver = InMemorySaver()
    first = make_model()
    paused = approval_graph(first, saver).invoke({"messages": [HumanMessage("draft it")]},
                                                 thread("hitl-1"))
    assert "__interrupt__" in paused
    # Held: the lease is renewed while the human thinks, and not released.
    assert router.wait_for(lambda: len(router.keepalives("hitl-1")) >= 2)
    assert router.releases() == []

    # "Another process": new clients, new model, new graph; same checkpointer and thread.
    resumed = approval_graph(make_model(new_clients=True), saver).invoke(
        Command(resume="yes"), thread("hitl-1"))
    final = resumed["messages"][-1]
    assert final.response_metadata["kvturn"] == {
        "conversation_id": "hitl-1", "reuse": "hit", "reused_tokens": final.response_metadata[
            "kvturn"]["reused_tokens"], "no_reuse_reason": None, "attempts": 1}
    assert router.turn_ids() == ["hitl-1", "hitl-1"]
    hold = first._kvturn.holding("hitl-1")
    assert hold is None  # the thread resumed: the first process's hold stopped
    assert "hitl-1" in router.releases()


def test_interrupt_release_policy(router: FakeRouter, make_model: ModelFactory) -> None:
    model = make_model(policy=LeasePolicy(on_interrupt="release"))
    approval_graph(model, InMemorySaver()).invoke({"messages": [HumanMessage("x")]},
                                                  thread("hitl-2"))
    assert router.releases() == ["hitl-2"]
    assert router.keepalives("hitl-2") == []


def test_hold_stops_after_max_hold(router: FakeRouter, make_model: ModelFactory) -> None:
    model = make_model(policy=LeasePolicy(max_hold=0.05))
    approval_graph(model, InMemorySaver()).invoke({"messages": [HumanMessage("x")]},
                                                  thread("hitl-3"))
    hold = model._kvturn.holding("hitl-3")
    assert hold is not None and hold.join(timeout=5)
    assert 1 <= len(router.keepalives("hitl-3")) <= 5


def test_hold_retries_a_failed_renewal_and_ends_when_the_router_holds_nothing(
        router: FakeRouter, make_model: ModelFactory) -> None:
    model = make_model()
    approval_graph(model, InMemorySaver()).invoke({"messages": [HumanMessage("x")]},
                                                  thread("hitl-4"))
    hold = model._kvturn.holding("hitl-4")
    assert hold is not None
    router.keepalive_status = 503
    failed = len(router.keepalives("hitl-4"))
    assert router.wait_for(lambda: len(router.keepalives("hitl-4")) >= failed + 2)
    router.keepalive_status = 404
    assert hold.join(timeout=5)
    assert router.releases() == []


def test_human_in_the_loop_agent_holds_then_resumes_elsewhere(
        router: FakeRouter, make_model: ModelFactory) -> None:
    saver = InMemorySaver()
    router.tool_rounds = 1

    def agent(model: KVTurnChatOpenAI) -> Any:
        return create_agent(model, [search], checkpointer=saver, middleware=[
            KVTurnMiddleware(), HumanInTheLoopMiddleware(interrupt_on={"search": True})])

    paused = agent(make_model()).invoke({"messages": [HumanMessage("look it up")]},
                                        thread("hitl-agent"))
    assert "__interrupt__" in paused
    assert router.wait_for(lambda: len(router.keepalives("hitl-agent")) >= 2)
    assert router.releases() == []

    resumed = agent(make_model(new_clients=True)).invoke(
        Command(resume={"decisions": [{"type": "approve"}]}), thread("hitl-agent"))
    assert [m.content for m in resumed["messages"] if m.type == "tool"] == ["found search-1"]
    assert router.turn_ids() == ["hitl-agent"] * 2
    assert resumed["messages"][-1].response_metadata["kvturn"]["reuse"] == "hit"
    assert_extends(router)
    assert "hitl-agent" in router.releases()


def test_a_failed_run_releases_too(router: FakeRouter, model: KVTurnChatOpenAI) -> None:
    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    def broken(state: MessagesState) -> dict[str, Any]:
        raise RuntimeError("tool exploded")

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("broken", broken)
    builder.add_edge(START, "agent")
    builder.add_edge("agent", "broken")
    with pytest.raises(RuntimeError, match="exploded"):
        builder.compile().invoke({"messages": [HumanMessage("go")]}, thread("fail-1"))
    assert router.releases() == ["fail-1"]
