"""``kvturn demo``: a LangGraph tool agent through the local stack, three ways.

The agent is ``examples/langgraph_agent.py`` (``create_agent`` with tools that take a while, a
tool call forced on every turn but the last). It runs on the same prefill and decode, both with
vLLM's default settings (prefix caching on), in the modes of ``_demo_report.py``: **stock-pd**
(a stock ``ChatOpenAI`` without conversation ids, through a stock router: stock P/D),
**stock-cond** (the same stock client sending ``X-Conversation-ID`` as a default header, through
the same stock router, ``--no-kv-reuse --conditional-disagg 512``: stock conditional
disaggregation, on this workload as strong as any stock setup) and **kvturn**
(``KVTurnChatOpenAI`` through the stack's kvturn router). The stock router is started beside the
stack's for the run (``_demo_router.py``). Per model turn it measures the time to the first
token and where the prompt's KV came from (the instances' metrics: the prefill's cache, the
decode, or computed on either), then prints a table and a summary, writes a PNG plot and stops
what it started.

``--api`` picks the API the agent talks through the routers: ``chat`` (Chat Completions, the
default), ``responses`` (the same LangGraph agent with ``use_responses_api=True``: turns go to
``/v1/responses``) or ``messages`` (the same agent as a plain loop over Anthropic's
``/v1/messages``, ``_demo_messages.py``). The stock router decides conditional disaggregation on
all three (``docs/http-api.md`` B, "Placement" 5), so every mode runs on each.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any
from uuid import UUID

from kvturn_server.local._demo_messages import run_messages_agent
from kvturn_server.local._demo_report import (
    API_NAMES,
    IDS,
    KVTURN,
    LEGEND,
    MODES,
    PLAIN,
    STOCK,
    STOCK_ROUTER_ARGS,
    Api,
    DemoMode,
    TurnReport,
    format_table,
    summary,
    write_plot,
)
from kvturn_server.local._demo_router import stock_router
from kvturn_server.local._metrics import PromptSources, prompt_sources
from kvturn_server.local._progress import ProgressLine
from kvturn_server.local._stack import Stack, read_running
from kvturn_server.local._stack_config import StackConfig

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "langgraph_agent.py"


def load_agent() -> ModuleType:
    """The example agent, from the source checkout this package runs from."""
    if not EXAMPLE.is_file():
        raise FileNotFoundError(
            f"kvturn demo runs the example agent of a source checkout ({EXAMPLE} is missing); "
            "run it from the repository (`make demo`)")
    spec = importlib.util.spec_from_file_location("kvturn_demo_agent", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class Meter:
    """Measures the agent's model calls, one after the other: the instances' metrics around
    each, its time to the first token, and, for kvturn's client, its report."""

    def __init__(self, mode: DemoMode, cfg: StackConfig, reports: list[TurnReport]) -> None:
        self.mode = mode
        self.cfg = cfg
        self.reports = reports
        self._open: tuple[float, PromptSources, PromptSources] | None = None
        self._first: float | None = None

    def start(self) -> None:
        self._open = (time.perf_counter(), prompt_sources(self.cfg.prefill_url),
                      prompt_sources(self.cfg.decode_url))
        self._first = None

    def first_token(self) -> None:
        if self._first is None:
            self._first = time.perf_counter()

    def end(self, tool: str | None, reuse: str | None) -> None:
        assert self._open is not None, "end() without start()"
        (started, p0, d0), self._open = self._open, None
        now = time.perf_counter()
        p = prompt_sources(self.cfg.prefill_url) - p0
        d = prompt_sources(self.cfg.decode_url) - d0
        prompt = p.computed + p.local_cache + p.transferred
        if prompt == 0:  # the decode served the turn alone
            prompt = d.computed + d.local_cache + d.transferred
        name = self.mode.name
        report = TurnReport(
            name, len([r for r in self.reports if r.mode == name]) + 1, tool, int(prompt),
            ((self._first or now) - started) * 1000, (now - started) * 1000,
            # A stock client reads no kvturn report (the stock router's says "disabled").
            (reuse or "-") if self.mode.kvturn else "-", p, d)
        self.reports.append(report)
        print(f"  [{name}] turn {report.turn}: {report.tool or 'answer':<15} TTFT "
              f"{report.ttft_ms:6.0f} ms  {report.route:<7} prefill cache "
              f"{p.local_cache:6.0f}, from the decode {report.from_decode:6.0f}, computed "
              f"{report.computed:6.0f}", file=sys.stderr, flush=True)


def _tracer(meter: Meter) -> Any:
    from langchain_core.callbacks import BaseCallbackHandler

    class Tracer(BaseCallbackHandler):
        """The LangGraph agent's model calls, measured by ``meter``."""

        def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: UUID,
                                **kwargs: Any) -> None:
            meter.start()

        def on_llm_new_token(self, token: Any, *, chunk: Any = None, run_id: UUID,
                             **kwargs: Any) -> None:
            message = getattr(chunk, "message", None)
            if token or getattr(message, "tool_call_chunks", None):
                meter.first_token()

        def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
            message = response.generations[0][0].message
            calls = getattr(message, "tool_calls", None) or []
            info = message.response_metadata.get("kvturn") or {}
            meter.end(calls[0]["name"] if calls else None, info.get("reuse"))

    return Tracer()


MANUAL_SECTIONS = 100
"""Tool-manual sections in the agent's system prompt (about 3,200 tokens): the size of a real
agent's tool documentation, so that the prefill's work is what it is in production."""


def _ignore(*_: object) -> None:
    """What the warm-ups measure: nothing."""


def run_agents(cfg: StackConfig, stock_url: str, turns: int, tool_latency: float,
               api: Api = "chat") -> list[TurnReport]:
    """Run the agent in each mode (``MODES``' order) talking ``api``, the stock modes through
    the stock router at ``stock_url``, kvturn through the stack's; one report per model turn."""
    agent = load_agent()
    reports: list[TurnReport] = []
    urls = {STOCK: stock_url, KVTURN: cfg.router_url}

    def run(mode: DemoMode, turns: int, tag: str, tool_latency: float,
            meter: Meter | None) -> None:
        conversation = None if mode.client == PLAIN else tag
        if api == "messages":
            run_messages_agent(
                agent, urls[mode.router], cfg.served_model_name, turns,
                conversation=conversation, release=mode.kvturn, tool_latency=tool_latency,
                tag=tag, manual=MANUAL_SECTIONS, start=meter.start if meter else _ignore,
                first_token=meter.first_token if meter else _ignore,
                end=meter.end if meter else _ignore)
            return
        agent.run_agent(f"{urls[mode.router]}/v1", cfg.served_model_name, turns,
                        plain=not mode.kvturn, conversation_header=mode.client == IDS,
                        thread_id=tag, tool_latency=tool_latency, tag=tag,
                        manual=MANUAL_SECTIONS,
                        callbacks=[_tracer(meter)] if meter else [],
                        use_responses_api=True if api == "responses" else None)

    # First-use costs stay out of the comparison, with instant tools: every turn of the
    # schedule as stock P/D (the NIXL handshake, the first long prompts, and vLLM compiling the
    # grammar of each tool's forced call on the prefill and on the decode: a one-off per tool,
    # which the first mode would pay), then two turns of each other mode (each router's
    # connections, a turn continued on the decode).
    print("warming up (NIXL handshakes, tool-call grammars, both routers)", file=sys.stderr,
          flush=True)
    # Each run's system prompt starts with a tag of its own, so that no run finds another's
    # prompt in any cache; the tags differ in one digit only, so that every mode's prompts
    # have the same number of tokens.
    nonce = uuid.uuid4().hex[:8]
    runs = iter(range(1, 2 * len(MODES) + 1))
    for mode in MODES:
        run(mode, len(agent.TOOLS) + 1 if mode.client == PLAIN else 2,
            f"demo-{nonce}-run-{next(runs)}", 0.0, None)
    for mode in MODES:
        print(f"running the agent as {mode.name} ({mode.label}) on the {API_NAMES[api]} API: "
              f"{turns} model turns, tools take {tool_latency:g} s", file=sys.stderr,
              flush=True)
        run(mode, turns, f"demo-{nonce}-run-{next(runs)}", tool_latency,
            Meter(mode, cfg, reports))
    return reports


def run_demo(cfg: StackConfig, turns: int = 6, tool_latency: float = 0.5,
             plot: Path | None = None, api: Api = "chat") -> int:

    load_agent()  # fail before minutes of start-up if the example is not there
    running = read_running(cfg.state_dir)
    stack: Stack | None = None
    if running is not None:
        cfg = running.config
        print(f"using the stack already running from {cfg.state_dir}", file=sys.stderr)
    else:
        # vLLM's defaults (prefix caching on everywhere): the baseline users run.
        cfg = replace(cfg, prefill_prefix_caching=True)
        print("starting the local stack (tiny model; prefill and decode with vLLM's default "
              "prefix caching, router; about a minute)", file=sys.stderr)
        stack = Stack(cfg, die_with_parent=True).start(progress=ProgressLine())
    try:
        print(f"starting a stock router beside it (kvturn router {' '.join(STOCK_ROUTER_ARGS)})",
              file=sys.stderr)
        with stock_router(cfg, STOCK_ROUTER_ARGS) as stock_url:
            reports = run_agents(cfg, stock_url, turns, tool_latency, api)
    finally:
        if stack is not None:
            print("stopping the stack", file=sys.stderr)
            stack.stop()
    print()
    print(format_table(reports))
    print()
    print(summary(reports))
    print()
    print(LEGEND)
    plot = plot or cfg.state_dir / "demo.png"
    if write_plot(reports, plot, api):
        print(f"\nplot: {plot}")
    return 0
