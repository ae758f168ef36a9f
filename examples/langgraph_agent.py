"""A LangGraph tool-calling agent through the kvturn router.

``langchain.agents.create_agent`` with ``KVTurnChatOpenAI`` and ``KVTurnMiddleware``: the
thread is one kvturn conversation, so every model turn after the first reuses the KV the
decode retained from the turn before; the tools (which take a while, like real ones) keep the
lease alive; the end of the run releases it. The model is made to call a tool on every turn but
the last (``tool_choice`` names the tool: the local test model is random-weight gibberish and
only calls tools when forced; vLLM's structured output keeps the call valid JSON), then it
answers. Per turn it prints the router's reuse outcome, the reused prompt tokens and the time
to the first streamed token.

Start the local stack first (``.venv/bin/kvturn up``), then::

    .venv/bin/python examples/langgraph_agent.py
    .venv/bin/python examples/langgraph_agent.py --turns 8 --tool-latency 0.5
    .venv/bin/python examples/langgraph_agent.py --plain --base-url http://127.0.0.1:8300/v1

``--plain`` runs the same graph with a stock ``ChatOpenAI`` (no kvturn): against a plain vLLM
it gives the reference outputs. ``--plain --conversation-header`` is the stock client of stock
conditional disaggregation (llm-d, NVIDIA Dynamo; ``kvturn router --no-kv-reuse
--conditional-disagg 512``): the thread id as ``X-Conversation-ID`` on every request, nothing
else. As a library: ``run_agent(base_url, model, turns)`` returns one ``TurnReport`` per model
turn.

Environment: ``KVTURN_BASE_URL``, ``KVTURN_MODEL``, ``OPENAI_API_KEY`` (flags win).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import httpx2
import openai
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import BaseTool, StructuredTool
from langchain_openai import ChatOpenAI

import kvturn
from kvturn_langgraph import KVTurnChatOpenAI, KVTurnMiddleware

# The agent's tools, in the order the turns force them. They take no arguments: a forced call
# then generates exactly "{}", whatever the model, so that the plain run (whose ChatOpenAI
# re-serialises arguments with json.dumps) and the kvturn run (which sends them back as
# generated) send the very same prompts, and their outputs can be compared token for token.
TOOLS: tuple[tuple[str, str, str], ...] = (
    ("check_calendar", "Check the traveller's calendar for free days.",
     "Free from 12 to 19 May; a dentist appointment on the 15th at 09:00."),
    ("search_flights", "Search flights from Amsterdam to Lisbon for the free days.",
     "KL1691 12 May 07:05-09:40 EUR 189; TP669 12 May 11:20-13:55 EUR 142."),
    ("check_weather", "Get the weather forecast for Lisbon.",
     "Lisbon 12-19 May: sunny, 22-26 C, light wind from the north."),
    ("search_hotels", "Search hotels in Lisbon's centre for the stay.",
     "Hotel Avenida EUR 118/night, 4.4 stars; Casa do Largo EUR 96/night, 4.6 stars."),
    ("check_budget", "Check the remaining travel budget.",
     "Budget EUR 1,400; spent EUR 0; per-diem allowance EUR 60."),
)
SYSTEM = (
    "You are a meticulous travel-planning agent. Work step by step: check the calendar, find "
    "flights, check the weather, find a hotel and check the budget before you answer. "
    + " ".join(f"Rule {i}: write down step {i} and its result before moving on." for i in
               range(1, 41)))
QUESTION = "Plan a one-week trip to Lisbon in May for me and book nothing yet."


@dataclass(frozen=True)
class TurnReport:
    """One model turn of the agent."""

    turn: int
    tool: str | None
    """The tool the turn was made to call; None for the final answer."""
    output: str
    """The tool call's arguments (canonical JSON) or the answer's text."""
    reuse: str | None
    """``X-KVTurn-Reuse`` (None without the kvturn router: a plain run)."""
    reused_tokens: int
    ttft: float | None
    """Seconds from the request to its first streamed token (content or tool call)."""
    conversation_id: str | None


def make_tools(latency: float | Sequence[float]) -> list[BaseTool]:
    """The agent's tools; each sleeps ``latency`` seconds (per tool, or one value for all)."""
    delays = [latency] * len(TOOLS) if isinstance(latency, int | float) else list(latency)

    def tool(name: str, description: str, result: str, delay: float) -> BaseTool:
        def run() -> str:
            time.sleep(delay)
            return result

        run.__name__ = name
        # additionalProperties false: structured output may then generate nothing but "{}".
        return StructuredTool.from_function(run, name=name, description=description,
                                            args_schema={"type": "object", "properties": {},
                                                         "additionalProperties": False})

    return [tool(name, description, result, delays[i % len(delays)])
            for i, (name, description, result) in enumerate(TOOLS)]


class ForcedToolSchedule(AgentMiddleware):
    """Model turn ``k`` (0-based) must call ``TOOLS[k % 5]``; the last turn is left to the
    server (``auto``: the test model, never choosing a tool itself, answers)."""

    def __init__(self, turns: int) -> None:
        super().__init__()
        self.tools = []
        self.turns = turns

    def _scheduled(self, request: ModelRequest) -> ModelRequest:
        done = sum(isinstance(m, AIMessage) for m in request.messages)
        if done < self.turns - 1:
            return request.override(tool_choice=TOOLS[done % len(TOOLS)][0])
        return request

    def wrap_model_call(self, request: ModelRequest,
                        handler: Callable[[ModelRequest], ModelResponse],
                        ) -> ModelResponse:
        return handler(self._scheduled(request))


class FirstToken(BaseCallbackHandler):
    """Time from each model request to its first streamed token (text or tool call)."""

    def __init__(self) -> None:
        self.started: dict[UUID, float] = {}
        self.ttft: list[float | None] = []
        self._index: dict[UUID, int] = {}

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: UUID,
                            **kwargs: Any) -> None:
        self.started[run_id] = time.perf_counter()
        self._index[run_id] = len(self.ttft)
        self.ttft.append(None)

    def on_llm_new_token(self, token: Any, *, chunk: Any = None, run_id: UUID,
                         **kwargs: Any) -> None:
        index = self._index.get(run_id)
        if index is None or self.ttft[index] is not None:
            return
        message = getattr(chunk, "message", None)
        if token or getattr(message, "tool_call_chunks", None):
            self.ttft[index] = time.perf_counter() - self.started[run_id]


def tool_manual(sections: int) -> str:
    """A long, deterministic tool manual (about 32 tokens a section), like the tool
    documentation a real agent's system prompt carries."""
    return " ".join(f"Tool manual section {i}: describe the inputs, outputs and errors of step "
                    f"{i}." for i in range(1, sections + 1))


def build_agent(model: ChatOpenAI, *, turns: int, tool_latency: float | Sequence[float] = 0.2,
                with_kvturn: bool = True, tag: str = "", manual: int = 0) -> Any:
    """The agent graph: ``create_agent`` with the forced-tool schedule, plus kvturn's
    middleware (tool-call keepalive, release at the end) unless ``with_kvturn`` is False.
    ``tag`` starts the system prompt and ``manual`` sections of ``tool_manual`` end it (see
    ``run_agent``)."""
    middleware: list[AgentMiddleware] = [ForcedToolSchedule(turns)]
    if with_kvturn:
        middleware.append(KVTurnMiddleware())
    system = f"[{tag}] {SYSTEM}" if tag else SYSTEM
    if manual:
        system = f"{system} {tool_manual(manual)}"
    return create_agent(model, make_tools(tool_latency), system_prompt=system,
                        middleware=middleware)


def run_agent(base_url: str, model: str = "kvturn-tiny", turns: int = 6, *,
              api_key: str = "unused-locally", thread_id: str | None = None,
              plain: bool = False, tool_latency: float | Sequence[float] = 0.2,
              max_tokens: int = 140, keepalive_interval: float = 60.0, tag: str = "",
              timeout: float = 120.0, http_client: httpx2.Client | None = None,
              callbacks: Sequence[BaseCallbackHandler] = (), manual: int = 0,
              use_responses_api: bool | None = None,
              conversation_header: bool = False) -> list[TurnReport]:
    """Run the agent for ``turns`` model turns (all but the last forced to call a tool) on
    thread ``thread_id`` (default: a new one) and report each turn. Streams the model
    (``stream_mode="messages"``), greedy (``temperature=0``), ``max_tokens`` per turn.

    ``plain``: a stock ``ChatOpenAI`` and no kvturn middleware (reference runs against a plain
    vLLM). ``tool_latency``: seconds each tool takes, one value or one per tool in ``TOOLS``
    order (turn ``k`` calls ``TOOLS[k % 5]``). ``tag`` starts the system prompt: runs with
    different tags share no prefix in any cache, runs with the same tag send the same prompts.
    ``keepalive_interval``: seconds between lease renewals while a tool runs.
    ``http_client``: the HTTP client to use (tests pass one with a mock transport).
    ``callbacks``: more LangChain callback handlers for the run (the demo measures with one).
    ``manual``: sections of tool manual appended to the system prompt (about 32 tokens each).
    ``use_responses_api``: True: the model talks ``/v1/responses`` (default: ChatOpenAI's own).
    ``conversation_header``: with ``plain``, the stock ``ChatOpenAI`` sends the thread id as
    ``X-Conversation-ID`` on every request (a default header) and nothing else: what a stock
    router with conditional disaggregation needs (kvturn's client sends it itself).
    """
    if turns < 1:
        raise ValueError(f"turns must be at least 1, got {turns}")
    if conversation_header and not plain:
        raise ValueError("conversation_header is for plain runs: KVTurnChatOpenAI sends the "
                         "conversation itself")
    thread_id = thread_id or uuid.uuid4().hex
    common: dict[str, Any] = {"model": model, "temperature": 0, "max_tokens": max_tokens,
                              "base_url": base_url, "api_key": api_key, "timeout": timeout,
                              "max_retries": 1, "http_client": http_client,
                              "use_responses_api": use_responses_api}
    if conversation_header:
        common["default_headers"] = {"X-Conversation-ID": thread_id}
    llm = (ChatOpenAI(**common) if plain
           else KVTurnChatOpenAI(keepalive_interval=keepalive_interval, **common))
    agent = build_agent(llm, turns=turns, tool_latency=tool_latency, with_kvturn=not plain,
                        tag=tag, manual=manual)
    timer = FirstToken()
    config: dict[str, Any] = {"configurable": {"thread_id": thread_id},
                              "callbacks": [timer, *callbacks],
                              "recursion_limit": 4 * turns + 10}
    final: dict[str, Any] = {}
    inputs = {"messages": [HumanMessage(QUESTION)]}
    for mode, chunk in agent.stream(inputs, config, stream_mode=["messages", "values"]):
        if mode == "values":
            final = chunk
    replies = [m for m in final.get("messages", ()) if isinstance(m, AIMessage)]
    reports = []
    for number, (reply, ttft) in enumerate(zip(replies, timer.ttft, strict=False), start=1):
        info = reply.response_metadata.get("kvturn") or {}
        if reply.tool_calls:
            call = reply.tool_calls[0]
            tool, output = call["name"], json.dumps(call["args"], sort_keys=True)
        else:
            tool, output = None, str(reply.content)
        reports.append(TurnReport(number, tool, output, info.get("reuse"),
                                  int(info.get("reused_tokens") or 0), ttft,
                                  info.get("conversation_id")))
    return reports


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--base-url", default=os.environ.get("KVTURN_BASE_URL",
                                                             "http://127.0.0.1:8000/v1"),
                        help="the router's OpenAI base URL (default: %(default)s)")
    parser.add_argument("--model", default=os.environ.get("KVTURN_MODEL", "kvturn-tiny"),
                        help="served model name (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused-locally"),
                        help="sent as the bearer token; the router scopes conversations by it")
    parser.add_argument("--turns", type=int, default=6,
                        help="model turns, all but the last forced to call a tool "
                             "(default: %(default)s)")
    parser.add_argument("--tool-latency", type=float, default=0.2,
                        help="seconds each tool takes (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=140,
                        help="tokens per model turn (default: %(default)s)")
    parser.add_argument("--thread-id", default=None, help="LangGraph thread (default: new)")
    parser.add_argument("--plain", action="store_true",
                        help="stock ChatOpenAI, no kvturn (a reference run on plain vLLM)")
    parser.add_argument("--conversation-header", action="store_true",
                        help="with --plain: send the thread id as X-Conversation-ID on every "
                             "request, as stock conditional disaggregation needs (kvturn "
                             "router --no-kv-reuse --conditional-disagg 512)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.conversation_header and not args.plain:
        print("error: --conversation-header goes with --plain (kvturn's client sends the "
              "conversation itself)", file=sys.stderr)
        return 2
    try:  # fail fast, with a clear message, when nothing is there
        kvturn.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0,
                      timeout=10).models.list()
    except openai.APIConnectionError:
        print(f"error: nothing answers at {args.base_url}. Start the local stack with "
              "`.venv/bin/kvturn up`, or pass --base-url / set KVTURN_BASE_URL.",
              file=sys.stderr)
        return 2
    except openai.APIStatusError as error:
        print(f"error: {args.base_url} answered {error.status_code}: {error.message}",
              file=sys.stderr)
        return 2

    thread_id = args.thread_id or f"agent-{uuid.uuid4().hex[:12]}"
    print(f"thread {thread_id} on {args.base_url} ({args.model}), {args.turns} model turns"
          f"{' (plain ChatOpenAI)' if args.plain else ''}"
          f"{', X-Conversation-ID on every request' if args.conversation_header else ''}")
    try:
        reports = run_agent(args.base_url, args.model, args.turns, api_key=args.api_key,
                            thread_id=thread_id, plain=args.plain,
                            tool_latency=args.tool_latency, max_tokens=args.max_tokens,
                            conversation_header=args.conversation_header)
    except openai.OpenAIError as error:
        print(f"error: the agent failed: {error}", file=sys.stderr)
        return 1
    for report in reports:
        ttft = f"{report.ttft * 1000:7.1f} ms" if report.ttft is not None else "      - ms"
        what = f"-> {report.tool}({report.output})" if report.tool else repr(report.output[:60])
        print(f"turn {report.turn}: reuse={report.reuse or 'unreported':<15} "
              f"reused_tokens={report.reused_tokens:>6}  TTFT {ttft}  | {what}")
    reused = [r for r in reports[1:] if r.reuse in ("hit", "partial")]
    print(f"{len(reports)} turns, {len(reused)} of {max(len(reports) - 1, 0)} after the first "
          f"reused, {sum(r.reused_tokens for r in reports)} prompt tokens reused")
    if not args.plain:
        print(f"released conversation {thread_id} at the end of the run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
