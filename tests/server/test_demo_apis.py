"""``kvturn demo --api chat|responses|messages``: the flag reaches the demo, the LangGraph
agent talks Responses when asked, and the Messages agent (local/_demo_messages.py) runs the
forced-tool schedule over ``/v1/messages`` with the conversation header, measures each turn
and releases the conversation at the end."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2
import pytest

from kvturn_server.cli import build_parser
from kvturn_server.local import _demo
from kvturn_server.local._demo_messages import read_stream, run_messages_agent
from kvturn_server.local._metrics import PromptSources
from kvturn_server.local._stack import StackConfig

TOOLS = (("check_calendar", "Check the calendar.", "Free all May."),
         ("search_flights", "Search flights.", "KL1691 EUR 189."))
AGENT = SimpleNamespace(TOOLS=TOOLS, SYSTEM="Plan.", QUESTION="A trip?",
                        tool_manual=lambda n: f"manual x{n}")


def _sse(events: list[dict[str, Any]]) -> bytes:
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def _tool_use(name: str, number: int) -> list[dict[str, Any]]:
    return [{"type": "message_start", "message": {"id": f"m{number}"}},
            {"type": "content_block_start", "index": 0, "content_block": {
                "type": "tool_use", "id": f"toolu_{number}", "name": name, "input": {}}},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "input_json_delta", "partial_json": "{"}},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "input_json_delta", "partial_json": "}"}},
            {"type": "content_block_stop", "index": 0}, {"type": "message_stop"}]


def _text(text: str) -> list[dict[str, Any]]:
    return [{"type": "message_start", "message": {"id": "m"}},
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "text", "text": ""}},
            *({"type": "content_block_delta", "index": 0,
               "delta": {"type": "text_delta", "text": word}} for word in text.split("|")),
            {"type": "content_block_stop", "index": 0}, {"type": "message_stop"}]


def test_read_stream_assembles_text_and_tool_use_blocks() -> None:
    firsts: list[bool] = []
    lines = _sse(_tool_use("search_flights", 1)).decode().splitlines()
    assert read_stream(lines, lambda: firsts.append(True)) == [
        {"type": "tool_use", "id": "toolu_1", "name": "search_flights", "input": {}}]
    lines = _sse(_text("Lis|bon")).decode().splitlines()
    assert read_stream(lines, lambda: firsts.append(True)) == [{"type": "text",
                                                                  "text": "Lisbon"}]
    assert firsts == [True, True]  # one first token per turn


class MessagesRouter:
    def __init__(self) -> None:
        self.requests: list[httpx2.Request] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        if request.method == "DELETE":
            return httpx2.Response(200, json={"released": True})
        body = json.loads(request.content)
        turn = len([r for r in self.requests if r.method == "POST"])
        choice = body["tool_choice"]
        events = (_tool_use(choice["name"], turn) if choice["type"] == "tool"
                  else _text("We|go."))
        return httpx2.Response(200, content=_sse(events), headers={
            "content-type": "text/event-stream",
            "X-KVTurn-Reuse": "miss" if turn == 1 else "hit"})


@pytest.mark.parametrize("conversation", ["demo-on-1", None], ids=["on", "off"])
def test_the_messages_agent_runs_the_schedule_and_releases(conversation: str | None) -> None:
    router = MessagesRouter()
    calls: list[Any] = []
    run_messages_agent(AGENT, "http://router.test", "kvturn-tiny", 3,  # type: ignore[arg-type]
                       conversation=conversation, tool_latency=0.0, tag="t", manual=2,
                       start=lambda: calls.append("start"),
                       first_token=lambda: calls.append("first"),
                       end=lambda tool, reuse: calls.append((tool, reuse)),
                       transport=httpx2.MockTransport(router))

    assert calls == ["start", "first", ("check_calendar", "miss"),
                     "start", "first", ("search_flights", "hit"),
                     "start", "first", (None, "hit")]
    posts = [r for r in router.requests if r.method == "POST"]
    bodies = [json.loads(r.content) for r in posts]
    assert {r.url.path for r in posts} == {"/v1/messages"}
    assert [b["tool_choice"] for b in bodies] == [
        {"type": "tool", "name": "check_calendar"}, {"type": "tool", "name": "search_flights"},
        {"type": "auto"}]
    assert bodies[0]["system"] == "[t] Plan. manual x2"
    assert all(b["stream"] and b["temperature"] == 0 for b in bodies)
    # Each turn sends the previous one's reply back as received, then the tool's result.
    assert bodies[2]["messages"][1:] == [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "check_calendar", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "Free all May."}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2",
                                           "name": "search_flights", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                      "content": "KL1691 EUR 189."}]}]
    deletes = [r for r in router.requests if r.method == "DELETE"]
    if conversation is None:
        assert all("x-conversation-id" not in r.headers for r in posts)
        assert deletes == []
    else:
        assert {r.headers["x-conversation-id"] for r in posts} == {conversation}
        assert [r.url.path for r in deletes] == [f"/kvturn/v1/conversations/{conversation}"]


def test_the_cli_passes_the_api() -> None:
    parser = build_parser()
    assert parser.parse_args(["demo"]).api == "chat"
    assert parser.parse_args(["demo", "--api", "responses"]).api == "responses"
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--api", "completions"])


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_run_agents_talks_the_api_asked_for(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            api: Any) -> None:
    runs: list[tuple[str, Any]] = []

    def run_agent(base_url: str, model: str, turns: int, **kwargs: Any) -> None:
        runs.append(("langgraph", kwargs["use_responses_api"]))
        for callback in kwargs["callbacks"]:  # one measured model call
            callback.on_chat_model_start({}, [], run_id=None)
            message = SimpleNamespace(tool_calls=[], response_metadata={
                "kvturn": {"reuse": "hit"}})
            callback.on_llm_end(SimpleNamespace(generations=[[SimpleNamespace(
                message=message)]]), run_id=None)

    def messages_agent(agent: Any, root_url: str, model: str, turns: int,
                       **kwargs: Any) -> None:
        runs.append(("messages", kwargs["conversation"]))
        kwargs["start"]()
        kwargs["end"](None, "hit" if kwargs["conversation"] else None)

    monkeypatch.setattr(_demo, "load_agent", lambda: SimpleNamespace(
        TOOLS=TOOLS, run_agent=run_agent))
    monkeypatch.setattr(_demo, "run_messages_agent", messages_agent)
    monkeypatch.setattr(_demo, "prompt_sources", lambda url: PromptSources(0, 0, 0))
    cfg = StackConfig(state_dir=tmp_path)
    reports = _demo.run_agents(cfg, 2, 0.0, api)

    assert [(r.mode, r.turn) for r in reports] == [("off", 1), ("on", 1)]
    if api == "messages":
        assert [kind for kind, _ in runs] == ["messages"] * 3
        assert runs[0][1] is None and runs[1][1] is None  # warm-up and off: no conversation
        assert runs[2][1] is not None and runs[2][1].startswith("demo-on-")
        assert [r.reuse for r in reports] == ["-", "hit"]
    else:
        assert runs == [("langgraph", True if api == "responses" else None)] * 3
