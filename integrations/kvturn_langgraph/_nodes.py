"""Hand-written ``StateGraph`` nodes: a node wrapper, and the current task's conversation.

``kvturn_node`` gives a node what a prebuilt node gets for free: ``fork=`` puts its model
calls on a fork of their own (nodes that run in the same step, e.g. a static fan-out, would
otherwise share one linear conversation), and ``pause=`` keeps the lease alive while the node
runs (a node that executes tools itself). ``current_conversation(client)`` hands node code
that calls the kvturn SDK directly the conversation of the task it runs in.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar, overload

import kvturn
from kvturn_langgraph import _lifecycle
from kvturn_langgraph._conversations import Conversations, registry_for
from kvturn_langgraph._policy import LeasePolicy
from kvturn_langgraph._scope import NODE_FORK, current_config, locate_config
from kvturn_langgraph._tools import akeeping_alive, keeping_alive

F = TypeVar("F", bound=Callable[..., Any])

# Registries handed out by current_conversation, kept alive (registry_for holds them weakly)
# for the clients used most recently.
_RECENT: OrderedDict[int, Conversations] = OrderedDict()
_RECENT_MAX = 32
_RECENT_LOCK = threading.Lock()


@overload
def kvturn_node(fn: F, /, *, fork: str | None = None, pause: bool | str = False) -> F: ...


@overload
def kvturn_node(*, fork: str | None = None, pause: bool | str = False) -> Callable[[F], F]: ...


def kvturn_node(fn: F | None = None, /, *, fork: str | None = None,
                pause: bool | str = False) -> F | Callable[[F], F]:
    """Wrap a ``StateGraph`` node (sync or async; its signature is kept, so LangGraph still
    injects ``config``, ``runtime``, ...).

    * ``fork``: model calls made in this node go to the fork ``fork`` of the node's
      conversation (``"<thread>/<fork>"`` at the top level);
    * ``pause``: renew the lease of the node's conversation while the node runs, e.g. a node
      that executes tool calls itself (a string names the tool in the SDK's logs).

    >>> builder.add_node("critic", kvturn_node(critic, fork="critic"))  # doctest: +SKIP
    >>> builder.add_node("run_tools", kvturn_node(run_tools, pause=True))  # doctest: +SKIP
    """
    _lifecycle.install()
    tool = pause if isinstance(pause, str) else None

    def decorate(node: F) -> F:
        if inspect.iscoroutinefunction(node):
            @functools.wraps(node)
            async def anode(*args: Any, **kwargs: Any) -> Any:
                token = NODE_FORK.set(fork) if fork else None
                try:
                    if not pause:
                        return await node(*args, **kwargs)
                    async with akeeping_alive(current_config(), tool):
                        return await node(*args, **kwargs)
                finally:
                    if token is not None:
                        NODE_FORK.reset(token)

            return anode  # type: ignore[return-value]

        @functools.wraps(node)
        def snode(*args: Any, **kwargs: Any) -> Any:
            token = NODE_FORK.set(fork) if fork else None
            try:
                if not pause:
                    return node(*args, **kwargs)
                with keeping_alive(current_config(), tool):
                    return node(*args, **kwargs)
            finally:
                if token is not None:
                    NODE_FORK.reset(token)

        return snode  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


@overload
def current_conversation(client: kvturn.AsyncOpenAI, *,
                         lease_policy: LeasePolicy | None = None,
                         ) -> kvturn.AsyncConversation | None: ...


@overload
def current_conversation(client: kvturn.OpenAI, *,
                         lease_policy: LeasePolicy | None = None) -> kvturn.Conversation | None: ...


def current_conversation(client: kvturn.OpenAI | kvturn.AsyncOpenAI, *,
                         lease_policy: LeasePolicy | None = None,
                         ) -> kvturn.Conversation | kvturn.AsyncConversation | None:
    """The kvturn conversation of the LangGraph task running now, on ``client``: the same
    object a ``KVTurnChatOpenAI`` on this client uses for the same path, settled at the end of
    the root run by ``lease_policy`` (default ``LeasePolicy()``). None outside a LangGraph run
    without ``thread_id``.

    >>> def agent(state):  # doctest: +SKIP
    ...     chat = current_conversation(client)
    ...     reply = chat.chat.completions.create(model="kvturn-tiny", messages=...)
    """
    _lifecycle.install()
    path, root = locate_config(current_config())
    if path is None:
        return None
    policy = lease_policy or LeasePolicy()
    with _RECENT_LOCK:
        registry = _RECENT.get(id(client))
        if registry is None:
            registry = (registry_for(async_client=client)
                        if isinstance(client, kvturn.AsyncOpenAI) else registry_for(client))
            _RECENT[id(client)] = registry
            if len(_RECENT) > _RECENT_MAX:
                _RECENT.popitem(last=False)
        else:
            _RECENT.move_to_end(id(client))
    if isinstance(client, kvturn.AsyncOpenAI):
        return registry.aio(path, root, policy)
    return registry.sync(path, root, policy)
