"""One agent of the agent benchmarks (``kvturn bench agent`` and ``kvturn bench fleet``): its
turns, each streamed and timed, and the tool gaps between them, as one kind of client sends them.

The client kinds:

- ``plain``: no conversation id; the router neither pins nor retains (plain P/D; the agent
  bench's ``off``).
- ``ids``: ``X-Conversation-ID`` on every turn and nothing else (no pause, no release): what a
  stock router uses for session affinity only.
- ``kvturn``: a ``kvturn`` SDK conversation (``client.conversation()``), paused during each tool
  gap (the SDK renews the lease) and released at the end (the agent bench's ``on``).

Each benchmark keeps its own per-turn record, with the fields its JSON reports: the loop fills
what every turn has (``TurnFields``) and hands each turn's content-chunk times to the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvturn.wire import (
    HEADER_BLOCK_SIZE,
    HEADER_CONVERSATION_ID,
    HEADER_PREFILL_CHOICE,
    HEADER_REUSE,
    HEADER_REUSED_TOKENS,
    HEADER_ROUTE,
    PENDING,
)
from kvturn_server.bench._stats import MIB, fmt, percentile
from kvturn_server.bench.agent._kinds import CLIENT_KINDS, IDS, KVTURN
from kvturn_server.bench.agent._records import AgentOutcome

if TYPE_CHECKING:
    import kvturn

    # Types only: the workload's settings check the mode table (``_modes``).
    from kvturn_server.bench.agent._workload import AgentScript, Message



@dataclass
class Live:
    """What the progress line reports, updated by the agents as they go."""

    agents: int
    turns: int
    """All agents' turns together."""
    done_agents: int = 0
    done_turns: int = 0
    failed_turns: int = 0
    in_turn: int = 0
    in_gap: int = 0
    ttfts: list[float] = field(default_factory=list)


class TurnFields(Protocol):
    """What the loop fills in every turn record (both benchmarks' records have these)."""

    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    ttft_ms: float | None
    total_ms: float | None
    reuse: str | None
    reused_tokens: int
    route: str | None
    prefill_choice: str | None
    finish_reason: str | None
    error: str | None


R = TypeVar("R", bound=TurnFields)


def header_int(value: str | None) -> int:
    try:
        return max(int(value), 0) if value is not None else 0
    except ValueError:
        return 0


def chunk_gaps_ms(times: Sequence[float]) -> list[float]:
    """The gaps (ms) between consecutive content chunks: inter-token latency as the client sees
    it, as vLLM's own serving benchmark counts it."""
    return [(b - a) * 1000 for a, b in itertools.pairwise(times)]


async def stream_turn(target: Any, model: str, messages: list[Message], max_tokens: int,
                      clock: Callable[[], float], record: TurnFields, chunks: list[float], *,
                      headers: dict[str, str] | None = None,
                      extra_body: dict[str, Any] | None = None) -> str:
    """One streamed turn: fills ``record``'s timings (TTFT: request start to the first content
    chunk), usage (with the serving instance's ``prompt_tokens_details.cached_tokens`` where
    vLLM runs with ``--enable-prompt-tokens-details``) and the router's reports (a turn the
    decode continued alone, ``pending`` in its headers, by those cached tokens); appends each
    content chunk's time to ``chunks`` as it arrives (a turn that fails midway keeps the ones
    it had); returns the text."""
    started = clock()
    stream = await target.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers=headers, extra_body=extra_body)
    got = stream.response.headers
    record.reuse = got.get(HEADER_REUSE)
    record.reused_tokens = header_int(got.get(HEADER_REUSED_TOKENS))
    record.route = got.get(HEADER_ROUTE)
    record.prefill_choice = got.get(HEADER_PREFILL_CHOICE)
    first_finish: float | None = None
    parts: list[str] = []
    async for chunk in stream:
        if chunk.usage is not None:
            record.prompt_tokens = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            if details is not None and details.cached_tokens is not None:
                record.cached_tokens = details.cached_tokens
            record.completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            content = choice.delta.content
            if content:
                chunks.append(clock())
                parts.append(content)
            if choice.finish_reason is not None:
                record.finish_reason = choice.finish_reason
                if first_finish is None:
                    first_finish = clock()
    ended = clock()
    cached = record.cached_tokens
    # X-KVTurn-Reuse of a stream the decode continued alone: its usage says what was reused.
    if record.reuse == PENDING and cached is not None and record.prompt_tokens is not None:
        # A turn the decode continued alone: its headers preceded the decode's work; what its
        # cache supplied is the usage's cached tokens, settled as the router and SDK do.
        import kvturn

        settled = kvturn.TurnInfo(
            "", "chat", PENDING, 0, None, None, None, 1, True,
            header_int(got.get(HEADER_BLOCK_SIZE)) or None,
        ).settled(record.prompt_tokens, cached)
        record.reuse, record.reused_tokens = settled.reuse, settled.reused_tokens
    # A reply without text (the model's first token ends it) has its first token at the end.
    first = chunks[0] if chunks else first_finish
    record.ttft_ms = None if first is None else round((first - started) * 1000, 3)
    record.total_ms = round((ended - started) * 1000, 3)
    return "".join(parts)


def sdk_stats(stats: kvturn.ConversationStats) -> dict[str, Any]:
    """What the SDK counted over one conversation."""
    return {"turns": stats.turns, "reused_tokens": stats.reused_tokens, "hits": stats.hits,
            "outcomes": dict(stats.outcomes), "no_reuse": dict(stats.no_reuse),
            "retries": stats.retries, "keepalives": stats.keepalives,
            "keepalive_failures": stats.keepalive_failures,
            "release_failures": stats.release_failures}


async def run_agent(script: AgentScript, kind: str, client: kvturn.AsyncOpenAI, model: str, *,
                    t0: float, live: Live, records: list[R],
                    new_record: Callable[[int, str | None, float], R],
                    timed: Callable[[R, list[float], kvturn.TurnInfo | None], None],
                    keepalive_interval: float, reply_tokens: Sequence[int] | None = None,
                    conversation_id: str | None = None,
                    extra_body: dict[str, Any] | None = None,
                    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                    clock: Callable[[], float] = time.perf_counter) -> AgentOutcome:
    """Run one agent's turns and tool gaps as a ``kind`` client (``conversation_id``: what an
    ``ids`` client sends; ``reply_tokens``: each turn's ``max_tokens``, the script's unless
    given). Each prompt is the previous one, the reply as received and the turn's message,
    unless the script cuts the history before the turn (``AgentScript.cuts``). Per turn,
    ``new_record(turn index, conversation id, seconds since t0)`` makes the
    record, appended to ``records`` before the turn is sent; after the turn, failed or not,
    ``timed(record, its content-chunk times, the SDK's report of the turn)`` (the report: None
    unless a kvturn client's turn succeeded)."""
    if kind not in CLIENT_KINDS:
        raise ValueError(f"unknown client kind {kind!r}")
    if kind == IDS and conversation_id is None:
        raise ValueError("an ids client needs a conversation id")
    replies = script.reply_tokens if reply_tokens is None else reply_tokens
    delay = script.start_s - (clock() - t0)
    if delay > 0:
        await sleep(delay)
    conversation = (client.conversation(keepalive_interval=keepalive_interval)
                    if kind == KVTURN else None)
    cid = (conversation.id if conversation is not None
           else conversation_id if kind == IDS else None)
    headers = {HEADER_CONVERSATION_ID: cid} if kind == IDS and cid is not None else None
    target: Any = conversation if conversation is not None else client
    outcome = AgentOutcome(script.mode, script.agent, cid, repeat=script.repeat)
    messages: list[Message] = [{"role": "system", "content": script.system}]
    try:
        for turn, message in enumerate(script.messages):
            cut = script.cut_before(turn)
            if cut is not None:
                messages = cut.apply(messages)
            messages.append(message)
            record = new_record(turn, cid, round(clock() - t0, 4))
            records.append(record)
            chunks: list[float] = []
            live.in_turn += 1
            try:
                text = await stream_turn(target, model, messages, replies[turn], clock, record,
                                         chunks, headers=headers, extra_body=extra_body)
            except Exception as error:
                record.error = f"{type(error).__name__}: {error}"[:500]
                outcome.error = f"turn {turn + 1}: {record.error}"
                live.failed_turns += 1
                timed(record, chunks, None)
                return outcome  # the conversation cannot go on without this turn's reply
            finally:
                live.in_turn -= 1
            timed(record, chunks, conversation.last_turn if conversation is not None else None)
            if record.ttft_ms is not None:
                live.ttfts.append(record.ttft_ms)
            live.done_turns += 1
            outcome.turns_ok += 1
            # The reply exactly as received: the next prompt extends what the decode retained.
            messages.append({"role": "assistant", "content": text})
            if turn < len(script.gaps_s):
                live.in_gap += 1
                try:
                    if conversation is not None:
                        async with conversation.pause("tool"):
                            await sleep(script.gaps_s[turn])
                    else:
                        await sleep(script.gaps_s[turn])
                finally:
                    live.in_gap -= 1
        return outcome
    finally:
        live.done_agents += 1
        if conversation is not None:
            await conversation.close()
            outcome.sdk_stats = sdk_stats(conversation.stats)


async def _tick(tag: str, live: Live, held: Callable[[], int | None], holder: str, t0: float,
                interval: float, say: Callable[[str], None], clock: Callable[[], float]) -> None:
    while True:
        await asyncio.sleep(interval)
        retained = held()
        say(f"{tag} {clock() - t0:6.1f} s: agents {live.done_agents}/{live.agents} done, "
            f"{live.in_turn} in a turn, {live.in_gap} in a tool gap; turns "
            f"{live.done_turns}/{live.turns}"
            + (f" ({live.failed_turns} failed)" if live.failed_turns else "")
            + f"; TTFT p50 so far {fmt(percentile(live.ttfts, 0.5))} ms; {holder} "
              f"{fmt(None if retained is None else retained / MIB, '.1f')} MiB")


@contextlib.asynccontextmanager
async def progress(tag: str, live: Live, held: Callable[[], int | None], holder: str,
                   t0: float, interval: float, say: Callable[[str], None],
                   clock: Callable[[], float]) -> AsyncIterator[None]:
    """Say how the agents are doing every ``interval`` seconds (never where it is 0) while
    inside: ``held()``, the bytes the decodes retain by the latest sample, as ``holder``
    (``decode retains``, say)."""
    if interval <= 0:
        yield
        return
    ticker = asyncio.create_task(_tick(tag, live, held, holder, t0, interval, say, clock))
    try:
        yield
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
