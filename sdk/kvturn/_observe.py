"""Seeing the reply of a turn, whatever form openai returned it in, without buffering a stream.

* parsed ``ChatCompletion`` / ``Completion``: the reply is recorded at once;
* ``Stream`` / ``AsyncStream``: openai hands every chunk's JSON to the client's
  ``_process_response_data`` as the caller iterates; kvturn's override queues it on a
  ``StreamFollower`` stored in that response's ``extensions`` (under ``FOLLOW_KEY``), which
  assembles the queue every ``FOLD_EVERY`` chunks and, for what is left, before the
  conversation's next turn; the reply is recorded once every choice has its
  ``finish_reason``. Nothing is held back from the caller, no extra iterator layer is added,
  and a stream abandoned or cut before the end leaves the reply unknown;
* ``with_raw_response`` (``LegacyAPIResponse``): parsed now (openai caches the result, so the
  caller's ``parse()`` returns the same object), then as above;
* ``with_streaming_response`` (``APIResponse``): the body is the caller's to read, so the reply
  stays unknown and the next turn gets a prefix-only check.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Final

import httpx2
from openai import AsyncStream, BaseModel, Stream

from kvturn._compat import APIResponse, AsyncAPIResponse, LegacyAPIResponse
from kvturn._continuity import (
    ChatReplyAssembler,
    CompletionReplyAssembler,
    CompletionTurn,
    chat_replies,
    completion_replies,
    strip_echo,
)
from kvturn._state import ConversationState, TurnPlan

log = logging.getLogger("kvturn")

# Where a stream's follower lives: in its own response's ``extensions`` dict, so that it goes
# with the response (an abandoned stream keeps nothing alive) and each chunk finds it with one
# dict lookup (this runs once per streamed chunk).
FOLLOW_KEY: Final = "kvturn.follow"
# Chunks queued before they are assembled: bounds the memory a long stream holds, and is large
# enough that the per-fold cost is spread thin.
FOLD_EVERY: Final = 64


def observe_turn(state: ConversationState, plan: TurnPlan, response: httpx2.Response,
                 result: Any, *, attempts: int, streamed: bool) -> None:
    """Record the turn the router answered with ``response`` and arrange for ``state`` to
    learn the reply carried by ``result``, openai's processed response."""
    if isinstance(result, BaseModel):  # the usual case first: a parsed completion
        state.started(plan, response, attempts=attempts, streamed=streamed,
                      replies=_parsed_replies(plan, result))
        return
    if isinstance(result, LegacyAPIResponse):
        try:
            result = result.parse()
        except Exception:  # the caller's own parse() will raise the same error
            result = None
    if isinstance(result, Stream | AsyncStream):
        state.started(plan, response, attempts=attempts, streamed=streamed)
        _follow_stream(state, plan, result)
        return
    known = result is not None and not isinstance(result, APIResponse | AsyncAPIResponse)
    state.started(plan, response, attempts=attempts, streamed=streamed,
                  replies=_parsed_replies(plan, result) if known else None)


def _parsed_replies(plan: TurnPlan, result: Any) -> Any:
    if plan.api == "chat":
        return chat_replies(result)
    if isinstance(plan.turn, CompletionTurn):
        return completion_replies(result, plan.turn, plan.echo)
    return None


def _follow_stream(state: ConversationState, plan: TurnPlan,
                   stream: Stream[Any] | AsyncStream[Any]) -> None:
    turn = plan.turn
    if turn is None or (isinstance(turn, CompletionTurn) and not isinstance(turn.prompt, str)):
        return  # untracked, or token ids (streamed chunks carry none): the reply stays unknown
    assembler: ChatReplyAssembler | CompletionReplyAssembler = (
        ChatReplyAssembler(plan.choices) if plan.api == "chat"
        else CompletionReplyAssembler(plan.choices))
    follower = StreamFollower(state, plan, assembler, stream.response.extensions)
    stream.response.extensions[FOLLOW_KEY] = follower
    state.pending_reply(follower.fold)


class StreamFollower:
    """The reply of one stream, being seen: the client's ``_process_response_data`` queues each
    chunk's JSON in ``chunks`` (a list append; no assembling per chunk) and calls ``fold``
    every ``FOLD_EVERY`` chunks; the conversation folds the rest before its next turn needs
    the reply. Holds no reference to the response (the response holds it)."""

    __slots__ = ("_assembler", "_extensions", "_lock", "_plan", "_state", "chunks")

    def __init__(self, state: ConversationState, plan: TurnPlan,
                 assembler: ChatReplyAssembler | CompletionReplyAssembler,
                 extensions: dict[str, Any]) -> None:
        self.chunks: list[Any] = []
        self._state, self._plan = state, plan
        self._assembler = assembler
        self._extensions = extensions
        # The reading thread folds every FOLD_EVERY chunks, and a turn sent meanwhile from
        # another thread folds too: one at a time, so no chunk is assembled twice.
        self._lock = threading.Lock()

    def fold(self) -> None:
        """Assemble the queued chunks; once the reply is complete, hand it to the conversation
        and stop following (later chunks, such as usage, are not needed)."""
        with self._lock:
            if self._extensions.get(FOLLOW_KEY) is not self:
                return  # stopped: the reply was handed over, or cannot be known
            try:
                replies = self._assemble()
            except Exception:  # bookkeeping must never break the caller's iteration
                replies = None
                log.debug("kvturn: cannot follow the stream of conversation %s; reply left "
                          "unknown", self._state.id, exc_info=True)
                self._stop()
        if replies is not None:
            # Outside the lock: finished() takes the conversation's.
            self._state.finished(self._plan, replies)

    def _assemble(self) -> Any:
        """The reply, once the queued chunks complete it (following then stops); else None."""
        chunks = self.chunks
        count = len(chunks)  # chunks queued meanwhile stay queued
        complete = self._assembler.add_all(chunks[:count])
        del chunks[:count]
        if not complete:
            return None
        self._stop()
        replies: Any = self._assembler.replies()
        turn = self._plan.turn
        if isinstance(turn, CompletionTurn) and self._plan.echo:
            replies = strip_echo(replies, str(turn.prompt))
        return replies

    def _stop(self) -> None:
        self._extensions.pop(FOLLOW_KEY, None)
        self.chunks.clear()
