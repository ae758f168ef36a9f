"""``KVTurnChatOpenAI``: ``ChatOpenAI`` on the kvturn SDK, one conversation per LangGraph path.

ChatOpenAI sends every request through its openai clients (``client``, ``root_client`` and
their async twins). Here those are kvturn clients behind a thin stand-in that, while a call is
being made, forwards to the SDK ``Conversation`` of the call's path (``_ids``) and otherwise to
the plain kvturn client. Everything else is ChatOpenAI's own code, plus three small additions:
per-call ``extra_body`` merges into the instance's instead of replacing it, each reply's
tool-call argument texts are kept and sent back verbatim (``_replies``), and the router's reuse
report lands in ``response_metadata["kvturn"]``.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Self, TypeVar

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.messages import BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_openai import ChatOpenAI
from pydantic import Field, PrivateAttr, SecretStr, model_validator

import kvturn
from kvturn_langgraph import _lifecycle
from kvturn_langgraph._conversations import Conversations, View, registry_for
from kvturn_langgraph._ids import root_id
from kvturn_langgraph._policy import LeasePolicy
from kvturn_langgraph._replies import (
    StreamedArguments,
    annotate,
    keep_arguments,
    report,
    restore_arguments,
)
from kvturn_langgraph._scope import locate

# The conversation the model call in progress (in this thread or task) goes to, with the
# registry it came from: a stand-in only forwards to conversations of its own clients.
_ACTIVE: ContextVar[tuple[Conversations, kvturn.Conversation] | None] = ContextVar(
    "kvturn_active", default=None)
_AACTIVE: ContextVar[tuple[Conversations, kvturn.AsyncConversation] | None] = ContextVar(
    "kvturn_aactive", default=None)


class _Pending:
    """Placeholder client while the model is validated: ChatOpenAI builds plain openai clients
    only when none is set, and kvturn builds its own right after."""

    def __bool__(self) -> bool:
        return True


_PENDING = _Pending()


class _Routed:
    """Stands in for one of ChatOpenAI's clients: every attribute is read from the active
    conversation, else from the plain kvturn client (``completions``: its
    ``chat.completions`` resource, which is ChatOpenAI's ``client``)."""

    __slots__ = ("_active", "_completions", "_default", "_owner")

    def __init__(self, default: Any, owner: Conversations, active: ContextVar[Any], *,
                 completions: bool) -> None:
        self._default = default
        self._owner = owner
        self._active = active
        self._completions = completions

    def __getattr__(self, name: str) -> Any:
        active = self._active.get()
        target = active[1] if active is not None and active[0] is self._owner else self._default
        return getattr(target.chat.completions if self._completions else target, name)

    def __copy__(self) -> Self:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self


def _sync_key(key: Any) -> str | Callable[[], str] | None:
    if isinstance(key, SecretStr):
        return key.get_secret_value()
    if callable(key) and not inspect.iscoroutinefunction(key):
        return key  # type: ignore[no-any-return]
    return key if isinstance(key, str) else None


def _async_key(key: Any) -> str | Callable[[], Awaitable[str]] | None:
    if isinstance(key, SecretStr):
        return key.get_secret_value()
    if callable(key):
        if inspect.iscoroutinefunction(key):
            return key  # type: ignore[no-any-return]
        sync_key = key

        async def resolved() -> str:
            return str(sync_key())

        return resolved
    return key if isinstance(key, str) else None


class KVTurnChatOpenAI(ChatOpenAI):
    """``ChatOpenAI`` for a kvturn router: each call belongs to the conversation of its
    LangGraph thread (forks for subgraphs and parallel branches), so every turn after the
    first reuses the KV the decode retained from the one before.

    >>> model = KVTurnChatOpenAI(model="kvturn-tiny", base_url="http://127.0.0.1:8000/v1",
    ...                          api_key="-")  # doctest: +SKIP
    >>> graph.invoke(inputs, {"configurable": {"thread_id": "chat-42"}})  # doctest: +SKIP

    Takes ChatOpenAI's arguments, plus ``lease_policy`` (``LeasePolicy``: release at the root
    run's end, hold while interrupted), ``keepalive_interval`` (seconds between lease renewals
    while tools run), ``kvturn_url`` and ``retry_policy`` (see ``kvturn.OpenAI``). Pass
    ``root_client=kvturn.OpenAI(...)`` / ``root_async_client=kvturn.AsyncOpenAI(...)`` to share
    clients; otherwise they are built from ``base_url``, ``api_key``, ``http_client``, ...
    """

    lease_policy: LeasePolicy = Field(default_factory=LeasePolicy)
    keepalive_interval: float = 60.0
    kvturn_url: str | None = None
    retry_policy: kvturn.RetryPolicy | None = None

    _kvturn: Conversations = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _defer_clients(cls, values: Any) -> Any:
        if isinstance(values, dict):
            values = dict(values)
            for name in ("client", "async_client"):
                if values.get(name) is not None:
                    raise ValueError(
                        f"KVTurnChatOpenAI builds its own {name!r}; pass root_client="
                        "kvturn.OpenAI(...) / root_async_client=kvturn.AsyncOpenAI(...)")
                values[name] = _PENDING
        return values

    @model_validator(mode="after")
    def _use_kvturn_clients(self) -> Self:
        sync, aio = self.root_client, self.root_async_client
        for given, kind in ((sync, kvturn.OpenAI), (aio, kvturn.AsyncOpenAI)):
            if given is not None and not isinstance(given, kind | _Routed):
                raise TypeError(f"KVTurnChatOpenAI needs a kvturn.{kind.__name__}, "
                                f"got {type(given).__name__}")
        if isinstance(sync, _Routed):  # validating an already validated model's fields again
            self._kvturn = sync._owner
            return self
        common: dict[str, Any] = {
            "organization": self.openai_organization, "base_url": self.openai_api_base,
            "default_headers": self.default_headers, "default_query": self.default_query,
            "keepalive_interval": self.keepalive_interval, "kvturn_url": self.kvturn_url,
            "retry_policy": self.retry_policy}
        if self.request_timeout is not None:
            common["timeout"] = self.request_timeout
        if self.max_retries is not None:
            common["max_retries"] = self.max_retries
        if sync is None:
            sync = kvturn.OpenAI(api_key=_sync_key(self.openai_api_key),
                                 http_client=self.http_client, **common)
        if aio is None:
            aio = kvturn.AsyncOpenAI(api_key=_async_key(self.openai_api_key),
                                     http_client=self.http_async_client, **common)
        registry = self._kvturn = registry_for(sync, aio)
        self.root_client = _Routed(sync, registry, _ACTIVE, completions=False)
        self.client = _Routed(sync, registry, _ACTIVE, completions=True)
        self.root_async_client = _Routed(aio, registry, _AACTIVE, completions=False)
        self.async_client = _Routed(aio, registry, _AACTIVE, completions=True)
        _lifecycle.install()
        return self

    @property
    def _llm_type(self) -> str:
        return "kvturn-chat-openai"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        # ChatOpenAI's serialised form names ChatOpenAI: it would load without kvturn.
        return False

    def release(self, thread_id: str) -> bool:
        """Release a thread's conversation (and forks) now, whatever the policy (e.g. with
        ``LeasePolicy(on_end="keep")`` when the user closes the chat); False when this process
        holds none for it. From async code the release is sent in the background."""
        return self._kvturn.release(root_id(thread_id))

    # --- requests ----------------------------------------------------------------------------

    def _get_request_payload(self, input_: LanguageModelInput, *, stop: list[str] | None = None,
                             **kwargs: Any) -> dict[str, Any]:
        call_body = kwargs.get("extra_body")
        if call_body is not None and self.extra_body:
            # ChatOpenAI lets a per-call extra_body replace the instance's; merge instead.
            kwargs["extra_body"] = {**self.extra_body, **call_body}
        payload: dict[str, Any] = super()._get_request_payload(input_, stop=stop, **kwargs)
        if isinstance(input_, list) and all(isinstance(m, BaseMessage) for m in input_):
            restore_arguments(input_, payload)
        return payload

    def _create_chat_result(self, response: dict[str, Any] | Any,
                            generation_info: dict[str, Any] | None = None) -> ChatResult:
        result = super()._create_chat_result(response, generation_info)
        keep_arguments(result, response)
        return result

    def _conversation(self, run_manager: Any) -> tuple[Mapping[str, Any], Any]:
        if run_manager is None:  # _stream / _astream: see MODEL_CALL
            call = _lifecycle.MODEL_CALL.get()
            return call if call is not None else ({}, None)
        return run_manager.metadata or {}, run_manager.parent_run_id

    def _sync_conversation(self, run_manager: Any) -> kvturn.Conversation | None:
        path, root = locate(*self._conversation(run_manager))
        return None if path is None else self._kvturn.sync(path, root, self.lease_policy)

    def _async_conversation(self, run_manager: Any) -> kvturn.AsyncConversation | None:
        path, root = locate(*self._conversation(run_manager))
        return None if path is None else self._kvturn.aio(path, root, self.lease_policy)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        conversation = self._sync_conversation(run_manager)
        if conversation is None:
            return super()._generate(messages, stop, run_manager, **kwargs)
        with _active(_ACTIVE, (self._kvturn, conversation)):
            result = super()._generate(messages, stop, run_manager, **kwargs)
        return _reported(result, conversation)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        conversation = self._async_conversation(run_manager)
        if conversation is None:
            return await super()._agenerate(messages, stop, run_manager, **kwargs)
        with _active(_AACTIVE, (self._kvturn, conversation)):
            result = await super()._agenerate(messages, stop, run_manager, **kwargs)
        return _reported(result, conversation)

    def _stream(self, *args: Any, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        conversation = self._sync_conversation(kwargs.get("run_manager"))
        chunks = super()._stream(*args, **kwargs)
        if conversation is None:
            yield from chunks
            return
        # The request goes out when the first chunk is pulled; the stream then keeps its
        # conversation, so only that pull needs the active conversation set.
        with _active(_ACTIVE, (self._kvturn, conversation)):
            first = next(chunks, None)
        if first is None:
            return
        arguments = _first_chunk(first, conversation)
        yield first
        for chunk in chunks:
            arguments.see(chunk)
            yield chunk

    async def _astream(self, *args: Any, **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        conversation = self._async_conversation(kwargs.get("run_manager"))
        chunks = super()._astream(*args, **kwargs)
        if conversation is None:
            async for chunk in chunks:
                yield chunk
            return
        with _active(_AACTIVE, (self._kvturn, conversation)):
            first = await anext(chunks, None)
        if first is None:
            return
        arguments = _first_chunk(first, conversation)
        yield first
        async for chunk in chunks:
            arguments.see(chunk)
            yield chunk


_T = TypeVar("_T")


@contextmanager
def _active(var: ContextVar[_T | None], value: _T) -> Iterator[None]:
    """``value`` is the active conversation of this thread or task while the block runs."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def _reported(result: ChatResult, conversation: View) -> ChatResult:
    """``result`` with the router's report on the turn in each generation's metadata."""
    values = report(conversation.last_turn)
    for generation in result.generations:
        annotate(generation.message, values)
    return result


def _first_chunk(first: ChatGenerationChunk, conversation: View) -> StreamedArguments:
    """Annotate a stream's first chunk with the turn's report; the tool-call arguments of the
    stream are gathered from it on."""
    annotate(first.message, report(conversation.last_turn))
    arguments = StreamedArguments()
    arguments.see(first)
    return arguments
