"""An OpenAI Agents SDK agent through the kvturn router.

``Runner.run`` with ``kvturn_agents.KVTurnModelProvider``: each run is one kvturn
conversation, and with an SDK ``Session`` the runs of one session share one
(``provider.conversation(session_id)``), so every model turn after the first reuses the KV
the decode retained from the turn before; the tools (which take a while, like real ones) keep
the lease alive; the end releases it. Each user message is one run: its first model turn is
made to call a tool (``tool_choice`` names it: the local test model is random-weight gibberish
and calls tools only when forced; vLLM's structured output keeps the call valid JSON), then
the SDK resets ``tool_choice`` and the model answers. Per model turn it prints the router's
reuse outcome, the reused prompt tokens and the time to the first streamed token.

Start the local stack first (``.venv/bin/kvturn up``), then::

    .venv/bin/python examples/openai_agents_sdk.py
    .venv/bin/python examples/openai_agents_sdk.py --api responses --runs 3
    .venv/bin/python examples/openai_agents_sdk.py --plain --base-url http://127.0.0.1:8300/v1

``--plain`` runs the same agent on the SDK's stock OpenAI provider (no kvturn): against a plain
vLLM it gives the reference outputs. As a library: ``run_agent(base_url, model, runs)``
returns one ``TurnReport`` per model turn.

Environment: ``KVTURN_BASE_URL``, ``KVTURN_MODEL``, ``OPENAI_API_KEY`` (flags win).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx2
import openai
from agents import (
    Agent,
    FunctionTool,
    ModelProvider,
    ModelResponse,
    ModelSettings,
    OpenAIProvider,
    RunConfig,
    RunContextWrapper,
    RunHooks,
    Runner,
    SQLiteSession,
    function_tool,
)
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage

import kvturn
from kvturn_agents import KVTurnModelProvider

# The agent's tools, one per user message in this order. They take no arguments: a forced
# call then generates exactly "{}", so the plain and the kvturn run send the same prompts.
TOOLS: tuple[tuple[str, str, str], ...] = (
    ("check_stock", "Count the boxes the warehouse holds for the spring order.",
     "Aisle 3: 40 boxes; aisle 4: 12 boxes; aisle 5: none."),
    ("check_orders", "List the customer orders that are still open.",
     "Order 118: 20 boxes to Porto; order 121: 30 boxes to Braga."),
    ("check_trucks", "List the trucks free this week.",
     "Truck A (24 boxes) free Tuesday; truck B (36 boxes) free Thursday."),
)
QUESTIONS = ("How much stock do we hold for the spring order?",
             "Which orders are still open?", "Which trucks can take them?")
SYSTEM = ("You are a careful warehouse agent. Check the facts with your tools before you "
          "answer, and answer in one short sentence. "
          + " ".join(f"Rule {i}: write down step {i} and its result before moving on." for i
                     in range(1, 41)))
Api = Literal["chat", "responses"]
Logprob = tuple[str, float, tuple[tuple[str, float], ...]]


@dataclass(frozen=True)
class TurnReport:
    """One model turn of the agent."""

    turn: int
    run: int
    """The user message (``Runner.run``) the turn belongs to, from 1."""
    tool: str | None
    """The tool the turn called; None for an answer."""
    output: str
    """The tool call's arguments, as generated, or the answer's text."""
    logprobs: tuple[Logprob, ...]
    """The answer's (token, logprob, top alternatives), when asked for."""
    reuse: str | None
    """``X-KVTurn-Reuse`` (None without the kvturn router: a plain run)."""
    reused_tokens: int
    ttft: float | None
    """Seconds from the model call to its first streamed token (text or tool call)."""
    conversation_id: str | None


@dataclass
class Recorder(RunHooks[Any]):
    """Reports each model turn: ``on_turn`` (kvturn's report) runs when the call ends, just
    before the SDK's ``on_llm_end``; the stream reader marks the first token."""

    on_call: Callable[[TurnReport | None], None] | None = None
    run: int = 0
    reports: list[TurnReport] = field(default_factory=list)
    started: float = 0.0
    first: float | None = None
    kvturn: tuple[str, kvturn.TurnInfo | None] | None = None

    def on_turn(self, conversation: kvturn.AsyncConversation) -> None:
        self.kvturn = (conversation.id, conversation.last_turn)

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    async def on_llm_start(self, context: RunContextWrapper[Any], agent: Agent[Any],
                           system_prompt: str | None, input_items: list[Any]) -> None:
        if self.on_call is not None:
            self.on_call(None)
        self.started, self.first, self.kvturn = time.perf_counter(), None, None

    async def on_llm_end(self, context: RunContextWrapper[Any], agent: Agent[Any],
                         response: ModelResponse) -> None:
        calls = [i for i in response.output if isinstance(i, ResponseFunctionToolCall)]
        texts = [p for i in response.output if isinstance(i, ResponseOutputMessage)
                 for p in i.content if p.type == "output_text"]
        logprobs: tuple[Logprob, ...] = ()
        if calls:
            tool, output = calls[0].name, calls[0].arguments
        else:
            tool, output = None, "".join(p.text for p in texts)
            logprobs = tuple((e.token, e.logprob, tuple((t.token, t.logprob)
                                                        for t in e.top_logprobs))
                             for p in texts for e in p.logprobs or ())
        conversation, info = self.kvturn or (None, None)
        self.reports.append(TurnReport(
            len(self.reports) + 1, self.run, tool, output, logprobs,
            None if info is None else info.reuse, 0 if info is None else info.reused_tokens,
            None if self.first is None else self.first - self.started, conversation))
        if self.on_call is not None:
            self.on_call(self.reports[-1])


def make_tools(latency: float) -> list[FunctionTool]:
    def tool(name: str, description: str, result: str) -> FunctionTool:
        async def run() -> str:
            await asyncio.sleep(latency)
            return result

        return function_tool(run, name_override=name, description_override=description)

    return [tool(*spec) for spec in TOOLS]


_FIRST_TOKEN = ("response.output_text.delta", "response.function_call_arguments.delta")


async def arun_agent(base_url: str, model: str = "kvturn-tiny", runs: int = 2, *,
                     api: Api = "chat", api_key: str = "unused-locally",
                     session_id: str | None = None, plain: bool = False,
                     tool_latency: float = 0.2, max_tokens: int = 48,
                     logprobs: int | None = None, keepalive_interval: float = 60.0,
                     tag: str = "", timeout: float = 120.0,
                     http_client: httpx2.AsyncClient | None = None,
                     on_call: Callable[[TurnReport | None], None] | None = None,
                     ) -> list[TurnReport]:
    """Run ``runs`` user messages (``QUESTIONS`` in order, one ``Runner.run_streamed`` each)
    on one SDK session, greedy (``temperature=0``), ``max_tokens`` per model turn, and report
    each model turn. ``api``: the SDK model (``"chat"``: Chat Completions, ``"responses"``).

    ``plain``: the SDK's stock OpenAI provider, no kvturn (reference runs against a plain
    vLLM). ``tag`` starts the system prompt: runs with different tags share no prefix in any
    cache, runs with the same tag send the same prompts. ``logprobs``: top alternatives to ask
    for per answer token (the e2e test compares answers with them). ``on_call(phase)``: called
    with ``"start"`` and ``"end"`` around each model call (the demo measures with it).
    """
    if not 1 <= runs <= len(QUESTIONS):
        raise ValueError(f"runs must be 1 to {len(QUESTIONS)}, got {runs}")
    session_id = session_id or f"agent-{uuid.uuid4().hex[:12]}"
    recorder = Recorder(on_call=on_call)
    provider: ModelProvider
    if plain:
        client: openai.AsyncOpenAI = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, timeout=timeout, max_retries=1,
            http_client=http_client)
        provider = OpenAIProvider(openai_client=client, use_responses=api == "responses")
    else:
        client = kvturn.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout,
                                    max_retries=1, keepalive_interval=keepalive_interval,
                                    http_client=http_client)
        provider = KVTurnModelProvider(client, api=api, on_turn=recorder.on_turn)
    config = RunConfig(model_provider=provider, tracing_disabled=True)
    session = SQLiteSession(session_id)
    system = f"[{tag}] {SYSTEM}" if tag else SYSTEM
    tools = make_tools(tool_latency)

    async def ask(run: int) -> None:
        recorder.run = run + 1
        settings = ModelSettings(tool_choice=TOOLS[run][0], temperature=0,
                                 max_tokens=max_tokens, top_logprobs=logprobs)
        agent = Agent(name="warehouse", instructions=system, tools=tools, model=model,
                      model_settings=settings)
        result = Runner.run_streamed(agent, QUESTIONS[run], session=session,
                                     run_config=config, hooks=recorder)
        async for event in result.stream_events():
            kind = getattr(getattr(event, "data", None), "type", None)
            if kind in _FIRST_TOKEN:
                recorder.token()

    try:
        if isinstance(provider, KVTurnModelProvider):
            async with provider.conversation(session_id):
                for run in range(runs):
                    await ask(run)
        else:
            for run in range(runs):
                await ask(run)
    finally:
        if http_client is None:
            await client.close()
    return recorder.reports


def run_agent(base_url: str, model: str = "kvturn-tiny", runs: int = 2,
              **kwargs: Any) -> list[TurnReport]:
    """``arun_agent`` from synchronous code."""
    return asyncio.run(arun_agent(base_url, model, runs, **kwargs))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--base-url", default=os.environ.get("KVTURN_BASE_URL",
                                                             "http://127.0.0.1:8000/v1"),
                        help="the router's OpenAI base URL (default: %(default)s)")
    parser.add_argument("--model", default=os.environ.get("KVTURN_MODEL", "kvturn-tiny"),
                        help="served model name (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused-locally"),
                        help="sent as the bearer token; the router scopes conversations by it")
    parser.add_argument("--api", choices=("chat", "responses"), default="chat",
                        help="the SDK model: Chat Completions or Responses "
                             "(default: %(default)s)")
    parser.add_argument("--runs", type=int, default=2,
                        help=f"user messages, one Runner run each, two model turns each "
                             f"(1-{len(QUESTIONS)}, default: %(default)s)")
    parser.add_argument("--tool-latency", type=float, default=0.2,
                        help="seconds each tool takes (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=48,
                        help="tokens per model turn (default: %(default)s)")
    parser.add_argument("--session-id", default=None, help="SDK session (default: new)")
    parser.add_argument("--plain", action="store_true",
                        help="the SDK's stock OpenAI provider, no kvturn (a reference run)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # fail fast, with a clear message, when nothing is there
        openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0,
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
    session_id = args.session_id or f"agent-{uuid.uuid4().hex[:12]}"
    print(f"session {session_id} on {args.base_url} ({args.model}, {args.api} API), "
          f"{args.runs} runs{' (plain)' if args.plain else ''}")
    try:
        reports = run_agent(args.base_url, args.model, args.runs, api=args.api,
                            api_key=args.api_key, session_id=session_id, plain=args.plain,
                            tool_latency=args.tool_latency, max_tokens=args.max_tokens)
    except openai.OpenAIError as error:
        print(f"error: the agent failed: {error}", file=sys.stderr)
        return 1
    for r in reports:
        ttft = f"{r.ttft * 1000:7.1f} ms" if r.ttft is not None else "      - ms"
        what = f"-> {r.tool}({r.output})" if r.tool else repr(r.output[:60])
        print(f"run {r.run} turn {r.turn}: reuse={r.reuse or 'unreported':<11} "
              f"reused_tokens={r.reused_tokens:>6}  TTFT {ttft}  | {what}")
    reused = [r for r in reports[1:] if r.reuse in ("hit", "partial")]
    print(f"{len(reports)} turns, {len(reused)} of {max(len(reports) - 1, 0)} after the first "
          f"reused, {sum(r.reused_tokens for r in reports)} prompt tokens reused")
    if not args.plain:
        print(f"released conversation {session_id} at the end of the session")
    return 0


if __name__ == "__main__":
    sys.exit(main())
