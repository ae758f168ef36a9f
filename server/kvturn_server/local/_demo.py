"""``kvturn demo``: a LangGraph tool agent through the local stack, kvturn off and on.

The agent is ``examples/langgraph_agent.py`` (``create_agent`` with tools that take a while, a
tool call forced on every turn but the last). It runs twice on the same prefill + decode +
router, both with vLLM's default settings (prefix caching on): **off**, a stock ``ChatOpenAI``
without conversation ids (stock P/D: the prefill's own cache holds the previous prompts, and it
computes the rest: the reply the decode generated and the new message), and **on**,
``KVTurnChatOpenAI`` (the thread is a kvturn conversation: the decode that holds it continues
short turns itself, and a prefill reads what it lacks from the decode). Per model turn it
measures the time to the first token and where the prompt's KV came from (the instances'
metrics: the prefill's cache, the decode's retained KV, or computed on either), then prints a
table, writes a PNG plot and stops the stack.

``--api`` picks the API the agent talks through the router: ``chat`` (Chat Completions, the
default), ``responses`` (the same LangGraph agent with ``use_responses_api=True``: turns go to
``/v1/responses``) or ``messages`` (the same agent as a plain loop over Anthropic's
``/v1/messages``, ``_demo_messages.py``).
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Literal
from uuid import UUID

from kvturn_server._plot import pyplot, save
from kvturn_server.local._demo_messages import run_messages_agent
from kvturn_server.local._metrics import PromptSources, prompt_sources
from kvturn_server.local._progress import ProgressLine
from kvturn_server.local._stack import Stack, StackConfig, read_running

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "langgraph_agent.py"
MODES = ("off", "on")
Api = Literal["chat", "responses", "messages"]
API_NAMES: dict[str, str] = {"chat": "Chat Completions", "responses": "Responses",
                             "messages": "Messages"}


@dataclass(frozen=True)
class TurnReport:
    mode: str
    turn: int
    tool: str | None
    prompt_tokens: int
    ttft_ms: float
    total_ms: float
    reuse: str
    prefill: PromptSources
    decode: PromptSources

    @property
    def route(self) -> str:
        """``decode`` when the decode served the turn alone (the prefill saw nothing)."""
        seen = self.prefill.computed + self.prefill.local_cache + self.prefill.transferred
        return "prefill" if seen > 0 else "decode"

    @property
    def computed(self) -> float:
        """Prompt tokens computed on either instance (a P/D decode computes only what it
        could not read; one that continues a turn computes what its cache lacks)."""
        return self.prefill.computed + self.decode.computed

    @property
    def from_decode(self) -> float:
        """Prompt tokens whose KV came from the decode's retention: read by the prefill over
        NIXL, or, on a turn the decode continued, its own cache."""
        return self.prefill.transferred if self.route == "prefill" else self.decode.local_cache


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
    each, its time to the first token, and its report."""

    def __init__(self, mode: str, cfg: StackConfig, reports: list[TurnReport]) -> None:
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
        report = TurnReport(
            self.mode, len([r for r in self.reports if r.mode == self.mode]) + 1, tool,
            int(prompt), ((self._first or now) - started) * 1000, (now - started) * 1000,
            reuse or "-", p, d)
        self.reports.append(report)
        print(f"  [{self.mode}] turn {report.turn}: {report.tool or 'answer':<15} TTFT "
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
    """What the warm-up measures: nothing."""


def run_agents(cfg: StackConfig, turns: int, tool_latency: float,
               api: Api = "chat") -> list[TurnReport]:
    """Run the agent off, then on, talking ``api``; one report per model turn."""
    agent = load_agent()
    reports: list[TurnReport] = []
    base_url = f"{cfg.router_url}/v1"

    def run(mode: str, turns: int, tag: str, meter: Meter | None) -> None:
        plain = mode != "on"
        if api == "messages":
            run_messages_agent(
                agent, cfg.router_url, cfg.served_model_name, turns,
                conversation=None if plain else tag, tool_latency=tool_latency, tag=tag,
                manual=MANUAL_SECTIONS if meter else 0,
                start=meter.start if meter else _ignore,
                first_token=meter.first_token if meter else _ignore,
                end=meter.end if meter else _ignore)
            return
        agent.run_agent(base_url, cfg.served_model_name, turns, plain=plain, thread_id=tag,
                        tool_latency=tool_latency, tag=tag,
                        manual=MANUAL_SECTIONS if meter else 0,
                        callbacks=[_tracer(meter)] if meter else [],
                        use_responses_api=True if api == "responses" else None)

    # First-use costs stay out of the comparison: NIXL handshakes, and vLLM compiling the
    # grammar of each tool's forced call (a one-off per tool, which the first mode would pay).
    print("warming up (NIXL handshakes, tool-call grammars)", file=sys.stderr, flush=True)
    run("warm-up", len(agent.TOOLS) + 1, "warm-up", None)
    for mode in MODES:
        print(f"running the agent with kvturn {mode} on the {API_NAMES[api]} API: {turns} "
              f"model turns, tools take {tool_latency:g} s", file=sys.stderr, flush=True)
        # A history of its own per mode: the runs share no prefix in any cache.
        tag = f"demo-{mode}-{uuid.uuid4().hex[:8]}"
        run(mode, turns, tag, Meter(mode, cfg, reports))
    return reports


def format_table(reports: list[TurnReport]) -> str:
    head = ("turn", "model call", "prompt", "off: TTFT ms", "P cache", "computed",
            "on: TTFT ms", "route", "P cache", "from D", "computed", "reuse")
    rows = [head]
    off = [r for r in reports if r.mode == "off"]
    on = [r for r in reports if r.mode == "on"]
    for a, b in zip(off, on, strict=False):
        rows.append((str(b.turn), b.tool or "answer", str(b.prompt_tokens),
                     f"{a.ttft_ms:.0f}", f"{a.prefill.local_cache:.0f}", f"{a.computed:.0f}",
                     f"{b.ttft_ms:.0f}", b.route, f"{b.prefill.local_cache:.0f}",
                     f"{b.from_decode:.0f}", f"{b.computed:.0f}", b.reuse))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(reports: list[TurnReport]) -> str:
    def later(mode: str) -> list[TurnReport]:
        return [r for r in reports if r.mode == mode and r.turn > 1]

    off, on = later("off"), later("on")
    if not off or not on:
        return ""
    off_ttft = statistics.median(r.ttft_ms for r in off)
    on_ttft = statistics.median(r.ttft_ms for r in on)
    off_computed = sum(r.computed for r in off)
    on_computed = sum(r.computed for r in on)
    return (f"turns 2-{len(off) + 1}: median TTFT {off_ttft:.0f} ms off, {on_ttft:.0f} ms on "
            f"({off_ttft / on_ttft:.1f}x); prompt tokens computed (prefill and decode) "
            f"{off_computed:.0f} off, {on_computed:.0f} on "
            f"({off_computed / max(on_computed, 1):.1f}x fewer)")


LEGEND = """\
Both runs use vLLM's defaults: prefix caching on, on the prefill and on the decode.
off = stock P/D without conversation ids; on = kvturn conversations.
prompt: prompt tokens of the model call. P cache: of them, found in the prefill's own prefix
cache. from D: KV from the decode's retention (read by the prefill over NIXL, or, on route
decode, the decode's own cache). computed: prompt tokens computed, prefill and decode together.
route: decode = the decode that holds the conversation continued the turn alone (no prefill
leg, no transfer); prefill = prefill leg, then decode leg.
reuse: the router's X-KVTurn-Reuse (hit: every full block of the prompt came from retained or
cached KV; partial: a verified prefix did; pending: a streamed turn the decode continued alone,
whose reuse its headers cannot know yet: from D says what the decode's cache supplied)."""


def write_plot(reports: list[TurnReport], path: Path, api: Api = "chat") -> bool:
    """TTFT per model turn, off vs on; False when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, label in (("off", "kvturn off (stock P/D, prefix caching on)"),
                        ("on", "kvturn on")):
        rs = [r for r in reports if r.mode == mode]
        ax.plot([r.turn for r in rs], [r.ttft_ms for r in rs], "o-", label=label)
    ax.set_xlabel("model turn of the agent")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"kvturn demo: tool agent on the {API_NAMES[api]} API, tiny model on CPU")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    save(plt, fig, path)
    return True


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
        reports = run_agents(cfg, turns, tool_latency, api)
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
