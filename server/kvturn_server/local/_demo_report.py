"""What ``kvturn demo`` runs and shows: its modes, one report per model turn, the table, the
summary against each stock mode, and the plot (``_demo.py`` runs the agent).

The modes are the benchmarks' (``kvturn bench agent``): stock P/D, stock conditional
disaggregation (what llm-d and NVIDIA Dynamo ship: a short follow-up runs on the decode that
served the conversation, whose plain prefix cache still holds it; on the demo's one agent, whose
later turns are all short, on a roomy decode, as strong as any stock setup, host tier or higher
threshold included), and kvturn. Both stock modes talk to a stock router
(``kvturn router --no-kv-reuse --conditional-disagg N``): without a conversation id every turn
is plain P/D there; with one (a stock client's default header) it decides per turn.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvturn.wire import Route
from kvturn_server._plot import pyplot, save
from kvturn_server.local._metrics import PromptSources

Api = Literal["chat", "responses", "messages"]
API_NAMES: dict[str, str] = {"chat": "Chat Completions", "responses": "Responses",
                             "messages": "Messages"}

# Which router a mode talks to, and what its client sends (bench agent's client kinds).
STOCK, KVTURN = "stock", "kvturn"
PLAIN, IDS = "plain", "ids"

CONTINUE_TOKENS = 512
"""The stock router's threshold, as ``kvturn bench agent``'s ``stock-cond`` (llm-d's
``nonCachedTokens``); the demo's later turns are far shorter, so 2,048 would decide alike."""
STOCK_ROUTER_ARGS: tuple[str, ...] = ("--no-kv-reuse", "--conditional-disagg",
                                      str(CONTINUE_TOKENS))


@dataclass(frozen=True)
class DemoMode:
    """One way the demo runs the agent. ``name``: the benchmarks' shared name; ``router``:
    ``stock`` or ``kvturn``; ``client``: ``plain`` (no conversation id), ``ids``
    (``X-Conversation-ID`` as a default header, nothing else) or ``kvturn`` (a kvturn SDK
    conversation: lease renewed through tool gaps, released at the end)."""

    name: str
    router: str
    client: str
    label: str

    @property
    def kvturn(self) -> bool:
        return self.client == KVTURN


MODES: tuple[DemoMode, ...] = (
    DemoMode("stock-pd", STOCK, PLAIN, "stock P/D (no conversation id)"),
    DemoMode("stock-cond", STOCK, IDS,
             "stock conditional disaggregation (llm-d, Dynamo; X-Conversation-ID)"),
    DemoMode("kvturn", KVTURN, KVTURN, "kvturn"),
)
MODES_BY_NAME = {m.name: m for m in MODES}
BASELINE = "stock-cond"
"""The strongest stock mode: what kvturn's headline ratio is against."""


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
        return Route.PREFILL if seen > 0 else Route.DECODE

    @property
    def computed(self) -> float:
        """Prompt tokens computed on either instance (a P/D decode computes only what it
        could not read; one that continues a turn computes what its cache lacks)."""
        return self.prefill.computed + self.decode.computed

    @property
    def from_decode(self) -> float:
        """Prompt tokens whose KV the decode supplied: kvturn's retention read by the prefill
        over NIXL, or, on a turn the decode continued, its own cache (kvturn's retention, or
        stock conditional disaggregation's plain prefix cache)."""
        return self.prefill.transferred if self.route == "prefill" else self.decode.local_cache


def format_table(reports: list[TurnReport]) -> str:
    """One row per model turn, mode after mode (a blank line between modes)."""
    head = ("mode", "turn", "model call", "prompt", "TTFT ms", "route", "P cache", "from D",
            "computed", "reuse")
    groups = [[(r.mode, str(r.turn), r.tool or "answer", str(r.prompt_tokens),
                f"{r.ttft_ms:.0f}", r.route, f"{r.prefill.local_cache:.0f}",
                f"{r.from_decode:.0f}", f"{r.computed:.0f}", r.reuse)
               for r in reports if r.mode == mode.name] for mode in MODES]
    groups = [g for g in groups if g]
    rows = [head, *(row for g in groups for row in g)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(row, widths, strict=True)))

    lines = [line(head), "  ".join("-" * w for w in widths)]
    for number, group in enumerate(groups):
        if number:
            lines.append("")
        lines += [line(row) for row in group]
    return "\n".join(lines)


@dataclass(frozen=True)
class ModeSummary:
    """A mode's later turns (2 and on): median TTFT and prompt tokens computed."""

    mode: str
    turns: int
    median_ttft_ms: float
    computed: float


def summarise(reports: list[TurnReport]) -> list[ModeSummary]:
    out = []
    for mode in MODES:
        later = [r for r in reports if r.mode == mode.name and r.turn > 1]
        if later:
            out.append(ModeSummary(mode.name, len(later),
                                   statistics.median(r.ttft_ms for r in later),
                                   sum(r.computed for r in later)))
    return out


def summary(reports: list[TurnReport]) -> str:
    """Per mode, turns 2 and on: median TTFT and prompt tokens computed, and each stock mode
    over kvturn (above 1: kvturn is faster, computes fewer)."""
    rows = summarise(reports)
    if not rows:
        return ""
    ours = next((s for s in rows if MODES_BY_NAME[s.mode].kvturn), None)
    last = max(s.turns for s in rows) + 1
    table = [(f"turns 2-{last}", "median TTFT", "computed", "TTFT / kvturn's",
              "computed / kvturn's")]
    for s in rows:
        ratios = ("", "")
        if ours is not None and s is not ours:
            ratios = (f"{s.median_ttft_ms / max(ours.median_ttft_ms, 1e-9):.2f}x",
                      f"{s.computed / max(ours.computed, 1):.2f}x")
        table.append((s.mode, f"{s.median_ttft_ms:.0f} ms", f"{s.computed:.0f}", *ratios))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
             for row in table]
    if ours is not None:
        base = next((s for s in rows if s.mode == BASELINE), None)
        if base is not None:
            lines.append(f"kvturn against {BASELINE}, the strongest stock setup: median TTFT "
                         f"{base.median_ttft_ms:.0f} / {ours.median_ttft_ms:.0f} ms = "
                         f"{base.median_ttft_ms / max(ours.median_ttft_ms, 1e-9):.2f}x, "
                         f"prompt tokens computed {base.computed:.0f} / {ours.computed:.0f} = "
                         f"{base.computed / max(ours.computed, 1):.2f}x (above 1: kvturn "
                         "faster, computes fewer)")
    return "\n".join(lines)


LEGEND = f"""\
Every mode runs the same agent on the same prefill and decode, with vLLM's defaults (prefix
caching on, on both); each with a system prompt of its own, so no mode finds another's prompt
in any cache. stock-pd and stock-cond talk to a stock router (kvturn router
{' '.join(STOCK_ROUTER_ARGS)}: no retention, no pins):
  stock-pd: a stock client without conversation ids: every turn a prefill leg, then a decode
    leg (stock P/D).
  stock-cond: the same stock client with X-Conversation-ID as a default header: a turn whose
    new messages are estimated at most {CONTINUE_TOKENS} tokens runs on the decode that served
    the conversation, alone, where its plain prefix cache (LRU, nothing held) supplies what it
    still has (llm-d's prefix-based-pd-decider, NVIDIA Dynamo's conditional disaggregation).
  kvturn: the kvturn client through the kvturn router: the decode retains each turn under a
    lease (renewed through tool gaps), continues short turns itself, and a prefill reads what
    it lacks from it.
prompt: prompt tokens of the model call. P cache: of them, found in the prefill's own prefix
cache. from D: KV the decode supplied (kvturn's retention read by the prefill over NIXL, or, on
route decode, the decode's own cache). computed: prompt tokens computed, prefill and decode
together (every count from the instances' vllm:prompt_tokens_by_source_total).
route: decode = the decode continued the turn alone (no prefill leg, no transfer); prefill =
prefill leg, then decode leg.
reuse: the report kvturn's client got (X-KVTurn-Reuse): hit = every full block of the prompt
came from retained or cached KV, partial = a verified prefix did, miss = none; pending = a
streamed turn the decode continued alone, whose headers went out before the decode knew what
its cache held (the router settles it from the decode's usage, in its metrics and for a client
that asks for stream usage; from D says what the decode's cache supplied); stock clients read
no report (-)."""


def write_plot(reports: list[TurnReport], path: Path, api: Api = "chat") -> bool:
    """TTFT per model turn, one line per mode; False when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    styles = {"stock-pd": "s--", "stock-cond": "^-", "kvturn": "o-"}
    for mode in MODES:
        rs = [r for r in reports if r.mode == mode.name]
        if rs:
            ax.plot([r.turn for r in rs], [r.ttft_ms for r in rs], styles.get(mode.name, "o-"),
                    label=f"{mode.name}: {mode.label}")
    ax.set_xlabel("model turn of the agent")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"kvturn demo: tool agent on the {API_NAMES[api]} API, tiny model on CPU")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    save(plt, fig, path)
    return True
