"""``KVTurnChatOpenAI(use_responses_api=True)``: calls go to ``/v1/responses`` with the
thread's conversation, sync and async, and report the router's reuse."""

from __future__ import annotations

from typing import Any

import httpx2
from langchain_core.messages import HumanMessage

import kvturn
from kvturn_langgraph import KVTurnChatOpenAI
from tests.fakes.router_api import BASE_URL


class ResponsesRouter:
    """Answers ``/v1/responses`` like the router (and ``/kvturn/v1`` releases)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        if request.url.path.startswith("/kvturn/v1/conversations/"):
            return httpx2.Response(200, json={"released": True})
        assert request.url.path == "/v1/responses", request.url.path
        body = httpx2.Response(200, content=request.content).json()
        self.bodies.append(body)
        turn = len(self.bodies)
        return httpx2.Response(200, headers={
            "X-KVTurn-Reuse": "miss" if turn == 1 else "hit",
            "X-KVTurn-Reused-Tokens": "0" if turn == 1 else "128",
            "X-KVTurn-Route": "prefill",
            "X-KVTurn-Conversation": str(body.get("conversation_id"))}, json={
            "id": f"resp_{turn}", "object": "response", "created_at": 0, "model": "m",
            "status": "completed", "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "output": [{"type": "message", "id": f"msg_{turn}",
                                     "role": "assistant", "status": "completed",
                                     "content": [{"type": "output_text", "text": "ok",
                                                  "annotations": []}]}],
            "usage": {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}})


def _model(router: ResponsesRouter) -> KVTurnChatOpenAI:
    transport = httpx2.MockTransport(router)
    sync = kvturn.OpenAI(base_url=BASE_URL, api_key="t", max_retries=0,
                         http_client=httpx2.Client(transport=transport))
    aio = kvturn.AsyncOpenAI(base_url=BASE_URL, api_key="t", max_retries=0,
                             http_client=httpx2.AsyncClient(transport=transport))
    return KVTurnChatOpenAI(model="m", root_client=sync, root_async_client=aio,
                            use_responses_api=True)


def test_responses_calls_carry_the_thread_conversation() -> None:
    router = ResponsesRouter()
    model = _model(router)
    config: Any = {"metadata": {"thread_id": "resp-thread"}}
    first = model.invoke([HumanMessage("hi")], config)
    second = model.invoke([HumanMessage("hi"), first, HumanMessage("more")], config)
    assert [b["conversation_id"] for b in router.bodies] == ["resp-thread", "resp-thread"]
    assert second.text == "ok"
    assert second.response_metadata["kvturn"]["reuse"] == "hit"
    assert second.response_metadata["kvturn"]["conversation_id"] == "resp-thread"


async def test_async_responses_calls_carry_the_thread_conversation() -> None:
    router = ResponsesRouter()
    model = _model(router)
    config: Any = {"metadata": {"thread_id": "resp-async"}}
    reply = await model.ainvoke([HumanMessage("hi")], config)
    assert router.bodies[0]["conversation_id"] == "resp-async"
    assert reply.response_metadata["kvturn"]["reuse"] == "miss"
