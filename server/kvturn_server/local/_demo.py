"""``kvturn demo``: a multi-turn chat through the local stack, with a per-turn table."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from kvturn_server.local._metrics import PromptSources, prompt_sources
from kvturn_server.local._stack import Stack, StackConfig, read_running

USER_TURNS = (
    "Plan a three-city trip: Paris, Oslo and Lima. What should I check first?",
    "Look up the weather in each city for next week and summarise it.",
    "Oslo looks cold. Swap it for Lisbon and redo the plan.",
    "Now list the trains and flights between the cities in order.",
    "Give me a packing list for the whole trip.",
    "Summarise everything we decided in five bullet points.",
    "Estimate the total cost in euros, with a line per item.",
    "Which bookings should I make today, and which can wait?",
)
SYSTEM = "You are a careful travel agent. Answer briefly."


@dataclass(frozen=True)
class TurnReport:
    turn: int
    prompt_tokens: int
    ttft_ms: float
    total_ms: float
    prefill: PromptSources
    decode: PromptSources


def _run_turn(client: OpenAI, model: str, messages: list[ChatCompletionMessageParam],
              max_tokens: int) -> tuple[str, int, float, float]:
    started = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    prompt_tokens = 0
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - started
                parts.append(choice.delta.content)
    total = time.perf_counter() - started
    return "".join(parts), prompt_tokens, (ttft or total) * 1000, total * 1000


def run_conversation(cfg: StackConfig, turns: int, max_tokens: int = 48) -> list[TurnReport]:
    """Run ``turns`` chat turns through the router and measure each one."""
    client = OpenAI(base_url=f"{cfg.router_url}/v1", api_key="kvturn-demo", max_retries=0)
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM}]
    reports: list[TurnReport] = []
    for i in range(turns):
        messages.append({"role": "user", "content": USER_TURNS[i % len(USER_TURNS)]})
        p0, d0 = prompt_sources(cfg.prefill_url), prompt_sources(cfg.decode_url)
        text, prompt_tokens, ttft_ms, total_ms = _run_turn(
            client, cfg.served_model_name, messages, max_tokens)
        p1, d1 = prompt_sources(cfg.prefill_url), prompt_sources(cfg.decode_url)
        reports.append(TurnReport(i + 1, prompt_tokens, ttft_ms, total_ms, p1 - p0, d1 - d0))
        messages.append({"role": "assistant", "content": text})
    return reports


def format_table(reports: list[TurnReport]) -> str:
    head = ("turn", "prompt", "P computed", "P cached", "D via NIXL", "D computed", "D cached",
            "TTFT ms", "total ms")
    rows = [head]
    for r in reports:
        rows.append((str(r.turn), str(r.prompt_tokens), f"{r.prefill.computed:.0f}",
                     f"{r.prefill.local_cache:.0f}", f"{r.decode.transferred:.0f}",
                     f"{r.decode.computed:.0f}", f"{r.decode.local_cache:.0f}",
                     f"{r.ttft_ms:.0f}", f"{r.total_ms:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


LEGEND = """\
prompt: prompt tokens of the turn. P = prefill instance, D = decode instance.
P computed / P cached: prompt tokens the prefill computed / found in its own prefix cache.
D via NIXL: prompt tokens whose KV the decode read from the prefill over NIXL.
D computed / D cached: prompt tokens the decode computed itself / found in its prefix cache.
TTFT: time to the first streamed token through the router."""


def run_demo(cfg: StackConfig, turns: int = 5) -> int:
    from kvturn_server.cli import ProgressLine

    running = read_running(cfg.state_dir)
    stack: Stack | None = None
    if running is not None:
        cfg = running.config
        print(f"using the stack already running from {cfg.state_dir}", file=sys.stderr)
    else:
        print("starting the local stack (tiny model, prefill + decode vLLM on CPU, router); "
              "1-2 minutes", file=sys.stderr)
        stack = Stack(cfg, die_with_parent=True).start(progress=ProgressLine())
    try:
        print(f"running {turns} chat turns through {cfg.router_url}", file=sys.stderr)
        reports = run_conversation(cfg, turns)
        print()
        print(format_table(reports))
        print()
        print(LEGEND)
    finally:
        if stack is not None:
            print("stopping the stack", file=sys.stderr)
            stack.stop()
    return 0
