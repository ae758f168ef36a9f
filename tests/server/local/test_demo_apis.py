"""``kvturn demo``'s runs (local/_demo.py, _demo_router.py, _demo_messages.py): every mode
through its router (the stock modes through a stock router started beside the stack's, kvturn
through the stack's), warm-ups first, a fresh prompt per run; ``--api chat|responses|messages``
reaches the agents; the Messages agent runs the forced-tool schedule over ``/v1/messages`` with
the conversation header, measures each turn, and only kvturn's client releases."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2
import pytest

from kvturn_server._control_secret import ENV, ENV_FILE
from kvturn_server.cli import build_parser
from kvturn_server.local import _demo
from kvturn_server.local._demo_messages import read_stream, run_messages_agent
from kvturn_server.local._demo_report import STOCK_ROUTER_ARGS, TurnReport
from kvturn_server.local._demo_router import stock_router_spec
from kvturn_server.local._metrics import PromptSources
from kvturn_server.local._secret import SECRET_FILE
from kvturn_server.local._stack_config import StackConfig

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


@pytest.mark.parametrize(("conversation", "release"),
                         [("demo-kvturn-1", True), ("demo-stock-cond-1", False), (None, False)],
                         ids=["kvturn", "stock-cond", "stock-pd"])
def test_the_messages_agent_runs_the_schedule_and_releases(conversation: str | None,
                                                           release: bool) -> None:
    router = MessagesRouter()
    calls: list[Any] = []
    run_messages_agent(AGENT, "http://router.test", "kvturn-tiny", 3,  # type: ignore[arg-type]
                       conversation=conversation, release=release, tool_latency=0.0, tag="t",
                       manual=2, start=lambda: calls.append("start"),
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
    else:
        assert {r.headers["x-conversation-id"] for r in posts} == {conversation}
    # Only kvturn's client releases; a stock client sends the header and nothing else.
    assert [r.url.path for r in deletes] == (
        [f"/kvturn/v1/conversations/{conversation}"] if release else [])


def test_the_cli_passes_the_api() -> None:
    parser = build_parser()
    assert parser.parse_args(["demo"]).api == "chat"
    assert parser.parse_args(["demo", "--api", "responses"]).api == "responses"
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--api", "completions"])


STOCK_URL = "http://127.0.0.1:9999"


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_run_agents_runs_every_mode_through_its_router(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path, api: Any) -> None:
    runs: list[dict[str, Any]] = []

    def run_agent(base_url: str, model: str, turns: int, **kwargs: Any) -> None:
        runs.append({"url": base_url, "turns": turns, "plain": kwargs["plain"],
                     "manual": kwargs["manual"],
                     "header": kwargs["conversation_header"], "tag": kwargs["tag"],
                     "thread": kwargs["thread_id"], "responses": kwargs["use_responses_api"],
                     "measured": bool(kwargs["callbacks"])})
        for callback in kwargs["callbacks"]:  # one measured model call
            callback.on_chat_model_start({}, [], run_id=None)
            message = SimpleNamespace(tool_calls=[], response_metadata={
                "kvturn": {"reuse": "hit"}})
            callback.on_llm_end(SimpleNamespace(generations=[[SimpleNamespace(
                message=message)]]), run_id=None)

    def messages_agent(agent: Any, root_url: str, model: str, turns: int,
                       **kwargs: Any) -> None:
        runs.append({"url": root_url, "turns": turns, "conversation": kwargs["conversation"],
                     "manual": kwargs["manual"],
                     "release": kwargs["release"], "tag": kwargs["tag"],
                     "measured": kwargs["start"] is not _demo._ignore})
        kwargs["start"]()
        # What the stock router sends a stock client (its reuse is "disabled"): not shown.
        kwargs["end"](None, "hit" if kwargs["release"] else "disabled")

    monkeypatch.setattr(_demo, "load_agent", lambda: SimpleNamespace(
        TOOLS=TOOLS, run_agent=run_agent))
    monkeypatch.setattr(_demo, "run_messages_agent", messages_agent)
    monkeypatch.setattr(_demo, "prompt_sources", lambda url: PromptSources(0, 0, 0))
    cfg = StackConfig(state_dir=tmp_path)
    reports = _demo.run_agents(cfg, STOCK_URL, 2, 0.0, api)

    assert [(r.mode, r.turn) for r in reports] == [("stock-pd", 1), ("stock-cond", 1),
                                                   ("kvturn", 1)]
    assert [r.reuse for r in reports] == ["-", "-", "hit"]  # stock clients read no report
    # Warm-ups first (stock P/D through the whole schedule, two turns of each other mode),
    # then each mode measured, in the same order.
    assert [r["measured"] for r in runs] == [False] * 3 + [True] * 3
    assert [r["turns"] for r in runs] == [len(TOOLS) + 1, 2, 2, 2, 2, 2]
    suffix = "" if api == "messages" else "/v1"
    urls = [STOCK_URL + suffix, STOCK_URL + suffix, cfg.router_url + suffix]
    assert [r["url"] for r in runs] == urls * 2
    # A tag of its own per run (no mode finds another's prompt in any cache), differing in
    # one digit only (every mode's prompts have the same number of tokens).
    tags = [r["tag"] for r in runs]
    assert len(set(tags)) == len(tags) == 6
    assert len({t[:-1] for t in tags}) == 1 and [t[-1] for t in tags] == list("123456")
    assert all(r["manual"] == _demo.MANUAL_SECTIONS for r in runs)  # warm-ups full size too
    if api == "messages":
        assert [r["conversation"] for r in runs[3:]] == [None, tags[4], tags[5]]
        assert [r["release"] for r in runs[3:]] == [False, False, True]
    else:
        assert [(r["plain"], r["header"]) for r in runs[3:]] == [
            (True, False), (True, True), (False, False)]
        assert [r["thread"] for r in runs] == tags
        assert {r["responses"] for r in runs} == {True if api == "responses" else None}


def test_the_stock_router_runs_on_the_stacks_instances(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    cfg = StackConfig(state_dir=tmp_path, prefill_port=8100, decode_port=8200,
                      decode_control_port=8201)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(ENV_FILE, raising=False)
    spec = stock_router_spec(cfg, STOCK_ROUTER_ARGS, 12345)
    argv = list(spec.argv)
    assert argv[argv.index("--prefill") + 1] == "http://127.0.0.1:8100"
    assert argv[argv.index("--decode") + 1] == ("http://127.0.0.1:8200,"
                                                "control=http://127.0.0.1:8201")
    assert argv[-3:] == ["--no-kv-reuse", "--conditional-disagg", "512"]
    assert spec.health_url == "http://127.0.0.1:12345/health"
    assert ENV_FILE not in spec.env  # no secret anywhere: none to pass
    # A stack started from another shell: the router reads its secret from its state dir.
    (tmp_path / SECRET_FILE).write_text("s" * 32 + "\n")
    assert stock_router_spec(cfg, (), 12345).env[ENV_FILE] == str(tmp_path / SECRET_FILE)
    # A secret in this process's environment (a stack the demo started) is inherited.
    monkeypatch.setenv(ENV, "t" * 32)
    assert ENV_FILE not in stock_router_spec(cfg, (), 12345).env


def test_run_demo_runs_the_agents_beside_a_stock_router(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str],
                                                        ) -> None:
    started: list[tuple[str, ...]] = []
    got: list[str] = []

    @contextmanager
    def stock_router(cfg: StackConfig, args: tuple[str, ...]) -> Iterator[str]:
        started.append(args)
        yield STOCK_URL
        started.append(("stopped",))

    def run_agents(cfg: StackConfig, stock_url: str, turns: int, tool_latency: float,
                   api: str) -> list[Any]:
        got.append(stock_url)
        assert started == [STOCK_ROUTER_ARGS]  # running while the agents run
        none = PromptSources(0, 0, 0)
        return [TurnReport(mode, 1, None, 10, 100.0, 150.0, "-", none, none)
                for mode in ("stock-pd", "stock-cond", "kvturn")]

    running = SimpleNamespace(config=StackConfig(state_dir=tmp_path))
    monkeypatch.setattr(_demo, "load_agent", lambda: None)
    monkeypatch.setattr(_demo, "read_running", lambda state_dir: running)
    monkeypatch.setattr(_demo, "stock_router", stock_router)
    monkeypatch.setattr(_demo, "run_agents", run_agents)
    assert _demo.run_demo(StackConfig(state_dir=tmp_path), plot=tmp_path / "p.png") == 0
    assert got == [STOCK_URL] and started[-1] == ("stopped",)
    out = capsys.readouterr().out
    assert "conditional-disagg 512" in out and "stock-cond" in out
    assert (tmp_path / "p.png").stat().st_size > 0
