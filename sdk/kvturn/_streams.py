"""Following a streamed reply chunk by chunk: no buffering, no iterator layer, bounded memory.

openai's ``Stream`` / ``AsyncStream`` hands every chunk's JSON to its client's
``_process_response_data`` as the caller iterates (``Stream.__stream__`` reads that method
from its client when iteration starts). A followed stream's client is a ``StreamClient``
standing in for the conversation in that one stream, whose ``_process_response_data`` is a
follower's ``take``: it queues the chunk (a list append), then decodes it with the
conversation's own method. So other streams (a plain client's, a Responses stream) pay nothing
per chunk, and a followed one the least kvturn can.

The queue is assembled (``fold``) every ``FOLD_EVERY`` chunks, which bounds its memory, and for
what is left before the conversation's next turn (``ConversationState.pending_reply``). In
batches, not chunk by chunk: code run once per chunk between openai's thousands of
instructions per chunk runs cold, and costs several times what the same loop costs over a
batch (assembling each chunk as it passed cost about 11 us more a 10-chunk stream, measured in
one process against this design; docs/sdk.md, session 10). Only the reply's own pieces are
kept once assembled.

The reply is handed to the conversation (``ConversationState.finished``) by the fold that sees
every choice's ``finish_reason``; following stops there (later chunks are dropped), except
that a call that asked for usage (``stream_options.include_usage``) has its usage event read
by a later fold: it settles a ``pending`` report (``ConversationState.settle``; ``last_turn``
and ``stats`` fold first). A stream abandoned or cut before that leaves the reply unknown,
and a chunk the follower cannot read stops the following, never the caller's iteration.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import httpx2

from kvturn._continuity import CompletionTurn, Message, strip_echo

if TYPE_CHECKING:
    from openai import AsyncStream, Stream

    from kvturn._state import ConversationState, TurnPlan

log = logging.getLogger("kvturn")

_T = TypeVar("_T")

# Chunks queued before they are assembled: bounds the memory a long stream holds, and is large
# enough that the per-fold cost is spread thin.
FOLD_EVERY: Final = 64


class StreamClient:
    """The client of one followed stream (``Stream._client``): openai's stream reads only
    ``_process_response_data`` from it once it is built, and this one is a follower's
    ``take``. Every other attribute is the conversation's (a newer openai may read more, and
    code that reaches the HTTP client through ``stream._client._client`` still finds it)."""

    __slots__ = ("_kvturn_target", "_process_response_data")

    def __init__(self, client: Any, take: Any) -> None:
        self._kvturn_target = client
        self._process_response_data = take

    def __getattr__(self, name: str) -> Any:
        if name == "_kvturn_target":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._kvturn_target, name)


class StreamFollower:
    """What the chat and completions followers share: the queue, the stream they stand in for,
    where the reply goes, and when it is complete (``n`` choices finished)."""

    __slots__ = ("_decode", "_expected", "_finished", "_lock", "_parts", "_plan", "_state",
                 "chunks", "following")

    def __init__(self, state: ConversationState, plan: TurnPlan,
                 stream: Stream[Any] | AsyncStream[Any]) -> None:
        self._state, self._plan = state, plan
        self.chunks: list[Any] = []
        self._finished: set[int] = set()
        self._expected = max(plan.choices, 1)
        # Per choice index, what has come of its reply (the subclass's kind of pieces).
        self._parts: dict[int, Any] = {}
        self.following = True  # False once the reply is whole or cannot be known
        # The reading thread folds every FOLD_EVERY chunks, and a turn sent meanwhile from
        # another thread folds too: one at a time, so no chunk is assembled twice.
        self._lock = threading.Lock()
        # The stream binds its client's _process_response_data when the caller starts
        # iterating, which is after this (openai builds the stream, kvturn's
        # _process_response sees it, then the caller gets it).
        client = stream._client
        self._decode = client._process_response_data
        stream._client = cast(Any, StreamClient(client, self.take))
        state.pending_reply(plan, self.fold)

    def take(self, *, data: object, cast_to: type[_T], response: httpx2.Response) -> _T:
        """One chunk's JSON, on its way to openai's decoding: queued, folded now and then."""
        chunks = self.chunks
        chunks.append(data)
        if len(chunks) >= FOLD_EVERY:
            self.fold()
        result: _T = self._decode(data=data, cast_to=cast_to, response=response)
        return result

    def fold(self) -> None:
        """Assemble the queued chunks; once the reply is complete, hand it to the conversation
        and stop following (but for the usage event, when the call asked for one)."""
        replies = usage = None
        with self._lock:
            chunks = self.chunks
            count = len(chunks)  # chunks queued meanwhile stay queued
            if self.following:
                try:
                    if self._add_all(chunks[:count]):
                        self.following = False
                        replies = self.replies()
                except Exception:  # bookkeeping must never break the caller's iteration
                    self.following = False
                    log.debug("kvturn: cannot follow the stream of conversation %s; reply "
                              "left unknown", self._state.id, exc_info=True)
            if not self.following and self._plan.usage:
                usage = _last_usage(chunks, count)
            del chunks[:count]
        # Outside the lock: both take the conversation's.
        if replies is not None:
            self._state.finished(self._plan, replies)
        if usage is not None:
            self._state.settle(self._plan, usage)

    def _add_all(self, chunks: Sequence[Any]) -> bool:
        """Take chunks' JSON in order; True once the reply is complete."""
        raise NotImplementedError

    def replies(self) -> list[Any]:
        raise NotImplementedError


def _last_usage(chunks: Sequence[Any], count: int) -> Any:
    """The usage of the last of ``chunks[:count]`` that has one (vLLM sends it last, after
    every choice finished; with continuous usage every chunk has one, the last the whole)."""
    for i in range(count - 1, -1, -1):
        data = chunks[i]
        usage = data.get("usage") if isinstance(data, dict) else None
        if usage:
            return usage
    return None


class ChatFollower(StreamFollower):
    """Rebuilds the assistant message of each choice of a chat stream."""

    __slots__ = ()

    def _add_all(self, chunks: Sequence[Any]) -> bool:
        # The usual delta ({"content": piece}) takes the short way, and only a chunk that
        # finishes a choice counts the finished ones. Once all have finished nothing more of
        # the reply can come.
        parts_of, finished = self._parts, self._finished
        for data in chunks:
            for choice in data.get("choices") or ():
                index = choice.get("index", 0)
                parts = parts_of.get(index)
                if parts is None:
                    parts = parts_of[index] = _ChoiceParts()
                delta = choice.get("delta")
                if delta:
                    content = delta.get("content")
                    if content and len(delta) == 1:
                        parts.content.append(content)
                    else:
                        parts.add(delta)
                if choice.get("finish_reason") is not None:
                    finished.add(index)
                    if len(finished) >= self._expected:
                        return True
        return False

    def replies(self) -> list[Message]:
        """The assistant message of each choice, as vLLM's non-streamed reply would hold it."""
        return [self._parts[index].message() for index in sorted(self._parts)]


class _ChoiceParts:
    __slots__ = ("content", "reasoning", "refusal", "role", "tool_calls")

    def __init__(self) -> None:
        self.role = "assistant"
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        # index -> [id, name, argument pieces]
        self.tool_calls: dict[int, list[Any]] = {}

    def add(self, delta: dict[str, Any]) -> None:
        """Any delta (a lone content piece takes ChatFollower._add_all's short way)."""
        for key, value in delta.items():  # the keys it has: usually one or two
            if not value:
                continue
            if key == "content":
                self.content.append(value)
            elif key == "role":
                self.role = value
            elif key == "reasoning" or (key == "reasoning_content"
                                        and not delta.get("reasoning")):
                self.reasoning.append(value)
            elif key == "refusal":
                self.refusal.append(value)
            elif key == "tool_calls":
                self._add_calls(value)

    def _add_calls(self, calls: list[dict[str, Any]]) -> None:
        for call in calls:
            slot = self.tool_calls.get(call.get("index", 0))
            if slot is None:
                slot = self.tool_calls[call.get("index", 0)] = [None, None, []]
            if call.get("id"):
                slot[0] = call["id"]
            function = call.get("function") or {}
            if function.get("name"):
                slot[1] = function["name"]
            if function.get("arguments"):
                slot[2].append(function["arguments"])

    def message(self) -> Message:
        """The message in the shape of a parsed reply's (the continuity check normalises it
        when it compares)."""
        raw: dict[str, Any] = {"role": self.role}
        if self.content:
            raw["content"] = "".join(self.content)
        if self.refusal:
            raw["refusal"] = "".join(self.refusal)
        if self.reasoning:
            raw["reasoning"] = "".join(self.reasoning)
        if self.tool_calls:
            calls = (self.tool_calls[index] for index in sorted(self.tool_calls))
            raw["tool_calls"] = [
                {"id": call_id, "function": {"name": name, "arguments": "".join(arguments)}}
                for call_id, name, arguments in calls]
        return raw


class CompletionFollower(StreamFollower):
    """Concatenates the streamed text of each completions choice (a text prompt's: token-id
    prompts are not followed, their chunks carry no ids)."""

    __slots__ = ()

    def _add_all(self, chunks: Sequence[Any]) -> bool:
        texts, finished = self._parts, self._finished
        for data in chunks:
            for choice in data.get("choices") or ():
                index = choice.get("index", 0)
                texts.setdefault(index, []).append(choice.get("text") or "")
                if choice.get("finish_reason") is not None:
                    finished.add(index)
                    if len(finished) >= self._expected:
                        return True
        return False

    def replies(self) -> list[str]:
        """What each choice appended to the prompt (with ``echo``, the prompt is cut off)."""
        texts = ["".join(self._parts[index]) for index in sorted(self._parts)]
        turn = self._plan.turn
        if self._plan.echo and isinstance(turn, CompletionTurn):
            texts = strip_echo(texts, str(turn.prompt))
        return texts
