"""The integration tests' fake router (``tests/fakes/agent_router.py``), plus what the tests
check of the histories the integrations send: ``breaks``.

The kvturn SDK sends every turn as the caller built it (docs/sdk.md, "Edited histories"), so
whether an integration resends its history exactly is for these tests to see: the router lets
the decode continue a turn only when its messages start with the previous turn's, byte for
byte (the router's message digests), and the prefill reads retained KV only up to the first
token that differs, so a history resent otherwise costs reuse without any error.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx2

from tests.fakes.agent_router import CHAT, ToolCallingRouter
from tests.fakes.router_api import Recorded

__all__ = ["FakeRouter", "Recorded", "breaks"]


class FakeRouter(ToolCallingRouter):
    """``ToolCallingRouter`` that also keeps the reply it gave each chat turn (``replies``, by
    the ``id`` of the turn's ``Recorded``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replies: dict[int, dict[str, Any]] = {}
        self._answer = threading.local()  # the reply of the turn this thread is answering

    def _reply(self, body: dict[str, Any], rounds: int | None = None) -> dict[str, Any]:
        message = super()._reply(body, rounds)
        self._answer.message = message
        return message

    def handle_turn(self, recorded: Recorded) -> httpx2.Response:
        self._answer.message = None
        response = super().handle_turn(recorded)
        if recorded.path == CHAT and self._answer.message is not None:
            with self._changed:
                self.replies[id(recorded)] = self._answer.message
        return response


def breaks(router: FakeRouter) -> list[tuple[int, str]]:
    """The chat turns (index in ``router.turns()``, and why) that do not extend their
    conversation's previous chat turn exactly: its messages as sent (``history``), then the
    reply the router gave, with its text and tool-call ids, names and argument strings as
    written (``reply``)."""
    last: dict[str, tuple[list[Any], dict[str, Any] | None]] = {}
    found = []
    for index, turn in enumerate(router.turns()):
        if turn.path != CHAT or turn.conversation is None:
            continue
        messages = turn.body["messages"]
        previous = last.get(turn.conversation)
        last[turn.conversation] = (messages, router.replies.get(id(turn)))
        if previous is None:
            continue
        before, reply = previous
        if messages[:len(before)] != before:
            found.append((index, "history"))
        elif (len(messages) <= len(before) or reply is None
              or _reply_form(messages[len(before)]) != _reply_form(reply)):
            found.append((index, "reply"))
    return found


def _reply_form(message: dict[str, Any]) -> tuple[Any, ...]:
    calls = [(call.get("id"), call["function"]["name"], call["function"]["arguments"])
             for call in message.get("tool_calls") or ()]
    return message.get("role"), message.get("content") or None, calls
