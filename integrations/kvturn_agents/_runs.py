"""Which kvturn conversation a model call of the Agents SDK belongs to, and its lease.

The Agents SDK gives every ``Runner.run`` (and ``run_streamed``) one run owner object: it is
current while the run's model calls execute (``get_model_run_owner``) and is handed to each
model's ``_cleanup_on_run_end`` when the run ends, whatever way it ends (the SDK calls it from
a ``finally``). kvturn keys one ``RunLease`` on it:

* the run's first model call opens the conversation (a random id, or the enclosing
  ``conversation()`` scope's, below);
* between two model calls of the run (its tools, handoffs and guardrails run there) the lease
  is held by the SDK's own keepalive (``AsyncConversation.pause``), one loop per conversation;
* the run's end stops that loop and releases the conversation, unless a scope owns it.

A ``conversation()`` scope lends its conversation to the runs started inside it, one run at a
time: an SDK ``Session`` runs one ``Runner.run`` per user message, and all of them extend the
same token sequence, so they share the scope's conversation and its KV. A run started while
another run holds the scope (an agent used as a tool inside that run) is a different token
sequence and gets a conversation of its own.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from agents.models._run_context import get_model_run_owner

import kvturn

# What the model calls between two turns of a run do, as the keepalive logs name it.
_BETWEEN_TURNS = "agent tools"


@dataclass(eq=False, slots=True)
class RunLease:
    """One run's use of one conversation: its keepalive between turns and its release."""

    conversation: kvturn.AsyncConversation
    owned: bool
    """Released when the run ends (False: a ``conversation()`` scope releases it)."""
    scope: Scope | None = None
    _pause: AbstractAsyncContextManager[None] | None = None

    async def hold(self) -> None:
        """Keep the lease alive until the run's next model call (or its end)."""
        if self._pause is None and not self.conversation.closed:
            pause = self.conversation.pause(_BETWEEN_TURNS)
            await pause.__aenter__()
            self._pause = pause

    async def resume(self) -> None:
        """A model call starts: the keepalive between turns stops."""
        pause, self._pause = self._pause, None
        if pause is not None:
            await pause.__aexit__(None, None, None)

    async def finish(self) -> None:
        await self.resume()
        if self.scope is not None:
            self.scope.busy = False
        if self.owned:
            await self.conversation.close()


@dataclass(eq=False, slots=True)
class Scope:
    """A conversation lent to the runs started inside ``conversation()``, one at a time."""

    conversation: kvturn.AsyncConversation
    busy: bool = False


_SCOPE: ContextVar[Scope | None] = ContextVar("kvturn_agents_scope", default=None)


@dataclass(eq=False)
class RunLeases:
    """The leases of the runs in flight, keyed by the SDK's run owner (weakly: an owner
    dropped without a cleanup leaves nothing behind here)."""

    client: kvturn.AsyncOpenAI
    keepalive_interval: float | None = None
    _runs: weakref.WeakKeyDictionary[object, RunLease] = field(
        default_factory=weakref.WeakKeyDictionary)

    def current(self) -> tuple[object | None, RunLease | None]:
        """The run owner of the model call executing now and its lease (if it has one)."""
        owner = get_model_run_owner()
        return owner, None if owner is None else self._runs.get(owner)

    def open(self, owner: object | None) -> RunLease:
        """The lease of ``owner``'s run, opened at its first model call. A call outside any
        run (``owner`` None) gets a conversation of its own, which the caller finishes."""
        lease = None if owner is None else self._runs.get(owner)
        if lease is not None:
            return lease
        scope = _SCOPE.get()
        if scope is not None and not scope.busy and not scope.conversation.closed:
            scope.busy = True
            lease = RunLease(scope.conversation, owned=False, scope=scope)
        else:
            lease = RunLease(self.client.conversation(
                keepalive_interval=self.keepalive_interval), owned=True)
        if owner is not None:
            self._runs[owner] = lease
        return lease

    async def finish(self, owner: object) -> None:
        """The run of ``owner`` ended: stop its keepalive, release what it owns."""
        lease = self._runs.pop(owner, None)
        if lease is not None:
            await lease.finish()

    @asynccontextmanager
    async def scope(self, id: str | None) -> AsyncIterator[kvturn.AsyncConversation]:
        """Lend one conversation to the runs started inside (see the module docstring)."""
        async with self.client.conversation(
                id, keepalive_interval=self.keepalive_interval) as conversation:
            token = _SCOPE.set(Scope(conversation))
            try:
                yield conversation
            finally:
                _SCOPE.reset(token)
