"""Seeing the reply of a turn, whatever form openai returned it in.

* parsed ``ChatCompletion`` / ``Completion``: the reply is recorded at once;
* ``Stream`` / ``AsyncStream``: followed chunk by chunk as the caller iterates, the reply
  recorded once the chunks assembled give every choice its ``finish_reason`` (``_streams``);
* ``with_raw_response`` (``LegacyAPIResponse``): parsed now (openai caches the result, so the
  caller's ``parse()`` returns the same object), then as above;
* ``with_streaming_response`` (``APIResponse``): the body is the caller's to read, so the reply
  stays unknown and the next turn gets a prefix-only check.
"""

from __future__ import annotations

from typing import Any

import httpx2
from openai import AsyncStream, BaseModel, Stream

from kvturn._compat import APIResponse, AsyncAPIResponse, LegacyAPIResponse
from kvturn._continuity import CompletionTurn, chat_replies, completion_replies
from kvturn._state import ConversationState, TurnPlan
from kvturn._streams import ChatFollower, CompletionFollower


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
    if plan.api == "chat":
        ChatFollower(state, plan, stream)
    else:
        CompletionFollower(state, plan, stream)
