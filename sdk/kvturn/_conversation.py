"""``Conversation`` and ``AsyncConversation``: clients scoped to one conversation.

A scoped client *is* a ``kvturn.OpenAI`` (``AsyncOpenAI``): the whole openai API, with every
request carrying the conversation id, the continuity check on every turn, reuse reports, lease
keepalive while a tool runs (``pause``), and release of the router's retention on ``close()``.
It shares the parent's HTTP client: closing a conversation releases the retention and never
closes the connection pool.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

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

log = logging.getLogger("kvturn")

# Keepalive and release are best effort: no retries (the next heartbeat is the retry; an
# unreleased lease simply expires) and a short timeout.
_CONTROL_OPTIONS: Any = {"max_retries": 0, "timeout": CONTROL_TIMEOUT}


def _not_found(state: ConversationState, error: openai.NotFoundError) -> ConversationNotFoundError:
    body = error.body if isinstance(error.body, dict) else {}
    code = body.get("code", "no_retention")
    return ConversationNotFoundError(
        f"the router holds no live retention for conversation {state.id!r} ({code}); "
        "the next turn recomputes its prompt", response=error.response, body=error.body)


def _json(response: httpx2.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _fork_name(name: str | None) -> str:
    return secrets.token_hex(4) if name is None else validate_fork_name(name)


class Conversation(OpenAI):
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
        return self._kvturn_conversation.stats.snapshot()

    @property
    def closed(self) -> bool:
        return self._kvturn_conversation.closed

    def fork(self, name: str | None = None) -> Conversation:
        """A parallel branch: its own conversation, id ``"<this id>/<name>"``.

        The same name gives the same branch while it is open. Closing this conversation
        closes its branches too.
        """
        return self._view(self._kvturn_conversation.child(_fork_name(name)))

    def _view(self, state: ConversationState) -> Conversation:
        return self.copy(_extra_kwargs={"_kvturn_conversation": state})

    @contextmanager
    def pause(self, tool: str | None = None) -> Iterator[None]:
        """Keep the router's lease alive while the agent runs a tool between two turns.

        Renews every ``keepalive_interval`` seconds from a daemon thread; overlapping pauses
        share one loop, which stops when the last one exits (also on an exception). Keepalive
        failures are logged and counted in ``stats``, never raised.

        >>> with chat.pause("web_search"):  # doctest: +SKIP
        ...     results = web_search(query)
        """
        state = self._kvturn_conversation
        if state.closed:
            yield
            return
        heartbeat = state.ensure_heartbeat(lambda: Heartbeat(
            self._renew_quietly, state.keepalive_interval, name=f"kvturn-keepalive:{state.id}"))
        log.debug("kvturn: conversation %s paused for %s", state.id, tool or "a tool")
        heartbeat.hold()
        try:
            yield
        finally:
            heartbeat.release()

    def keepalive(self) -> Lease:
        """Renew the lease now. Raises ``ConversationNotFoundError`` when the router holds no
        retention for this conversation (nothing to keep; the next turn recomputes)."""
        state = self._kvturn_conversation
        try:
            response = self.post(conversation_url(self._kvturn_root, state.id, "keepalive"),
                                 cast_to=httpx2.Response, options=_CONTROL_OPTIONS)
        except openai.NotFoundError as error:
            state.stats.add("keepalive_failures")
            raise _not_found(state, error) from error
        except Exception:
            state.stats.add("keepalive_failures")
            raise
        state.stats.add("keepalives")
        return Lease.from_json(state.id, _json(response))

    def _renew_quietly(self) -> None:
        try:
            self.keepalive()
        except ConversationNotFoundError as error:
            log.info("kvturn: keepalive: %s", error)
        except Exception as error:
            log.warning("kvturn: keepalive of %s failed: %r", self.id, error)

    def close(self) -> None:
        """Release the router's retention of this conversation and of its open forks.

        Idempotent and never raises (a failed release is logged and counted: the lease then
        simply expires). Keeps the shared HTTP client open; close the parent client for that.
        """
        for state in self._kvturn_conversation.open_tree():
            if not state.close():
                continue
            if state.heartbeat is not None:
                state.heartbeat.stop()
            # Each release goes through a view of its own conversation, so the request's
            # X-Conversation-ID matches the id in the path.
            view = self if state is self._kvturn_conversation else self._view(state)
            try:
                view.delete(conversation_url(self._kvturn_root, state.id),
                            cast_to=httpx2.Response, options=_CONTROL_OPTIONS)
            except Exception as error:
                state.stats.add("release_failures")
                log.warning("kvturn: release of %s failed (its lease will expire): %r",
                            state.id, error)
            state.forget()


class AsyncConversation(AsyncOpenAI):
    """A ``kvturn.AsyncOpenAI`` scoped to one conversation; the async twin of
    ``Conversation``.

    >>> async with client.conversation() as chat:  # doctest: +SKIP
    ...     reply = await chat.chat.completions.create(model="kvturn-tiny", messages=messages)
    ...     async with chat.pause("search_flights"):
    ...         result = await search_flights()
    """

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
        return self._kvturn_conversation.stats.snapshot()

    @property
    def closed(self) -> bool:
        return self._kvturn_conversation.closed

    def fork(self, name: str | None = None) -> AsyncConversation:
        """A parallel branch: its own conversation, id ``"<this id>/<name>"``."""
        return self._view(self._kvturn_conversation.child(_fork_name(name)))

    def _view(self, state: ConversationState) -> AsyncConversation:
        return self.copy(_extra_kwargs={"_kvturn_conversation": state})

    @asynccontextmanager
    async def pause(self, tool: str | None = None) -> AsyncIterator[None]:
        """Keep the lease alive while a tool runs: one asyncio task per conversation, shared
        by overlapping pauses, cancelled when the last exits (also on an exception or a
        cancellation). Failures are logged and counted, never raised."""
        state = self._kvturn_conversation
        if state.closed:
            yield
            return
        heartbeat = state.ensure_heartbeat(lambda: AsyncHeartbeat(
            self._renew_quietly, state.keepalive_interval, name=f"kvturn-keepalive:{state.id}"))
        log.debug("kvturn: conversation %s paused for %s", state.id, tool or "a tool")
        heartbeat.hold()
        try:
            yield
        finally:
            await heartbeat.release()

    async def keepalive(self) -> Lease:
        """Renew the lease now (see ``Conversation.keepalive``)."""
        state = self._kvturn_conversation
        try:
            response = await self.post(
                conversation_url(self._kvturn_root, state.id, "keepalive"),
                cast_to=httpx2.Response, options=_CONTROL_OPTIONS)
        except openai.NotFoundError as error:
            state.stats.add("keepalive_failures")
            raise _not_found(state, error) from error
        except Exception:
            state.stats.add("keepalive_failures")
            raise
        state.stats.add("keepalives")
        return Lease.from_json(state.id, _json(response))

    async def _renew_quietly(self) -> None:
        try:
            await self.keepalive()
        except ConversationNotFoundError as error:
            log.info("kvturn: keepalive: %s", error)
        except Exception as error:
            log.warning("kvturn: keepalive of %s failed: %r", self.id, error)

    async def close(self) -> None:
        """Release the retention of this conversation and its open forks (see
        ``Conversation.close``); keeps the shared HTTP client open."""
        for state in self._kvturn_conversation.open_tree():
            if not state.close():
                continue
            if state.heartbeat is not None:
                await state.heartbeat.stop()
            view = self if state is self._kvturn_conversation else self._view(state)
            try:
                await view.delete(conversation_url(self._kvturn_root, state.id),
                                  cast_to=httpx2.Response, options=_CONTROL_OPTIONS)
            except Exception as error:
                state.stats.add("release_failures")
                log.warning("kvturn: release of %s failed (its lease will expire): %r",
                            state.id, error)
            state.forget()


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
