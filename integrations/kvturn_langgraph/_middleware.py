"""``KVTurnMiddleware``: conversations for ``create_agent`` with any OpenAI-compatible model.

Model calls: the request's ``model_settings["extra_body"]`` gets the call's ``conversation_id``
(merged with the model's own ``extra_body`` and any per-call one, since ChatOpenAI would let
the per-call value replace the instance's). A ``KVTurnChatOpenAI`` stamps its calls itself and
is left alone. Tool calls: the lease stays alive while the tool runs (``_tools``). Root run end:
the tracker settles the thread by ``lease_policy``.

Control calls (keepalive, release) go through a kvturn client: the one given, else the model's
own when it is a kvturn client, else one built from the model's ``openai_api_base`` and key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.language_models import BaseChatModel
from langgraph.prebuilt.tool_node import ToolCallRequest
from pydantic import SecretStr

import kvturn
from kvturn_langgraph import _lifecycle
from kvturn_langgraph._conversations import Conversations, registry_for
from kvturn_langgraph._model import KVTurnChatOpenAI
from kvturn_langgraph._policy import LeasePolicy
from kvturn_langgraph._scope import current_config, locate_config
from kvturn_langgraph._tools import AsyncExecute, Execute, ToolResult, akeeping_alive, keeping_alive

_SEEN_MAX = 64


class KVTurnMiddleware(AgentMiddleware):
    """``create_agent`` middleware: every model call carries the conversation id of its
    LangGraph path, tool calls keep the lease alive, the root run's end settles the lease.

    >>> agent = create_agent(ChatOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-",
    ...                                 model="kvturn-tiny"), tools,
    ...                      middleware=[KVTurnMiddleware()])  # doctest: +SKIP

    ``client`` / ``async_client``: kvturn clients for keepalive and release (default: the
    model's, or built from its base URL and key); ``lease_policy``: see ``LeasePolicy``.
    """

    def __init__(self, *, client: kvturn.OpenAI | None = None,
                 async_client: kvturn.AsyncOpenAI | None = None,
                 lease_policy: LeasePolicy | None = None) -> None:
        super().__init__()
        self.tools = []
        self.lease_policy = lease_policy or LeasePolicy()
        self._given = registry_for(client, async_client) if client or async_client else None
        # Registries of the models seen lately, kept alive by this middleware (registry_for
        # holds them weakly).
        self._seen: OrderedDict[Any, Conversations] = OrderedDict()
        self._lock = threading.Lock()
        _lifecycle.install()

    # --- model calls -------------------------------------------------------------------------

    def wrap_model_call(self, request: ModelRequest,
                        handler: Callable[[ModelRequest], ModelResponse]) -> ModelResponse:
        return handler(self._stamped(request, asynchronous=False))

    async def awrap_model_call(
            self, request: ModelRequest,
            handler: Callable[[ModelRequest], Awaitable[ModelResponse]]) -> ModelResponse:
        return await handler(self._stamped(request, asynchronous=True))

    def _stamped(self, request: ModelRequest, *, asynchronous: bool) -> ModelRequest:
        model = request.model
        if isinstance(model, KVTurnChatOpenAI):
            return request
        path, root = locate_config(current_config())
        if path is None:
            return request
        registry = self._registry(model)
        if asynchronous and registry.async_client is not None:
            conversation_id = registry.aio(path, root, self.lease_policy).id
        else:
            conversation_id = registry.sync(path, root, self.lease_policy).id
        settings = dict(request.model_settings)
        instance = getattr(model, "extra_body", None)
        call = settings.get("extra_body")
        settings["extra_body"] = {**(instance if isinstance(instance, Mapping) else {}),
                                  **(call if isinstance(call, Mapping) else {}),
                                  "conversation_id": conversation_id}
        return request.override(model_settings=settings)

    def _registry(self, model: BaseChatModel) -> Conversations:
        if self._given is not None:
            return self._given
        root = getattr(model, "root_client", None)
        aroot = getattr(model, "root_async_client", None)
        sync = root if isinstance(root, kvturn.OpenAI) else None
        aio = aroot if isinstance(aroot, kvturn.AsyncOpenAI) else None
        base_url = getattr(model, "openai_api_base", None)
        key = getattr(model, "openai_api_key", None)
        api_key = key.get_secret_value() if isinstance(key, SecretStr) else key
        api_key = api_key if isinstance(api_key, str) else None
        seen = (id(sync), id(aio)) if sync or aio else (base_url, api_key)
        with self._lock:
            registry = self._seen.get(seen)
            if registry is not None:
                self._seen.move_to_end(seen)
                return registry
            if sync is None and aio is None:
                # A plain openai model: kvturn clients of our own, for control calls only.
                sync = kvturn.OpenAI(base_url=base_url, api_key=api_key)
                aio = kvturn.AsyncOpenAI(base_url=base_url, api_key=api_key)
            registry = self._seen[seen] = registry_for(sync, aio)
            if len(self._seen) > _SEEN_MAX:
                self._seen.popitem(last=False)
            return registry

    # --- tool calls --------------------------------------------------------------------------

    def wrap_tool_call(self, request: ToolCallRequest,
                       handler: Execute) -> ToolResult:
        with keeping_alive(request.runtime.config, request.tool_call.get("name")):
            return handler(request)

    async def awrap_tool_call(self, request: ToolCallRequest,
                              handler: AsyncExecute) -> ToolResult:
        async with akeeping_alive(request.runtime.config, request.tool_call.get("name")):
            return await handler(request)

    def __repr__(self) -> str:
        return f"KVTurnMiddleware(lease_policy={self.lease_policy!r})"
