"""The kvturn conversations of LangGraph threads, for one kvturn client (sync and/or async).

A thread's conversation and its forks are the SDK's own ``Conversation`` objects (one per path
and flavour, created on first use and kept while the thread is live), so every SDK feature
applies unchanged: reuse reports, retries, ``pause()`` and ``close()``.
This module only decides which object a path maps to, and settles a thread when the root run
that used it last ends (``LeasePolicy``): release, keep, or hold the lease until the thread
resumes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import openai

import kvturn
from kvturn_langgraph._ids import ConversationPath
from kvturn_langgraph._lifecycle import TRACKER, RootRun
from kvturn_langgraph._policy import LeasePolicy

log = logging.getLogger("kvturn.langgraph")

Forks = tuple[str, ...]
View = kvturn.Conversation | kvturn.AsyncConversation
_V = TypeVar("_V", kvturn.Conversation, kvturn.AsyncConversation)
_C = TypeVar("_C", kvturn.OpenAI, kvturn.AsyncOpenAI)

# Threads kept in memory per client (least recently used first out). Dropping one forgets its
# counters; the router's lease then simply runs out.
MAX_THREADS = 1024

# Background releases (async conversations settled from a sync callback) must not be garbage
# collected before they finish.
_BACKGROUND: set[asyncio.Task[Any]] = set()


class _Thread:
    __slots__ = ("async_views", "hold", "id", "policy", "run", "sync_views", "used")

    def __init__(self, conversation_id: str, policy: LeasePolicy) -> None:
        self.id = conversation_id
        self.policy = policy
        self.run: RootRun | None = None
        self.sync_views: dict[Forks, kvturn.Conversation] = {}
        self.async_views: dict[Forks, kvturn.AsyncConversation] = {}
        # (async?, forks) of the views that carried turns or stamps
        self.used: set[tuple[bool, Forks]] = set()
        self.hold: _Hold | None = None


class _Hold:
    """Renews the leases of an interrupted thread until it resumes, for at most ``max_hold``.

    The SDK's keepalive loop (``kvturn.Heartbeat``, a daemon thread) with the sync client: it
    must outlive the event loop of an async run that was interrupted (``asyncio.run`` returns
    before the human answers). Unlike a ``pause()``, a hold gives up on a conversation the
    router no longer holds or whose client is closed, and stops when none is left.
    """

    def __init__(self, owner: Conversations, views: list[kvturn.Conversation], interval: float,
                 max_hold: float, name: str) -> None:
        # The registry stays alive while it holds, so that the thread's next run (in this
        # process) still finds it and stops the hold.
        self._owner = owner
        self._live = list(views)
        self._interval = interval
        self._deadline = time.monotonic() + max_hold
        self._heartbeat = kvturn.Heartbeat(self._renew, interval, name)
        self._heartbeat.hold()

    def stop(self) -> None:
        self._heartbeat.stop()

    def join(self, timeout: float) -> bool:
        return self._heartbeat.join(timeout)

    def _renew(self) -> None:
        for view in list(self._live):
            try:
                view.keepalive()
            except kvturn.ConversationNotFoundError:
                self._live.remove(view)  # nothing left to hold (expired, evicted, released)
            except (openai.APIConnectionError, openai.APIStatusError) as error:
                log.warning("kvturn: holding %s failed (retried next round): %r",
                            view.id, error)
            except Exception as error:  # e.g. the client was closed: give up
                log.info("kvturn: stopped holding %s: %r", view.id, error)
                self._live.remove(view)
        # The loop ends with the last renewal due before max_hold (or with the first, when
        # max_hold is shorter than the interval).
        if not self._live or time.monotonic() + self._interval > self._deadline:
            self._heartbeat.stop()


class Conversations:
    """Maps ``ConversationPath``s to the SDK conversations of one kvturn client."""

    def __init__(self, client: kvturn.OpenAI | None = None,
                 async_client: kvturn.AsyncOpenAI | None = None) -> None:
        self.client = client
        self.async_client = async_client
        self._lock = threading.Lock()
        self._threads: OrderedDict[str, _Thread] = OrderedDict()
        TRACKER.watch(self)

    # --- model calls -------------------------------------------------------------------------

    def sync(self, path: ConversationPath, run: RootRun | None,
             policy: LeasePolicy) -> kvturn.Conversation:
        """The sync conversation for a turn on ``path`` (the thread is live again)."""
        return self._for_turn(path, run, policy, self._sync_view, asynchronous=False)

    def aio(self, path: ConversationPath, run: RootRun | None,
            policy: LeasePolicy) -> kvturn.AsyncConversation:
        """The async conversation for a turn on ``path``."""
        return self._for_turn(path, run, policy, self._async_view, asynchronous=True)

    def keepalive_views(self, path: ConversationPath, *, asynchronous: bool) -> list[View]:
        """What to ``pause()`` while a tool of ``path`` runs: the conversation that carried the
        path's turns (nothing when it had none in this process)."""
        with self._lock:
            thread = self._threads.get(path.root)
            if thread is None:
                return []
            used_sync = (False, path.forks) in thread.used
            used_async = (True, path.forks) in thread.used
            if asynchronous and used_async:
                return [self._async_view(thread, path.forks)]
            if used_sync or (used_async and self.client is not None):
                # A sync twin of an async conversation: a keepalive carries no turn state.
                return [self._sync_view(thread, path.forks)]
            return []

    # --- settling (called by the tracker) ----------------------------------------------------

    def adopt(self, conversation_id: str, run: RootRun) -> None:
        """A new root run started on a thread this registry knows: it now owns the thread
        (a hold, if any, goes on until the thread's next turn or the end of this run)."""
        with self._lock:
            thread = self._threads.get(conversation_id)
            if thread is None:
                return
            thread.run = run
        run.note(self)

    def finish_run(self, run: RootRun, *, interrupted: bool) -> None:
        """Settle the threads whose last run was ``run`` by their policy."""
        released: list[_Thread] = []
        held: list[_Thread] = []
        with self._lock:
            for thread in list(self._threads.values()):
                if thread.run is not run:
                    continue
                thread.run = None
                policy = thread.policy
                action = policy.on_interrupt if interrupted else policy.on_end
                if action == "release":
                    del self._threads[thread.id]
                    released.append(thread)
                elif action == "hold":
                    held.append(thread)
                elif thread.hold is not None:  # "keep": a resumed run ended, hold no more
                    thread.hold.stop()
                    thread.hold = None
        for thread in released:
            self._release(thread)
        for thread in held:
            self._hold(thread)

    def release(self, conversation_id: str) -> bool:
        """Release a thread's conversation and forks now; False if none is live here."""
        with self._lock:
            thread = self._threads.pop(conversation_id, None)
        if thread is None:
            return False
        self._release(thread)
        return True

    # --- internals ---------------------------------------------------------------------------

    def _use(self, conversation_id: str, run: RootRun | None, policy: LeasePolicy) -> _Thread:
        thread = self._threads.get(conversation_id)
        if thread is None:
            thread = self._threads[conversation_id] = _Thread(conversation_id, policy)
            while len(self._threads) > MAX_THREADS:
                _, dropped = self._threads.popitem(last=False)
                if dropped.hold is not None:
                    dropped.hold.stop()
                log.debug("kvturn: forgetting conversation %s (%d threads live)", dropped.id,
                          MAX_THREADS)
        else:
            self._threads.move_to_end(conversation_id)
        thread.policy = policy
        if run is not None:
            thread.run = run
        if thread.hold is not None:  # the thread resumed
            thread.hold.stop()
            thread.hold = None
        return thread

    def _for_turn(self, path: ConversationPath, run: RootRun | None, policy: LeasePolicy,
                  view_of: Callable[[_Thread, Forks], _V], *, asynchronous: bool) -> _V:
        with self._lock:
            thread = self._use(path.root, run, policy)
            view = view_of(thread, path.forks)
            thread.used.add((asynchronous, path.forks))
        if run is not None:
            run.note(self)
        return view

    def _sync_view(self, thread: _Thread, forks: Forks) -> kvturn.Conversation:
        return _view(thread.sync_views, forks,
                     lambda: _needed(self.client, "sync").conversation(thread.id))

    def _async_view(self, thread: _Thread, forks: Forks) -> kvturn.AsyncConversation:
        return _view(thread.async_views, forks,
                     lambda: _needed(self.async_client, "async").conversation(thread.id))

    def _release(self, thread: _Thread) -> None:
        if thread.hold is not None:
            thread.hold.stop()
            thread.hold = None
        # Parents first: closing one closes its forks, so their own close is a no-op.
        for is_async, forks in sorted(thread.used, key=lambda used: len(used[1])):
            if not is_async:
                thread.sync_views[forks].close()
                continue
            view = thread.async_views[forks]
            if view.closed:
                continue
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                _in_background(loop, view.close())
            elif self.client is not None:
                self._sync_view(thread, forks).close()
            else:
                log.info("kvturn: cannot release %s outside its event loop; its lease will "
                         "expire", view.id)

    def _hold(self, thread: _Thread) -> None:
        if self.client is None:
            log.info("kvturn: no sync kvturn client to hold %s; its lease runs its TTL",
                     thread.id)
            return
        with self._lock:
            views = [self._sync_view(thread, forks) for _, forks in sorted(thread.used)]
            if thread.hold is not None:
                thread.hold.stop()
            thread.hold = _Hold(self, list(dict.fromkeys(views)), self.client.keepalive_interval,
                                thread.policy.max_hold, name=f"kvturn-hold:{thread.id}")

    def holding(self, conversation_id: str) -> _Hold | None:
        """The hold of an interrupted thread (tests and diagnostics)."""
        thread = self._threads.get(conversation_id)
        return None if thread is None else thread.hold


def _needed(client: _C | None, flavour: str) -> _C:
    if client is None:
        raise RuntimeError(f"kvturn_langgraph: this registry has no {flavour} kvturn client")
    return client


def _view(views: dict[Forks, _V], forks: Forks, root: Callable[[], _V]) -> _V:
    """The conversation of ``forks`` in a thread's ``views`` of one flavour: its root (from
    ``root()``) and each fork on the way are made again where missing or closed."""
    view = views.get(())
    if view is None or view.closed:
        view = views[()] = root()
    for depth in range(1, len(forks) + 1):
        child = views.get(forks[:depth])
        if child is None or child.closed:
            child = views[forks[:depth]] = view.fork(forks[depth - 1])
        view = child
    return view


def _in_background(loop: asyncio.AbstractEventLoop, work: Coroutine[Any, Any, None]) -> None:
    task = loop.create_task(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


# The registry of each live client, by id(client). Weak values: a registry (which holds its
# clients) lives as long as something that calls through it does (a model, a middleware, a root
# run in progress), so a ChatOpenAI built per request takes its clients with it.
_REGISTRIES: weakref.WeakValueDictionary[int, Conversations] = weakref.WeakValueDictionary()
_REGISTRIES_LOCK = threading.Lock()


def registry_for(client: kvturn.OpenAI | None = None,
                 async_client: kvturn.AsyncOpenAI | None = None) -> Conversations:
    """The one registry of these kvturn clients (shared by every model, middleware and node
    wrapper built on them, so they all see the same conversation objects). Callers keep a
    reference to it for as long as they use it."""
    with _REGISTRIES_LOCK:
        registry = (_REGISTRIES.get(id(client)) if client is not None else None) or (
            _REGISTRIES.get(id(async_client)) if async_client is not None else None)
        if registry is None:
            registry = Conversations(client, async_client)
        if registry.client is None and client is not None:
            registry.client = client
        if registry.async_client is None and async_client is not None:
            registry.async_client = async_client
        for key in (client, async_client):
            if key is not None:
                _REGISTRIES[id(key)] = registry
        return registry


def live_registries() -> list[Conversations]:
    with _REGISTRIES_LOCK:
        return list(dict.fromkeys(_REGISTRIES.values()))
