"""The Responses and Messages APIs through the real stack: 6-turn tool conversations.

A second router over the session's prefill and decode runs with the defaults a user gets
(decode continuation on), as in test_placement.py. Odd turns force a tool call (vLLM's
structured outputs make the tiny model emit one), even turns answer the tool's result in text;
turn 1 runs the prefill path, turns 2-5 are continued by the decode that holds the
conversation, and turn 6 brings a tool result too long to continue, so a prefill leg reads
from the decode what its own cache lacks. Every answer is held to the plain reference instance
answering the same API with the full history (what ``previous_response_id`` stands for).

Responses answers carry logprobs (``include``) and are compared with ``_greedy``; Messages
answers carry none in vLLM 0.32, so a Messages answer must equal the reference's exactly (a
near-tie would fail it with the reference's text beside it, not pass it).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

from kvturn_server.local import Stack
from kvturn_server.local._process import stop_group

from ._greedy import TOP, assert_same_text
from ._helpers import Delta, start_router

MAX_TOKENS = 24
TOOL_TOKENS = 64  # a whole <tool_call>...</tool_call> of the tiny model's, or it is no call
INSTRUCTIONS = "You are a careful stock agent. " + " ".join(
    f"Aisle {i} holds part {i}; use the lookup tool for counts." for i in range(30))
LOOKUP = {"name": "lookup", "description": "Count the boxes in one aisle.",
          # An enum: the tiny model's digits would otherwise run on past any token limit.
          "schema": {"type": "object", "properties": {"aisle": {"enum": [3, 4, 5]}},
                     "required": ["aisle"], "additionalProperties": False}}
TASKS = ["Count aisle 3.", "Now count aisle 4.", "Then aisle 5."]


@pytest.fixture(scope="module")
def router_url(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("apis-router")
    url, proc = start_router(stack.config, "apis-router", logs)
    try:
        yield url
    finally:
        stop_group(proc.pid)


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
          ) -> httpx2.Response:
    resp = httpx2.post(url, json=body, headers=headers or {}, timeout=120.0)
    assert resp.status_code == 200, resp.text
    return resp


def _tool_result(turn: int) -> str:
    if turn < 6:
        return f"{10 * turn} boxes."
    # Past decode_continue_tokens (2,048): this turn takes a prefill leg.
    return "Boxes: " + " ".join(f"box {i} ok." for i in range(800))


def _check_reuse(turn: int, headers: httpx2.Headers, p: Delta, cached: int | None) -> None:
    """``cached``: the decode's usage, what its own cache supplied (its cached tokens)."""
    if turn == 1:
        assert headers["x-kvturn-route"] == "prefill", headers
        return
    if turn < 6:
        assert headers["x-kvturn-route"] == "decode", (turn, headers)
        assert p.value is not None and p.value.computed == 0, p.value
        # A continued turn reports what the decode's cache supplied; a stream's headers are
        # sent before that is known ("pending"), and its usage says it.
        assert cached is not None and cached > 0, (turn, cached)
        if headers["x-kvturn-reuse"] == "pending":
            assert headers["x-kvturn-reused-tokens"] == "0", headers
        else:
            assert headers["x-kvturn-reuse"] in ("hit", "partial"), (turn, headers)
            assert int(headers["x-kvturn-reused-tokens"]) == cached, (turn, headers)
        return
    assert headers["x-kvturn-reuse"] in ("hit", "partial"), (turn, headers)
    assert headers["x-kvturn-route"] == "prefill", headers
    reused = int(headers["x-kvturn-reused-tokens"])
    assert p.value is not None and reused > 0 and reused == p.value.transferred, \
        (reused, p.value)


# Responses.

def _response_reference(item: dict[str, Any]) -> dict[str, Any]:
    """A Responses output message as the chat-shaped reference ``assert_same_text`` reads."""
    [part] = item["content"]
    entries = [{"token": e["token"], "logprob": e["logprob"],
                "top_logprobs": e.get("top_logprobs") or []} for e in part.get("logprobs")
               or []]
    return {"choices": [{"message": {"content": part["text"]},
                         "logprobs": {"content": entries}}]}


def _same_output(got: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    assert [i["type"] for i in got] == [i["type"] for i in reference], (got, reference)
    for mine, theirs in zip(got, reference, strict=True):
        if mine["type"] == "message":
            [part] = mine["content"]
            assert_same_text(part["text"], _response_reference(theirs), None,
                             [(e["token"], e["logprob"]) for e in part.get("logprobs") or []])
        elif mine["type"] == "function_call":
            assert mine["name"] == theirs["name"]
            # Structured arguments carry no logprobs: they must equal the reference's.
            assert_same_text(mine["arguments"], {"choices": [{"message": {
                "content": theirs["arguments"]}}]})


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_responses_tool_conversation_by_previous_response_id(
        stack: Stack, router_url: str, stream: bool) -> None:
    cfg = stack.config
    tag = uuid.uuid4().hex
    tool = {"type": "function", "name": LOOKUP["name"], "description": LOOKUP["description"],
            "parameters": LOOKUP["schema"]}
    common = {"model": cfg.served_model_name, "instructions": f"{tag}. {INSTRUCTIONS}",
              "tools": [tool], "temperature": 0, "max_output_tokens": MAX_TOKENS,
              "include": ["message.output_text.logprobs"], "top_logprobs": TOP}
    history: list[dict[str, Any]] = []  # what the reference is given: the whole chain
    previous: str | None = None
    call_id: str | None = None
    conversation: str | None = None
    for turn in range(1, 7):
        if turn % 2:
            new: list[dict[str, Any]] = [{"role": "user", "content": TASKS[turn // 2]}]
            choice: Any = {"type": "function", "name": "lookup"}
        else:
            assert call_id is not None
            new = [{"type": "function_call_output", "call_id": call_id,
                    "output": _tool_result(turn)}]
            choice = "none"
        if turn == 6:
            new.append({"role": "user", "content": "Sum them up."})
        history.extend(new)
        limit = TOOL_TOKENS if turn % 2 else MAX_TOKENS
        reference = _post(f"{cfg.reference_url}/v1/responses", {
            **common, "input": history, "tool_choice": choice, "store": False,
            "max_output_tokens": limit}).json()
        body = {**common, "input": new, "tool_choice": choice, "max_output_tokens": limit}
        if previous is not None:
            body["previous_response_id"] = previous
        with Delta(cfg.prefill_url) as p:
            if stream:
                resp = _post(f"{router_url}/v1/responses", {**body, "stream": True})
                events = [line for line in resp.text.split("\n") if line.startswith("data: ")]
                final = httpx2.Response(200, content=events[-1][6:]).json()
                assert final["type"] == "response.completed", final
                answer = final["response"]
            else:
                resp = _post(f"{router_url}/v1/responses", body)
                answer = resp.json()
        assert "kv_transfer_params" not in resp.text
        _same_output(answer["output"], reference["output"])
        _check_reuse(turn, resp.headers, p,
                     answer["usage"]["input_tokens_details"]["cached_tokens"])
        if conversation is None:
            conversation = resp.headers["x-kvturn-conversation"]
        assert resp.headers["x-kvturn-conversation"] == conversation
        calls = [i for i in answer["output"] if i["type"] == "function_call"]
        if turn % 2:
            assert calls, answer["output"]
            call_id = calls[0]["call_id"]
        history.extend(answer["output"])
        previous = answer["id"]


# Messages.

def _same_content(got: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    assert [b["type"] for b in got] == [b["type"] for b in reference], (got, reference)
    for mine, theirs in zip(got, reference, strict=True):
        if mine["type"] == "text":
            assert_same_text(mine["text"], {"choices": [{"message": {
                "content": theirs["text"]}}]})
        elif mine["type"] == "tool_use":
            assert mine["name"] == theirs["name"]
            assert_same_text(repr(mine["input"]), {"choices": [{"message": {
                "content": repr(theirs["input"])}}]})


def test_messages_tool_conversation(stack: Stack, router_url: str) -> None:
    cfg = stack.config
    tag = uuid.uuid4().hex
    tool = {"name": LOOKUP["name"], "description": LOOKUP["description"],
            "input_schema": LOOKUP["schema"]}
    common = {"model": cfg.served_model_name, "system": f"{tag}. {INSTRUCTIONS}",
              "tools": [tool], "temperature": 0, "max_tokens": MAX_TOKENS}
    messages: list[dict[str, Any]] = []
    tool_use: str | None = None
    conversation = f"messages-{tag}"
    for turn in range(1, 7):
        if turn % 2:
            content: Any = TASKS[turn // 2]
            choice: Any = {"type": "tool", "name": "lookup"}
        else:
            assert tool_use is not None
            content = [{"type": "tool_result", "tool_use_id": tool_use,
                        "content": _tool_result(turn)}]
            choice = {"type": "none"}
        if turn == 6:
            content.append({"type": "text", "text": "Sum them up."})
        messages.append({"role": "user", "content": content})
        body = {**common, "messages": messages, "tool_choice": choice,
                "max_tokens": TOOL_TOKENS if turn % 2 else MAX_TOKENS}
        reference = _post(f"{cfg.reference_url}/v1/messages", body).json()
        with Delta(cfg.prefill_url) as p:
            resp = _post(f"{router_url}/v1/messages", body,
                         headers={"X-Conversation-ID": conversation})
        answer = resp.json()
        assert "kv_transfer_params" not in answer
        _same_content(answer["content"], reference["content"])
        _check_reuse(turn, resp.headers, p, answer["usage"].get("cache_read_input_tokens"))
        uses = [b for b in answer["content"] if b["type"] == "tool_use"]
        if turn % 2:
            assert uses, answer["content"]
            tool_use = uses[0]["id"]
        messages.append({"role": "assistant", "content": answer["content"]})
