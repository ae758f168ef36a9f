"""``Conversation`` and ``AsyncConversation``: clients scoped to one conversation.

A scoped client *is* a ``kvturn.OpenAI`` (``AsyncOpenAI``): the whole openai API, with every
request carrying the conversation id, reuse reports, lease
keepalive while a tool runs (``pause``), and release of the router's retention on ``close()``.
It shares the parent's HTTP client: closing a conversation releases the retention and never
closes the connection pool.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, Self, TypeVar

import httpx2
import openai

from kvturn._client import AsyncOpenAI, OpenAI
from kvturn._constants import CONTROL_TIMEOUT
from kvturn._endpoints import conversation_url
from kvturn._errors import ConversationNotFoundError
from kvturn._identity import validate_fork_name
from kvturn._keepalive import AsyncHeartbeat, Heartbeat
from kvturn._state import ConversationState
from kvturn._turns import ConversationStats, Lease, TurnInfo
from kvturn.wire import KEEPALIVE, GoneReason

if TYPE_CHECKING:
    from kvturn._base_client import KVTurnClientBase as _Client
else:
    _Client = object

_H = TypeVar("_H", Heartbeat, AsyncHeartbeat)

log = logging.getLogger("kvturn")

# Keepalive and release are best effort: no retries (the next heartbeat is the retry; an
# unreleased lease simply expires) and a short timeout.
_CONTROL_OPTIONS: Any = {"max_retries": 0, "timeout": CONTROL_TIMEOUT}


def _not_found(state: ConversationState, error: openai.NotFoundError) -> ConversationNotFoundError:
    body = error.body if isinstance(error.body, dict) else {}
    code = body.get("code", GoneReason.NO_RETENTION)
    return ConversationNotFoundError(
        f"the router holds no live retention for conversation {state.id!r} ({code}); "
        "the next turn recomputes its prompt", response=error.response, body=error.body)


def _lease(state: ConversationState, response: httpx2.Response) -> Lease:
    try:
        body = response.json()
    except ValueError:
        body = None
    return Lease.from_json(state.id, body)


def _fork_name(name: str | None) -> str:
    return secrets.token_hex(4) if name is None else validate_fork_name(name)


@contextmanager
def _counted_keepalive(state: ConversationState) -> Iterator[None]:
    """Count a keepalive's outcome; a ``404`` becomes ``ConversationNotFoundError``."""
    try:
        yield
    except openai.NotFoundError as error:
        state.stats.add("keepalive_failures")
        raise _not_found(state, error) from error
    except Exception:
        state.stats.add("keepalive_failures")
        raise
    state.stats.add("keepalives")


@contextmanager
def _quiet_renewal(conversation_id: str) -> Iterator[None]:
    """A heartbeat's renewal: failures are logged (and were counted), never raised."""
    try:
        yield
    except ConversationNotFoundError as error:
        log.info("kvturn: keepalive: %s", error)
    except Exception as error:
        log.warning("kvturn: keepalive of %s failed: %r", conversation_id, error)


@contextmanager
def _logged_release(state: ConversationState) -> Iterator[None]:
    """A release: a failure is logged and counted, never raised (the lease then expires)."""
    try:
        yield
    except Exception as error:
        state.stats.add("release_failures")
        log.warning("kvturn: release of %s failed (its lease will expire): %r", state.id, error)


class _ScopedBase(_Client):
    """What ``Conversation`` and ``AsyncConversation`` share; it comes first in their bases."""

    _kvturn_conversation: ConversationState

    @property
    def id(self) -> str:
        """The conversation id sent with every request."""
        return self._kvturn_conversation.id

    @property
    def last_turn(self) -> TurnInfo | None:
        """The router's report on the latest turn (set when its response starts)."""
        return self._kvturn_conversation.last_turn

    @property
    def stats(self) -> ConversationStats:
        """Counters of this conversation: turns, reused tokens, outcomes, misses, retries."""
        return self._kvturn_conversation.snapshot()

    @property
    def closed(self) -> bool:
        return self._kvturn_conversation.closed

    def fork(self, name: str | None = None) -> Self:
        """A parallel branch: its own conversation, id ``"<this id>/<name>"``.

        The same name gives the same branch while it is open. Closing this conversation
        closes its branches too.
        """
        return self._view(self._kvturn_conversation.child(_fork_name(name)))

    def _view(self, state: ConversationState) -> Self:
        return self.copy(_extra_kwargs={"_kvturn_conversation": state})

    def _keepalive_url(self) -> str:
        return conversation_url(self._kvturn_root, self.id, KEEPALIVE)

    def _held_heartbeat(self, kind: type[_H], renew: Callable[[], Any],
                        tool: str | None) -> _H | None:
        """The conversation's heartbeat, held by one more pause; None once it is closed."""
        state = self._kvturn_conversation
        if state.closed:
            return None
        heartbeat = state.ensure_heartbeat(lambda: kind(
            renew, state.keepalive_interval, name=f"kvturn-keepalive:{state.id}"))
        log.debug("kvturn: conversation %s paused for %s", state.id, tool or "a tool")
        heartbeat.hold()
        return heartbeat

    def _releases(self) -> Iterator[tuple[ConversationState, Self, str]]:
        """This conversation and its open forks, forks first, each closed once: the state,
        the view to release it through (its X-Conversation-ID must match the id in the path)
        and the release URL. The caller stops the heartbeat and sends the release."""
        for state in self._kvturn_conversation.open_tree():
            if not state.close():
                continue
            view = self if state is self._kvturn_conversation else self._view(state)
            yield state, view, conversation_url(self._kvturn_root, state.id)


class Conversation(_ScopedBase, OpenAI):
    """A ``kvturn.OpenAI`` scoped to one conversation. Get one from ``client.conversation()``.

    >>> with client.conversation() as chat:  # doctest: +SKIP
    ...     messages = [{"role": "user", "content": "Plan a trip to Lisbon."}]
    ...     reply = chat.chat.completions.create(model="kvturn-tiny", messages=messages)
    ...     messages.append(reply.choices[0].message)      # the reply, exactly as received
    ...     with chat.pause("search_flights"):              # lease renewed while the tool runs
    ...         messages.append({"role": "tool", "tool_call_id": "1", "content": search()})
    ...     chat.chat.completions.create(model="kvturn-tiny", messages=messages)
    ...     print(chat.last_turn.reuse, chat.last_turn.reused_tokens, chat.stats.misses)
    """

    @contextmanager
    def pause(self, tool: str | None = None) -> Iterator[None]:
        """Keep the router's lease alive while the agent runs a tool between two turns.

        Renews every ``keepalive_interval`` seconds from a daemon thread; overlapping pauses
        share one loop, which stops when the last one exits (also on an exception). Keepalive
        failures are logged and counted in ``stats``, never raised.

        >>> with chat.pause("web_search"):  # doctest: +SKIP
        ...     results = web_search(query)
        """
        heartbeat = self._held_heartbeat(Heartbeat, self._renew_quietly, tool)
        try:
            yield
        finally:
            if heartbeat is not None:
                heartbeat.release()

    def keepalive(self) -> Lease:
        """Renew the lease now. Raises ``ConversationNotFoundError`` when the router holds no
        retention for this conversation (nothing to keep; the next turn recomputes)."""
        with _counted_keepalive(self._kvturn_conversation):
            response = self.post(self._keepalive_url(), cast_to=httpx2.Response,
                                 options=_CONTROL_OPTIONS)
        return _lease(self._kvturn_conversation, response)

    def _renew_quietly(self) -> None:
        with _quiet_renewal(self.id):
            self.keepalive()

    def close(self) -> None:
        """Release the router's retention of this conversation and of its open forks.

        Idempotent and never raises (a failed release is logged and counted: the lease then
        simply expires). Keeps the shared HTTP client open; close the parent client for that.
        """
        for state, view, url in self._releases():
            if state.heartbeat is not None:
                state.heartbeat.stop()
            with _logged_release(state):
                view.delete(url, cast_to=httpx2.Response, options=_CONTROL_OPTIONS)


class AsyncConversation(_ScopedBase, AsyncOpenAI):
    """A ``kvturn.AsyncOpenAI`` scoped to one conversation; the async twin of
    ``Conversation``.

    >>> async with client.conversation() as chat:  # doctest: +SKIP
    ...     reply = await chat.chat.completions.create(model="kvturn-tiny", messages=messages)
    ...     async with chat.pause("search_flights"):
    ...         result = await search_flights()
    """

    @asynccontextmanager
    async def pause(self, tool: str | None = None) -> AsyncIterator[None]:
        """Keep the lease alive while a tool runs: one asyncio task per conversation, shared
        by overlapping pauses, cancelled when the last exits (also on an exception or a
        cancellation). Failures are logged and counted, never raised."""
        heartbeat = self._held_heartbeat(AsyncHeartbeat, self._renew_quietly, tool)
        try:
            yield
        finally:
            if heartbeat is not None:
                await heartbeat.release()

    async def keepalive(self) -> Lease:
        """Renew the lease now (see ``Conversation.keepalive``)."""
        with _counted_keepalive(self._kvturn_conversation):
            response = await self.post(self._keepalive_url(), cast_to=httpx2.Response,
                                       options=_CONTROL_OPTIONS)
        return _lease(self._kvturn_conversation, response)

    async def _renew_quietly(self) -> None:
        with _quiet_renewal(self.id):
            await self.keepalive()

    async def close(self) -> None:
        """Release the retention of this conversation and its open forks (see
        ``Conversation.close``); keeps the shared HTTP client open."""
        for state, view, url in self._releases():
            if state.heartbeat is not None:
                await state.heartbeat.stop()
            with _logged_release(state):
                await view.delete(url, cast_to=httpx2.Response, options=_CONTROL_OPTIONS)


_SCOPED: dict[type, type] = {OpenAI: Conversation, AsyncOpenAI: AsyncConversation}


def scoped_class(cls: type) -> type:
    """The class of a conversation-scoped client built by ``cls`` (``OpenAI.__new__``).

    ``Conversation`` for ``kvturn.OpenAI``; for a user's subclass, a class deriving from both,
    so its overrides keep working inside conversations.
    """
    if issubclass(cls, Conversation | AsyncConversation):
        return cls
    scoped = _SCOPED.get(cls)
    if scoped is None:
        base = Conversation if issubclass(cls, OpenAI) else AsyncConversation
        scoped = _SCOPED[cls] = type(f"{cls.__name__}Conversation", (base, cls), {})
    return scoped
