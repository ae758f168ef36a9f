"""Conversation ids from LangGraph run metadata: thread → conversation, namespace → fork.

A kvturn conversation is one linear token sequence, so every sequence of model calls that
extends itself gets its own id, and the id is a pure function of what LangGraph records about
the call (``thread_id``, ``langgraph_checkpoint_ns``, ``langgraph_path``, ``langgraph_node``):
the same graph resumed from a checkpoint, in this process or another, finds the same ids.

Rules (documented in docs/langgraph.md):

1. Root: the run's ``thread_id``. Without one, inside a LangGraph run, ``kvt-<root run id>``
   (one conversation per top-level invoke); outside LangGraph without one, no id at all.
2. One fork per subgraph level: the namespace ``outer:<task>|inner:<task>|node:<task>`` of a
   call in node ``node`` gives forks ``outer``, ``inner`` (task ids dropped, so a subgraph keeps
   its conversation across the steps that run it; numeric segments dropped). A subgraph level
   that was itself started by a ``Send`` is named ``node:<send index>``.
3. An explicit node fork (``kvturn_node(fork=...)``) comes next.
4. Last, one leaf fork for a parallel branch: the tool call's id when the model is called from
   inside a tool, else ``node:<send index>`` when the node runs as a ``Send`` (push) task.
   Lease keepalive while a tool runs targets the path without the leaf: the conversation of
   the model node whose tool calls are running.

Ids and names the router accepts are used as they are (they show up in its logs as the thread
ids users know); others are percent-encoded, and overlong ones become digests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

# Wire values LangGraph writes into run metadata (langgraph._internal._constants).
PUSH = "__pregel_push"
PULL = "__pregel_pull"
NS_SEP = "|"
NS_END = ":"

ID_MAX_LENGTH = 256  # the router's limit (docs/http-api.md, section A)
FORK_NAME_MAX_LENGTH = 128  # the SDK's limit for fork names
# What percent-encoding keeps of a name that needs it: everything printable but "%".
_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


@dataclass(frozen=True, slots=True)
class ConversationPath:
    """Where a model call belongs: the root conversation and the forks below it."""

    root: str
    forks: tuple[str, ...] = ()

    def __str__(self) -> str:
        return "/".join((self.root, *self.forks))


def _encoded(value: str, limit: int) -> str:
    if value and len(value) <= limit and all("!" <= ch <= "~" for ch in value):
        return value
    text = quote(value, safe=_SAFE) if value else "-"
    if len(text) <= limit:
        return text
    return "lg-" + hashlib.sha256(value.encode()).hexdigest()[:32]


def root_id(thread_id: object) -> str:
    """The conversation id of a LangGraph thread: the thread id itself when the router accepts
    it (LangGraph thread ids usually are UUIDs), else an encoding of it."""
    return _encoded(str(thread_id), ID_MAX_LENGTH)


def fork_name(value: object) -> str:
    return _encoded(str(value), FORK_NAME_MAX_LENGTH)


def push_name(node: object, path: Any) -> str:
    """``node:<index>`` for a push (``Send``) task; nested paths join their parts with ``.``."""
    parts: list[str] = []

    def walk(item: Any) -> None:
        if isinstance(item, tuple | list):
            for part in item:
                walk(part)
        elif item not in (PUSH, PULL) and not isinstance(item, bool):
            parts.append(str(item))

    walk(path[1:] if isinstance(path, tuple | list) else ())
    return fork_name(f"{node}{NS_END}{'.'.join(parts)}")


def is_push(path: Any) -> bool:
    return isinstance(path, tuple | list) and bool(path) and path[0] == PUSH


def derive(metadata: Mapping[str, Any], *, fallback: str | None = None,
           tool_call: str | None = None, node_fork: str | None = None,
           level_name: Callable[[str], str | None] | None = None,
           keepalive: bool = False) -> ConversationPath | None:
    """The conversation of a call made with these run ``metadata`` (rules in the module doc).

    ``fallback``: the root id to use without a ``thread_id``; ``tool_call``: the id of the tool
    call the model is called from; ``level_name``: the fork name recorded for a namespace
    segment (a subgraph started by a ``Send``); ``keepalive``: the path whose lease a running
    tool keeps alive (no leaf fork).
    """
    thread = metadata.get("thread_id")
    root = root_id(thread) if thread is not None and thread != "" else fallback
    if root is None:
        return None
    forks: list[str] = []
    namespace = metadata.get("langgraph_checkpoint_ns")
    if isinstance(namespace, str) and NS_SEP in namespace:
        for segment in namespace.split(NS_SEP)[:-1]:  # the last one is the call's own task
            if not segment or segment.isdigit():
                continue
            recorded = level_name(segment) if level_name is not None else None
            forks.append(recorded or fork_name(segment.split(NS_END, 1)[0]))
    if node_fork:
        forks.append(fork_name(node_fork))
    if not keepalive:
        if tool_call:
            forks.append(fork_name(tool_call))
        else:
            path = metadata.get("langgraph_path")
            if is_push(path):
                forks.append(push_name(metadata.get("langgraph_node"), path))
    return ConversationPath(root, tuple(forks))
