"""``kvturn bench sdk``: what the kvturn SDK adds to a call, against the plain openai client.

Both clients talk to the same in-process router stand-in (``httpx2.MockTransport`` answering
with canned bytes), so the difference is the SDK alone: id stamping, the continuity check,
retry bookkeeping, reuse headers, reply observation and, for streams, the per-chunk reassembly.
Each measured call is a turn of a 5-turn conversation that extends the previous one exactly
(the common, fully checked path), sync and async, non-streaming and streaming (the stream is
read to the end).

Calls of the two clients alternate and a round's overhead is the median of the paired
differences, which cancels most of the drift of a busy machine. One process's memory layout
and the host's state shift a whole round, though (by tens of microseconds on the dev host), so
``kvturn bench sdk`` runs several rounds, each in a fresh process (``_sdk_run``), and reports
the median of their medians, each round's value and the quartiles of all pairs pooled.
Calls are timed in CPU time of the calling thread (``time.thread_time_ns``): on an idle machine
that is the wall time (the mock transport never waits), and on a shared one it leaves out the
time the thread spends descheduled by other work, the largest noise in the pairs. Which client
goes first in a pair alternates too: the second call of a pair runs measurably
differently (caches warmed or cooled by the first), and always timing kvturn second had
charged it tens of microseconds that were the order's, not the SDK's.
``own_us`` is measured more directly, in a separate pass (its timers would otherwise weigh on
the paired calls): the time spent in kvturn's hooks of openai's request loop (``_build_request``,
``_process_response``, and a followed stream's ``take``, once per chunk) outside openai's own
methods they call.

Times on a shared or virtual host drift by tens of percent between runs, so each mode also
reports ``extra_bytecodes``: how many more bytecode instructions a kvturn call executes than the
plain one (counted with ``sys.settrace`` opcode events in a last pass). It does not depend on
the host's speed or load, so it compares the SDK's work across runs and machines; how long an
instruction takes does not (kvturn's, straight-line code run once a call, cost several times
openai's average on the dev host), and a call into C counts as one whatever it does: check a
change that trades loops for C calls with a timer too.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

import httpx2
import openai
from openai._base_client import AsyncAPIClient, BaseClient, SyncAPIClient

import kvturn
from kvturn._base_client import KVTurnClientBase
from kvturn._streams import StreamFollower
from kvturn.wire import HEADER_REQUEST_ID, HEADER_REUSE, HEADER_REUSED_TOKENS, ReuseReason
from kvturn_server.bench._stats import quantile

TARGET_US = 50.0
_clock = time.thread_time_ns  # see the module docstring
TURNS = 5
MODEL = "kvturn-bench"
_BASE_URL = "http://router.bench/v1"
_REPLY_TEXT = "Sure, here is a short answer to that."
_HEADERS = {"content-type": "application/json", HEADER_REQUEST_ID: "bench",
            HEADER_REUSE: ReuseReason.HIT.value, HEADER_REUSED_TOKENS: "4096"}


@dataclass(frozen=True)
class ModeResult:
    """Medians in microseconds per call for one (client kind, streaming) combination."""

    mode: str
    stream: bool
    plain_us: float
    kvturn_us: float
    overhead_us: float
    own_us: float
    overhead_pct: float  # overhead_us against plain_us
    extra_bytecodes: int  # per call, kvturn's over the plain client's (see the docstring)


@dataclass(frozen=True)
class Spread:
    """Quartiles of one mode's paired differences (kvturn call minus openai call), in us, and
    the overhead each round measured (``kvturn bench sdk --rounds``)."""

    mode: str
    stream: bool
    overhead_p25_us: float
    overhead_p75_us: float
    rounds_us: list[float]


@dataclass(frozen=True)
class RoundResult:
    """One process's measurement of the four modes, with each mode's paired differences (ns,
    kvturn call minus openai call) for pooling across rounds."""

    modes: list[ModeResult]
    paired_ns: list[list[int]]


def _chat_body() -> bytes:
    return json.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": _REPLY_TEXT}}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 9, "total_tokens": 109}}).encode()


def _stream_body() -> bytes:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return "data: " + json.dumps({
            "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1,
            "model": MODEL, "choices": [{"index": 0, "delta": delta,
                                         "finish_reason": finish}]}) + "\n\n"

    words = _REPLY_TEXT.split(" ")
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": word + (" " if i < len(words) - 1 else "")})
               for i, word in enumerate(words)]
    events += [chunk({}, "stop"), "data: [DONE]\n\n"]
    return "".join(events).encode()


def _router() -> Callable[[httpx2.Request], httpx2.Response]:
    chat, stream = _chat_body(), _stream_body()
    stream_headers = {**_HEADERS, "content-type": "text/event-stream"}

    def handle(request: httpx2.Request) -> httpx2.Response:
        if b'"stream":true' in request.content or b'"stream": true' in request.content:
            return httpx2.Response(200, headers=stream_headers, content=stream)
        return httpx2.Response(200, headers=_HEADERS, content=chat)

    return handle


def _turns() -> Iterator[list[dict[str, Any]]]:
    """The message lists of one conversation, each extending the previous turn exactly."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a concise assistant for a travel agency."}]
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Question {turn}: what should I pack?"})
        yield messages
        messages.append({"role": "assistant", "content": _REPLY_TEXT})


class _HookTimer:
    """While installed, adds up the time spent in kvturn's hooks outside openai's own
    methods the hooks call (``super()``, a stream's decoding)."""

    def __init__(self) -> None:
        self.own_ns = 0
        # Per timed frame in progress: the time spent in the timed frames nested in it, so
        # that each frame is charged only its exclusive time (the hooks nest: kvturn's
        # _process_response calls openai's, which decodes the body).
        self._nested: list[int] = []

    @contextmanager
    def installed(self, is_async: bool) -> Iterator[None]:
        client_cls = kvturn.AsyncOpenAI if is_async else kvturn.OpenAI
        openai_cls = AsyncAPIClient if is_async else SyncAPIClient
        # (class, method, async, kvturn's): kvturn's hooks and the openai methods they call.
        hooks = [(KVTurnClientBase, "_build_request", False, True),
                 (BaseClient, "_build_request", False, False),
                 (client_cls, "_process_response", is_async, True),
                 (openai_cls, "_process_response", is_async, False),
                 (StreamFollower, "take", False, True),
                 (BaseClient, "_process_response_data", False, False)]
        saved = [(cls, name, cls.__dict__[name]) for cls, name, _, _ in hooks]
        for cls, name, hook_is_async, ours in hooks:
            setattr(cls, name, self._wrap(cls.__dict__[name], hook_is_async, ours=ours))
        try:
            yield
        finally:
            for cls, name, original in saved:
                setattr(cls, name, original)

    def _wrap(self, original: Any, is_async: bool, *, ours: bool) -> Any:
        timer = self

        def enter() -> int:
            timer._nested.append(0)
            return _clock()

        def leave(started: int) -> None:
            spent = _clock() - started
            nested = timer._nested.pop()
            if ours:
                timer.own_ns += spent - nested
            if timer._nested:
                timer._nested[-1] += spent

        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            started = enter()
            try:
                return original(self, *args, **kwargs)
            finally:
                leave(started)

        async def atimed(self: Any, *args: Any, **kwargs: Any) -> Any:
            started = enter()
            try:
                return await original(self, *args, **kwargs)
            finally:
                leave(started)

        return atimed if is_async else timed

    def take(self) -> int:
        own, self.own_ns = self.own_ns, 0
        return own


class _Samples:
    def __init__(self, calls: int) -> None:
        self.warmup = max(calls // 5, 20)
        self.total = calls + self.warmup
        self.own_total = max(calls // 5, 20)
        self.seen = 0
        self.plain: list[int] = []
        self.kvturn: list[int] = []
        self.own: list[int] = []
        self.extra_bytecodes = 0

    def kvturn_first(self) -> bool:
        """Whether the coming pair times the kvturn call first (every other pair)."""
        return self.seen % 2 == 1

    def add(self, plain: int, kvturn_: int) -> None:
        if self.seen >= self.warmup:
            self.plain.append(plain)
            self.kvturn.append(kvturn_)
        self.seen += 1

    def paired(self) -> list[int]:
        return [k - p for k, p in zip(self.kvturn, self.plain, strict=True)]

    def result(self, mode: str, stream: bool) -> tuple[ModeResult, list[int]]:
        paired = self.paired()
        plain_us, overhead_us = _median_us(self.plain), _median_us(paired)
        return (ModeResult(mode=mode, stream=stream, plain_us=plain_us,
                           kvturn_us=_median_us(self.kvturn), overhead_us=overhead_us,
                           own_us=_median_us(self.own),
                           overhead_pct=_pct(overhead_us, plain_us),
                           extra_bytecodes=self.extra_bytecodes), paired)


def _pct(overhead_us: float, plain_us: float) -> float:
    return round(100 * overhead_us / plain_us, 2) if plain_us else 0.0


def _spread(mode: str, stream: bool, paired_ns: list[int], rounds_us: list[float]) -> Spread:
    """The quartiles of ``paired_ns`` and the rounds' overheads, for one mode."""
    return Spread(mode=mode, stream=stream,
                  overhead_p25_us=round(quantile(paired_ns, 0.25) / 1000, 1),
                  overhead_p75_us=round(quantile(paired_ns, 0.75) / 1000, 1),
                  rounds_us=rounds_us)


class _Bytecodes:
    """Counts the bytecode instructions the calls made inside ``counting`` execute, per side."""

    CALLS = 10  # per side: the count is exact, a few calls average the turns of a conversation

    def __init__(self) -> None:
        self.plain = 0
        self.kvturn = 0
        self.calls = 0

    @contextmanager
    def counting(self, *, kvturn_side: bool) -> Iterator[None]:
        counted = 0

        def trace(frame: FrameType, event: str, arg: object) -> Any:
            nonlocal counted
            frame.f_trace_opcodes = True
            if event == "opcode":
                counted += 1
            return trace

        previous = sys.gettrace()
        sys.settrace(trace)
        try:
            yield
        finally:
            sys.settrace(previous)
            if kvturn_side:
                self.kvturn += counted
            else:
                self.plain += counted

    def extra(self) -> int:
        return round((self.kvturn - self.plain) / self.calls) if self.calls else 0


def _collect_conversation() -> None:
    """Free the conversation just closed, between timed calls. A conversation is a client
    copy, and an openai client is a reference cycle, so with the collector off (see
    ``run_sdk_bench``) every one stayed in memory: the heap grew, and the page faults of
    growing it landed in the kvturn side's calls (0.7 a call, against none for the one plain
    client), a cost of this benchmark, not of the SDK, in a program whose collector runs. The
    cycle was promoted to the second generation when it was last seen alive; generation 1
    holds it."""
    gc.collect(1)


def _median_us(values: list[int]) -> float:
    return round(statistics.median(values) / 1000, 1) if values else 0.0


def _bench_sync(calls: int, stream: bool) -> tuple[ModeResult, list[int]]:
    transport = httpx2.MockTransport(_router())
    plain = openai.OpenAI(base_url=_BASE_URL, api_key="bench", max_retries=0,
                          http_client=httpx2.Client(transport=transport))
    client = kvturn.OpenAI(base_url=_BASE_URL, api_key="bench", max_retries=0,
                           http_client=httpx2.Client(transport=transport))

    def call(target: openai.OpenAI, messages: Any) -> int:
        started = _clock()
        if stream:
            for _ in target.chat.completions.create(model=MODEL, messages=messages,
                                                    stream=True):
                pass
        else:
            target.chat.completions.create(model=MODEL, messages=messages)
        return _clock() - started

    samples, timer = _Samples(calls), _HookTimer()
    try:
        while samples.seen < samples.total:
            with client.conversation() as conversation:
                for messages in _turns():
                    if samples.kvturn_first():
                        kvturn_ns = call(conversation, messages)
                        samples.add(call(plain, messages), kvturn_ns)
                    else:
                        plain_ns = call(plain, messages)
                        samples.add(plain_ns, call(conversation, messages))
            del conversation
            _collect_conversation()
        with timer.installed(is_async=False):
            while len(samples.own) < samples.own_total:
                with client.conversation() as conversation:
                    for messages in _turns():
                        timer.take()
                        call(conversation, messages)
                        samples.own.append(timer.take())
                del conversation
                _collect_conversation()
        counter = _Bytecodes()
        while counter.calls < counter.CALLS:
            with client.conversation() as conversation:
                for messages in _turns():
                    with counter.counting(kvturn_side=False):
                        call(plain, messages)
                    with counter.counting(kvturn_side=True):
                        call(conversation, messages)
                    counter.calls += 1
            del conversation
            _collect_conversation()
        samples.extra_bytecodes = counter.extra()
    finally:
        client.close()
        plain.close()
    return samples.result("sync", stream)


async def _bench_async(calls: int, stream: bool) -> tuple[ModeResult, list[int]]:
    transport = httpx2.MockTransport(_router())
    plain = openai.AsyncOpenAI(base_url=_BASE_URL, api_key="bench", max_retries=0,
                               http_client=httpx2.AsyncClient(transport=transport))
    client = kvturn.AsyncOpenAI(base_url=_BASE_URL, api_key="bench", max_retries=0,
                                http_client=httpx2.AsyncClient(transport=transport))

    async def call(target: openai.AsyncOpenAI, messages: Any) -> int:
        started = _clock()
        if stream:
            async for _ in await target.chat.completions.create(model=MODEL, messages=messages,
                                                                stream=True):
                pass
        else:
            await target.chat.completions.create(model=MODEL, messages=messages)
        return _clock() - started

    samples, timer = _Samples(calls), _HookTimer()
    try:
        while samples.seen < samples.total:
            async with client.conversation() as conversation:
                for messages in _turns():
                    if samples.kvturn_first():
                        kvturn_ns = await call(conversation, messages)
                        samples.add(await call(plain, messages), kvturn_ns)
                    else:
                        plain_ns = await call(plain, messages)
                        samples.add(plain_ns, await call(conversation, messages))
            del conversation
            _collect_conversation()
        with timer.installed(is_async=True):
            while len(samples.own) < samples.own_total:
                async with client.conversation() as conversation:
                    for messages in _turns():
                        timer.take()
                        await call(conversation, messages)
                        samples.own.append(timer.take())
                del conversation
                _collect_conversation()
        counter = _Bytecodes()
        while counter.calls < counter.CALLS:
            async with client.conversation() as conversation:
                for messages in _turns():
                    with counter.counting(kvturn_side=False):
                        await call(plain, messages)
                    with counter.counting(kvturn_side=True):
                        await call(conversation, messages)
                    counter.calls += 1
            del conversation
            _collect_conversation()
        samples.extra_bytecodes = counter.extra()
    finally:
        await client.close()
        await plain.close()
    return samples.result("async", stream)


def measure_round(calls: int) -> RoundResult:
    """Measure ``calls`` turns of each mode in this process."""
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    gc_was_enabled = gc.isenabled()
    # A collection inside one client's call would land on one side of a pair; the garbage of
    # each closed conversation is collected between calls instead (_collect_conversation).
    gc.disable()
    try:
        measured = [_bench_sync(calls, False), _bench_sync(calls, True),
                    asyncio.run(_bench_async(calls, False)),
                    asyncio.run(_bench_async(calls, True))]
    finally:
        if gc_was_enabled:
            gc.enable()
    return RoundResult(modes=[result for result, _ in measured],
                       paired_ns=[paired for _, paired in measured])


def round_from_json(data: dict[str, Any]) -> RoundResult:
    return RoundResult(modes=[ModeResult(**mode) for mode in data["modes"]],
                       paired_ns=data["paired_ns"])


def aggregate(rounds: list[RoundResult]) -> tuple[list[ModeResult], list[Spread]]:
    """Each mode across rounds: the median of the rounds' medians (one process's memory layout
    and the host's state at that moment shift a whole round by tens of microseconds), the
    quartiles of all rounds' pairs pooled, and every round's overhead."""
    results, spreads = [], []
    for index, first in enumerate(rounds[0].modes):
        modes = [round_.modes[index] for round_ in rounds]

        def median(field: str, of: list[ModeResult] = modes) -> float:
            values: list[float] = [getattr(mode, field) for mode in of]
            return round(statistics.median(values), 1)

        plain_us, overhead_us = median("plain_us"), median("overhead_us")
        results.append(ModeResult(
            mode=first.mode, stream=first.stream, plain_us=plain_us,
            kvturn_us=median("kvturn_us"), overhead_us=overhead_us, own_us=median("own_us"),
            overhead_pct=_pct(overhead_us, plain_us), extra_bytecodes=first.extra_bytecodes))
        pooled = [diff for round_ in rounds for diff in round_.paired_ns[index]]
        spreads.append(_spread(first.mode, first.stream, pooled,
                              [mode.overhead_us for mode in modes]))
    return results, spreads


def main(argv: list[str] | None = None) -> int:
    """One round in its own process (``kvturn bench sdk --rounds``): JSON on stdout."""
    parser = argparse.ArgumentParser(prog="python -m kvturn_server.bench._sdk")
    parser.add_argument("calls", type=int)
    args = parser.parse_args(argv)
    sys.stdout.write(json.dumps(asdict(measure_round(args.calls))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
