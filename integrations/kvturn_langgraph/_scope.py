"""The conversation path of the call in progress, from its run metadata and place in the run
tree (shared by the chat model, the middleware, the tool wrappers and the node wrapper)."""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackManager
from langchain_core.runnables import RunnableConfig

from kvturn_langgraph._ids import ConversationPath, derive
from kvturn_langgraph._lifecycle import TRACKER, RootRun

# The explicit fork of the node running now (kvturn_node(fork=...)).
NODE_FORK: ContextVar[str | None] = ContextVar("kvturn_langgraph_node_fork", default=None)


def locate(metadata: Mapping[str, Any], parent_run_id: UUID | None, *,
           keepalive: bool = False) -> tuple[ConversationPath | None, RootRun | None]:
    """The path of a call with these run ``metadata`` whose parent run is ``parent_run_id``,
    and the root run it belongs to (None when the tracker does not know it)."""
    place = TRACKER.locate(parent_run_id)
    # A generated id only inside a LangGraph run: a lone chain call would retain (and release)
    # a conversation of a single turn.
    fallback = None
    if place is not None and not metadata.get("thread_id") and "langgraph_node" in metadata:
        fallback = place.root.fallback_id
    path = derive(metadata, fallback=fallback,
                  tool_call=place.tool_call if place is not None else None,
                  node_fork=NODE_FORK.get(), level_name=TRACKER.level_name,
                  keepalive=keepalive)
    return path, place.root if place is not None else None


def locate_config(config: RunnableConfig | None, *,
                  keepalive: bool = False) -> tuple[ConversationPath | None, RootRun | None]:
    """``locate`` for code that holds a ``RunnableConfig`` (a node, a tool, a middleware):
    the config's callback manager is a child of the run the code runs in."""
    if not config:
        return None, None
    callbacks = config.get("callbacks")
    parent = callbacks.parent_run_id if isinstance(callbacks, BaseCallbackManager) else None
    return locate(config.get("metadata") or {}, parent, keepalive=keepalive)


def current_config() -> RunnableConfig | None:
    """The config of the LangGraph task running now, or None outside one."""
    from langgraph.config import get_config

    try:
        return get_config()
    except RuntimeError:
        return None
