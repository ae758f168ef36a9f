"""Tool calls keep the lease alive: a LangGraph tool call is a kvturn ``pause()``.

While a tool runs, the conversation whose model asked for it (the tool's path without leaf
fork, see ``_ids``) renews its lease every ``keepalive_interval`` seconds through the SDK's own
``pause()``; overlapping tool calls of one conversation share one heartbeat. Only conversations
that carried a turn in this process are paused (there is nothing to keep alive otherwise).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

import kvturn
from kvturn_langgraph import _lifecycle
from kvturn_langgraph._conversations import View, live_registries
from kvturn_langgraph._scope import locate_config

ToolResult = ToolMessage | Command[Any]
Execute = Callable[[ToolCallRequest], ToolResult]
AsyncExecute = Callable[[ToolCallRequest], Awaitable[ToolResult]]
ToolCallWrapper = Callable[[ToolCallRequest, Execute], ToolResult]
AsyncToolCallWrapper = Callable[[ToolCallRequest, AsyncExecute], Awaitable[ToolResult]]


def _targets(config: RunnableConfig | None, *, asynchronous: bool) -> list[View]:
    path, _ = locate_config(config, keepalive=True)
    if path is None:
        return []
    return [view for registry in live_registries()
            for view in registry.keepalive_views(path, asynchronous=asynchronous)]


@contextmanager
def keeping_alive(config: RunnableConfig | None, tool: str | None = None) -> Iterator[None]:
    """Renew the lease of the conversation that ``config``'s tool call belongs to."""
    with ExitStack() as stack:
        for view in _targets(config, asynchronous=False):
            if isinstance(view, kvturn.Conversation):
                stack.enter_context(view.pause(tool))
        yield


@asynccontextmanager
async def akeeping_alive(config: RunnableConfig | None,
                         tool: str | None = None) -> AsyncIterator[None]:
    """``keeping_alive`` for async code: an asyncio heartbeat when the turns were async."""
    async with AsyncExitStack() as stack:
        for view in _targets(config, asynchronous=True):
            if isinstance(view, kvturn.AsyncConversation):
                await stack.enter_async_context(view.pause(tool))
            else:
                stack.enter_context(view.pause(tool))
        yield


def keepalive_tool_call(request: ToolCallRequest, execute: Execute) -> ToolResult:
    """A ``ToolNode`` ``wrap_tool_call``: the lease stays alive while the tool runs."""
    with keeping_alive(request.runtime.config, request.tool_call.get("name")):
        return execute(request)


async def akeepalive_tool_call(request: ToolCallRequest, execute: AsyncExecute) -> ToolResult:
    """A ``ToolNode`` ``awrap_tool_call``: the lease stays alive while the tool runs."""
    async with akeeping_alive(request.runtime.config, request.tool_call.get("name")):
        return await execute(request)


class KVTurnToolNode(ToolNode):
    """``langgraph.prebuilt.ToolNode`` whose tool calls keep the conversation's lease alive.

    Takes ToolNode's arguments; a ``wrap_tool_call`` / ``awrap_tool_call`` of your own runs
    inside the keepalive.
    """

    def __init__(self, tools: Sequence[BaseTool | Callable[..., Any]], *,
                 wrap_tool_call: ToolCallWrapper | None = None,
                 awrap_tool_call: AsyncToolCallWrapper | None = None, **kwargs: Any) -> None:
        _lifecycle.install()
        sync_wrapper = (keepalive_tool_call if wrap_tool_call is None
                        else _around(wrap_tool_call))
        async_wrapper: AsyncToolCallWrapper | None = (
            akeepalive_tool_call if awrap_tool_call is None else _aaround(awrap_tool_call))
        if awrap_tool_call is None and wrap_tool_call is not None:
            # ToolNode runs a sync-only wrapper in async graphs too; keep it that way.
            async_wrapper = None
        super().__init__(tools, wrap_tool_call=sync_wrapper, awrap_tool_call=async_wrapper,
                         **kwargs)


def _around(inner: ToolCallWrapper) -> ToolCallWrapper:
    def wrapper(request: ToolCallRequest, execute: Execute) -> ToolResult:
        with keeping_alive(request.runtime.config, request.tool_call.get("name")):
            return inner(request, execute)

    return wrapper


def _aaround(inner: AsyncToolCallWrapper) -> AsyncToolCallWrapper:
    async def wrapper(request: ToolCallRequest, execute: AsyncExecute) -> ToolResult:
        async with akeeping_alive(request.runtime.config, request.tool_call.get("name")):
            return await inner(request, execute)

    return wrapper
