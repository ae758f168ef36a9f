"""KVTurnChatOpenAI on its own: clients, ids outside LangGraph, extra_body merging, reply
fidelity (tool-call arguments sent back verbatim) and the reuse report."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph

import kvturn
from kvturn_langgraph import KVTurnChatOpenAI
from tests.fakes.agent_clients import ModelFactory
from tests.fakes.router_api import BASE_URL
from tests.integrations._router import FakeRouter, breaks

Clients = tuple[kvturn.OpenAI, kvturn.AsyncOpenAI]


@tool
def search(q: str) -> str:
    """Search the web."""
    return f"found {q}"


def test_outside_langgraph_a_call_has_no_conversation_unless_metadata_names_a_thread(
        router: FakeRouter, model: KVTurnChatOpenAI) -> None:
    reply = model.invoke([HumanMessage("hi")])
    assert router.turn_ids() == [None]
    assert "conversation_id" not in router.turns()[0].body
    assert "kvturn" not in reply.response_metadata

    reply = model.invoke([HumanMessage("hi")], {"metadata": {"thread_id": "chat-9"}})
    assert router.turn_ids() == [None, "chat-9"]
    assert reply.response_metadata["kvturn"]["conversation_id"] == "chat-9"
    assert model.release("chat-9") and router.releases() == ["chat-9"]
    assert not model.release("chat-9")


def test_per_call_extra_body_merges_with_the_instance_one(router: FakeRouter,
                                                          make_model: ModelFactory) -> None:
    model = make_model(extra_body={"top_k": 3, "min_p": 0.0})
    model.invoke([HumanMessage("hi")], {"metadata": {"thread_id": "eb"}},
                 extra_body={"min_p": 0.1, "repetition_penalty": 1.1})
    body = router.turns()[0].body
    assert (body["top_k"], body["min_p"], body["repetition_penalty"]) == (3, 0.1, 1.1)
    assert body["conversation_id"] == "eb"
    model.invoke([HumanMessage("hi")])
    assert router.turns()[1].body["top_k"] == 3


async def test_async_calls_outside_langgraph(router: FakeRouter,
                                            model: KVTurnChatOpenAI) -> None:
    reply = await model.ainvoke([HumanMessage("hi")], {"metadata": {"thread_id": "a-9"}})
    history = [HumanMessage("hi"), reply, HumanMessage("and?")]
    chunks = [chunk async for chunk in model.astream(history,
                                                      {"metadata": {"thread_id": "a-9"}})]
    assert reply.response_metadata["kvturn"]["reuse"] == "miss"
    assert chunks[0].response_metadata["kvturn"]["reuse"] == "hit"
    assert breaks(router) == []
    assert router.turn_ids() == ["a-9", "a-9"]


def test_tool_call_arguments_go_back_verbatim_unless_edited(router: FakeRouter,
                                                            model: KVTurnChatOpenAI) -> None:
    bound = model.bind_tools([search])
    config: Any = {"metadata": {"thread_id": "args"}}
    history: list[Any] = [HumanMessage("find x")]
    reply = bound.invoke(history, config)
    assert isinstance(reply, AIMessage) and reply.tool_calls[0]["args"] == {"q": "search-1"}
    assert reply.response_metadata["kvturn"]["tool_arguments"] == {
        "call_1_0": '{"q":"search-1"}'}
    history += [reply, ToolMessage("found", tool_call_id="call_1_0")]
    bound.invoke(history, config)
    sent = router.turns()[1].body["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert sent == '{"q":"search-1"}'  # as the server wrote it, not json.dumps's '{"q": ...}'
    assert breaks(router) == []

    edited = reply.model_copy(update={"tool_calls": [{**reply.tool_calls[0],
                                                       "args": {"q": "other"}}]})
    bound.invoke([HumanMessage("find x"), edited, history[2]], config)
    sent = router.turns()[2].body["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert sent == '{"q": "other"}'
    assert breaks(router) == [(2, "history")]  # sent as edited: reuse stops at the edit
    assert "x-kvturn-no-reuse" not in router.turns()[2].headers


def test_streamed_arguments_are_kept_too(router: FakeRouter, model: KVTurnChatOpenAI) -> None:
    bound = model.bind_tools([search])
    chunks = list(bound.stream([HumanMessage("find x")], {"metadata": {"thread_id": "s"}}))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert merged.response_metadata["kvturn"]["tool_arguments"] == {
        "call_1_0": '{"q":"search-1"}'}
    assert merged.response_metadata["kvturn"]["conversation_id"] == "s"


def test_a_node_that_streams_the_model_itself(router: FakeRouter,
                                             model: KVTurnChatOpenAI) -> None:
    def agent(state: MessagesState) -> dict[str, Any]:
        merged = None
        for chunk in model.stream(state["messages"]):
            merged = chunk if merged is None else merged + chunk
        return {"messages": [merged]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    builder.compile().invoke({"messages": [HumanMessage("go")]},
                             {"configurable": {"thread_id": "self-stream"}})
    assert router.turn_ids() == ["self-stream"]
    assert router.releases() == ["self-stream"]


def test_clients_must_be_kvturn_clients(clients: Clients) -> None:
    with pytest.raises(TypeError, match=r"kvturn\.OpenAI"):
        KVTurnChatOpenAI(model="m", root_client=openai.OpenAI(base_url=BASE_URL, api_key="k"))
    with pytest.raises(ValueError, match="root_client"):
        KVTurnChatOpenAI(model="m", client=clients[0].chat.completions)


def test_clients_are_built_from_chat_openai_arguments() -> None:
    model = KVTurnChatOpenAI(model="m", base_url=BASE_URL, api_key="secret", timeout=7,
                             max_retries=4, keepalive_interval=5, default_headers={"X-A": "1"})
    sync = model.root_client._default
    assert isinstance(sync, kvturn.OpenAI)
    assert (str(sync.base_url), sync.api_key, sync.max_retries, sync.keepalive_interval) == (
        BASE_URL + "/", "secret", 4, 5)
    assert sync.timeout == 7
    assert isinstance(model.root_async_client._default, kvturn.AsyncOpenAI)
    copy = model.model_copy()
    assert copy.root_client is model.root_client
