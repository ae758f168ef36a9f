"""Where a call sits in the run tree, and what ends when the root run ends.

``RunTracker`` is a LangChain callback handler that every root run gets once kvturn_langgraph
is in use (a configure hook, the mechanism LangSmith's tracer uses; ``install()`` registers it
the first time a kvturn model, middleware, tool node or node wrapper is built). It follows chain
and tool runs (and notes each chat model call's start), never model tokens, and keeps nothing
once a run has ended. It answers three
questions for the rest of the package:

* which root run a call belongs to (for the fallback id of a thread-less run, and so that the
  conversations a run used are settled when it ends);
* whether the call is made from inside a tool call (its id names the call's fork);
* which namespace segments are subgraphs started by a ``Send`` (their fork gets the index).

When a root run ends (normally, with an error, or stopped by an ``interrupt()``), every
conversation registry that served it settles its threads by their ``LeasePolicy``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tracers.context import register_configure_hook
from langgraph.errors import GraphInterrupt

from kvturn_langgraph._ids import NS_SEP, is_push, push_name, root_id

log = logging.getLogger("kvturn.langgraph")

# The chat model call starting in this thread or task: its run metadata and parent run. Set by
# the tracker's on_chat_model_start, which LangChain calls right before the model's _stream /
# _generate in the same context; BaseChatModel does not hand _stream its run manager.
MODEL_CALL: ContextVar[tuple[Mapping[str, Any], UUID | None] | None] = ContextVar(
    "kvturn_langgraph_model_call", default=None)

# Runs that never report an end (a stream dropped without closing it) must not pile up.
_MAX_RUNS = 100_000


class Settles(Protocol):
    """A conversation registry, as the tracker sees it."""

    def adopt(self, conversation_id: str, run: RootRun) -> None: ...

    def finish_run(self, run: RootRun, *, interrupted: bool) -> None: ...


@dataclass(eq=False, slots=True)
class RootRun:
    """A top-level run (``graph.invoke``, ``stream``, ``ainvoke``, ...)."""

    run_id: UUID
    thread_id: str | None
    interrupted: bool = False
    registries: set[Settles] = field(default_factory=set)

    @property
    def fallback_id(self) -> str:
        """The conversation of a run without ``thread_id``: one per top-level invoke."""
        return f"kvt-{self.run_id.hex}"

    def note(self, registry: Settles) -> None:
        self.registries.add(registry)


@dataclass(slots=True)
class Located:
    """A run's place: its root, the tool call it runs in (if any), the segment it named."""

    root: RootRun
    tool_call: str | None = None
    segment: str | None = None


class RunTracker(BaseCallbackHandler):
    """Follows chain and tool runs to their root (see the module docstring)."""

    run_inline = True  # called in the run's own thread/task: no executor hop, ever
    # Model tokens and ends, retriever and custom events are of no interest: not even called
    # (chat model starts are: see MODEL_CALL). Class attributes over LangChain's properties.
    ignore_llm = True
    ignore_retriever = True
    ignore_retry = True
    ignore_custom_event = True

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[UUID, Located] = {}
        self._levels: dict[str, str] = {}
        self._registries: weakref.WeakSet[Any] = weakref.WeakSet()

    # --- queries ---------------------------------------------------------------------------

    def locate(self, parent_run_id: UUID | None) -> Located | None:
        """The place of a call whose parent run is ``parent_run_id`` (None: not tracked)."""
        return self._runs.get(parent_run_id) if parent_run_id is not None else None

    def level_name(self, segment: str) -> str | None:
        """The fork name of a namespace segment started by a ``Send``, if one was seen."""
        return self._levels.get(segment)

    def watch(self, registry: Settles) -> None:
        """Tell ``registry`` when a thread it knows starts a new root run."""
        self._registries.add(registry)

    # --- run events --------------------------------------------------------------------------

    def on_chain_start(self, serialized: dict[str, Any] | None, inputs: Any, *, run_id: UUID,
                       parent_run_id: UUID | None = None,
                       metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._start(run_id, parent_run_id, metadata, tool_call=None)

    def on_chat_model_start(self, serialized: dict[str, Any] | None, messages: Any, *,
                            run_id: UUID, parent_run_id: UUID | None = None,
                            metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        MODEL_CALL.set((metadata or {}, parent_run_id))

    def on_tool_start(self, serialized: dict[str, Any] | None, input_str: str, *,
                      run_id: UUID, parent_run_id: UUID | None = None,
                      metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        call = kwargs.get("tool_call_id") or kwargs.get("name") or (serialized or {}).get("name")
        self._start(run_id, parent_run_id, metadata, tool_call=str(call or "tool"))

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id, error)

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id, error)

    # --- bookkeeping -------------------------------------------------------------------------

    def _start(self, run_id: UUID, parent_run_id: UUID | None,
               metadata: Mapping[str, Any] | None, *, tool_call: str | None) -> None:
        metadata = metadata or {}
        root: RootRun | None = None
        if parent_run_id is None:
            thread = metadata.get("thread_id")
            root = RootRun(run_id, None if thread is None or thread == "" else str(thread))
            place = Located(root, tool_call)
        else:
            parent = self._runs.get(parent_run_id)
            if parent is None:
                # Inside a run that started before install() (or a model run): not ours to
                # settle. Taking it for a root would release its threads when it ends.
                return
            place = Located(parent.root, tool_call or parent.tool_call)
        # The first run of a LangGraph task (its node, or the subgraph it is) names its
        # namespace segment; runs inside it share the segment and find it taken.
        namespace = metadata.get("langgraph_checkpoint_ns")
        path = metadata.get("langgraph_path")
        if isinstance(namespace, str) and namespace and is_push(path):
            segment = namespace.rsplit(NS_SEP, 1)[-1]
            with self._lock:
                if segment not in self._levels:
                    self._levels[segment] = push_name(metadata.get("langgraph_node"), path)
                    place.segment = segment
        with self._lock:
            if len(self._runs) >= _MAX_RUNS:
                log.warning("kvturn: %d runs never reported their end; forgetting the oldest",
                            len(self._runs))
                for stale in list(self._runs)[: _MAX_RUNS // 10]:
                    del self._runs[stale]
            self._runs[run_id] = place
        if root is not None and root.thread_id is not None:
            conversation = root_id(root.thread_id)
            for registry in list(self._registries):
                registry.adopt(conversation, root)

    def _end(self, run_id: UUID, error: BaseException | None = None) -> None:
        with self._lock:
            place = self._runs.pop(run_id, None)
            if place is None:
                return
            if place.segment is not None:
                self._levels.pop(place.segment, None)
        root = place.root
        if isinstance(error, GraphInterrupt):
            root.interrupted = True
        if root.run_id != run_id:
            return
        for registry in list(root.registries):
            try:
                registry.finish_run(root, interrupted=root.interrupted)
            except Exception:  # settling a lease must never fail the user's run
                log.exception("kvturn: settling the conversations of run %s failed", run_id)


TRACKER = RunTracker()
_HOOK: ContextVar[RunTracker | None] = ContextVar("kvturn_langgraph_tracker", default=TRACKER)
_installed = False
_install_lock = threading.Lock()


def install() -> RunTracker:
    """Give every root run from now on the tracker (idempotent)."""
    global _installed
    with _install_lock:
        if not _installed:
            register_configure_hook(_HOOK, inheritable=True)
            _installed = True
    return TRACKER
