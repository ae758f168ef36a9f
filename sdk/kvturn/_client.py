"""``kvturn.OpenAI`` and ``kvturn.AsyncOpenAI``: openai's clients plus conversations and retries.

Both subclass openai's clients, the way openai's own ``AzureOpenAI`` does, and override only
these (``tests/sdk/test_canary.py`` pins each):

* ``request``: the one loop every API call goes through. kvturn copies the options, switches
  openai's inner retries off, stamps the conversation id and the reuse hint (scoped clients),
  runs the attempts under its own retry policy (``_retry``), and hands the result to the
  conversation to observe the reply (``_observe``).
* ``_process_response``: the one place that sees the ``httpx2.Response`` of a parsed result;
  kvturn notes it (in a context variable, so threads and tasks never mix them up) to read the
  router's reuse headers.
* ``_process_response_data``: openai's decoding of each JSON payload, stream chunks included;
  kvturn feeds a conversation's streamed chunks to its reply assembler (``_observe``).
* ``copy`` / ``with_options``: carry kvturn's settings and the conversation to the copy; and
  ``__new__`` picks the scoped class when a conversation is handed over.
* ``user_agent``: openai's own value, whatever the subclass is called.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar, cast, overload

import httpx2
import openai
from openai import DEFAULT_MAX_RETRIES, AsyncStream, NotGiven, Stream, Timeout, not_given

from kvturn._compat import FinalRequestOptions
from kvturn._constants import DEFAULT_KEEPALIVE_INTERVAL, HEADER_RETRY_COUNT
from kvturn._endpoints import router_root
from kvturn._identity import new_conversation_id, validate_conversation_id
from kvturn._observe import observe_reply
from kvturn._retry import RetryPolicy, acall_with_retries, call_with_retries
from kvturn._state import ConversationState, TurnPlan

if TYPE_CHECKING:
    from kvturn._conversation import AsyncConversation, Conversation

_T = TypeVar("_T")
_S = TypeVar("_S", bound=Stream[Any])
_AS = TypeVar("_AS", bound=AsyncStream[Any])

# The response of the attempt that succeeded, noted by _process_response for request().
_RESPONSE: contextvars.ContextVar[httpx2.Response | None] = contextvars.ContextVar(
    "kvturn_response", default=None)
# Retries kvturn has taken for the request in flight; openai's own count is always 0.
_RETRIES_TAKEN: contextvars.ContextVar[int] = contextvars.ContextVar(
    "kvturn_retries_taken", default=0)


def _own_options(options: FinalRequestOptions, max_retries: int,
                 state: ConversationState | None) -> tuple[FinalRequestOptions, int,
                                                           TurnPlan | None]:
    """kvturn's copy of ``options``, the number of attempts, and the turn's plan.

    The caller's object stays untouched (a paginator, for one, reuses it for the next page).
    All changes go into one ``model_copy(update=...)``: pydantic's attribute assignment
    validates and costs a few microseconds per field.
    """
    attempts = options.get_max_retries(max_retries) + 1
    # openai's loop off: kvturn's policy makes every attempt (see _retry).
    update: dict[str, Any] = {"max_retries": 0}
    if attempts > 1 and options.idempotency_key is None and options.method.lower() != "get":
        # One key for all attempts, as openai's own loop does.
        update["idempotency_key"] = f"kvturn-retry-{os.urandom(16).hex()}"
    plan = state.prepare(options, update) if state is not None else None
    return options.model_copy(update=update), attempts, plan


def _for_attempt(options: FinalRequestOptions, number: int) -> FinalRequestOptions:
    """The options of attempt ``number``: openai's retry-count header tells the router it is a
    retry, as it would with openai's own loop."""
    if number == 1:
        return options
    headers = dict(options.headers) if isinstance(options.headers, Mapping) else {}
    if any(key.lower() == HEADER_RETRY_COUNT for key in headers):
        return options
    retry = options.model_copy()
    retry.headers = {**headers, HEADER_RETRY_COUNT: str(number - 1)}
    return retry


def _replayable(options: FinalRequestOptions) -> bool:
    # A JSON body is rebuilt for every attempt; a file or a one-shot stream may not be.
    return options.files is None and (options.content is None
                                      or isinstance(options.content, bytes | bytearray))


def _response_of(result: Any) -> httpx2.Response | None:
    noted = _RESPONSE.get()
    _RESPONSE.set(None)  # do not keep the last response alive in this context
    if noted is not None:
        return noted
    found = getattr(result, "response", None) or getattr(result, "http_response", None)
    return found if isinstance(found, httpx2.Response) else None


def _check_interval(value: float) -> float:
    if not value > 0:
        raise ValueError(f"keepalive_interval must be positive, got {value}")
    return value


class OpenAI(openai.OpenAI):
    """``openai.OpenAI`` for a kvturn router: every openai call works unchanged, and
    ``conversation()`` gives a client whose turns reuse the previous turn's KV.

    >>> import kvturn
    >>> client = kvturn.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
    >>> with client.conversation() as chat:  # doctest: +SKIP
    ...     reply = chat.chat.completions.create(model="kvturn-tiny", messages=messages)
    ...     chat.last_turn.reuse
    'miss'

    kvturn arguments, on top of openai's (all keyword-only):

    * ``retry_policy``: timing of retries (``RetryPolicy``); the number stays ``max_retries``;
    * ``keepalive_interval``: seconds between lease renewals during ``pause()`` (default 60);
    * ``kvturn_url``: root of the router's ``/kvturn/v1`` endpoints (default: ``base_url``
      without its ``/v1``).
    """

    retry_policy: RetryPolicy
    keepalive_interval: float
    kvturn_url: str | None
    _kvturn_conversation: ConversationState | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # openai's copy() rebuilds a client with self.__class__(...), so the class of a scoped
        # client is chosen here, from the conversation handed over in the constructor kwargs.
        target: type[Any] = cls
        if kwargs.get("_kvturn_conversation") is not None:
            from kvturn._conversation import scoped_class

            target = scoped_class(cls)
        return cast(Self, object.__new__(target))

    def __init__(
        self,
        *,
        api_key: str | Callable[[], str] | None = None,
        organization: str | None = None,
        project: str | None = None,
        base_url: str | httpx2.URL | NotGiven | None = not_given,
        timeout: float | Timeout | NotGiven | None = not_given,
        max_retries: int = DEFAULT_MAX_RETRIES,
        default_headers: Mapping[str, str] | None = None,
        default_query: Mapping[str, object] | None = None,
        http_client: httpx2.Client | None = None,
        retry_policy: RetryPolicy | None = None,
        keepalive_interval: float = DEFAULT_KEEPALIVE_INTERVAL,
        kvturn_url: str | None = None,
        _kvturn_conversation: ConversationState | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(api_key=api_key, organization=organization, project=project,
                         base_url=base_url, timeout=timeout, max_retries=max_retries,
                         default_headers=default_headers, default_query=default_query,
                         http_client=http_client, **kwargs)
        self.retry_policy = retry_policy or RetryPolicy()
        self.keepalive_interval = _check_interval(keepalive_interval)
        self.kvturn_url = kvturn_url
        self._kvturn_conversation = _kvturn_conversation

    def conversation(self, id: str | None = None, *,
                     keepalive_interval: float | None = None) -> Conversation:
        """A client scoped to one conversation: same API, every request carries its id.

        ``id`` defaults to a random one, stable for the object's life. Use it as a context
        manager to release the router's retention at the end (``close()``).
        """
        conversation_id = new_conversation_id() if id is None else validate_conversation_id(id)
        interval = self.keepalive_interval if keepalive_interval is None else keepalive_interval
        state = ConversationState(conversation_id, keepalive_interval=_check_interval(interval))
        return cast("Conversation", self.copy(_extra_kwargs={"_kvturn_conversation": state}))

    def copy(
        self,
        *,
        api_key: str | Callable[[], str] | None = None,
        organization: str | None = None,
        project: str | None = None,
        base_url: str | httpx2.URL | NotGiven | None = not_given,
        timeout: float | Timeout | NotGiven | None = not_given,
        http_client: httpx2.Client | None = None,
        max_retries: int | NotGiven = not_given,
        default_headers: Mapping[str, str] | None = None,
        set_default_headers: Mapping[str, str] | None = None,
        default_query: Mapping[str, object] | None = None,
        set_default_query: Mapping[str, object] | None = None,
        retry_policy: RetryPolicy | None = None,
        keepalive_interval: float | None = None,
        kvturn_url: str | None = None,
        _extra_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Self:
        """openai's ``copy``/``with_options``, keeping kvturn's settings and the conversation
        (a copy of a scoped client is the same conversation: same id, record and counters)."""
        extra = {"retry_policy": retry_policy or self.retry_policy,
                 "keepalive_interval": (self.keepalive_interval if keepalive_interval is None
                                        else keepalive_interval),
                 "kvturn_url": kvturn_url or self.kvturn_url,
                 "_kvturn_conversation": self._kvturn_conversation, **(_extra_kwargs or {})}
        return super().copy(api_key=api_key, organization=organization, project=project,
                            base_url=base_url, timeout=timeout, http_client=http_client,
                            max_retries=max_retries, default_headers=default_headers,
                            set_default_headers=set_default_headers, default_query=default_query,
                            set_default_query=set_default_query, _extra_kwargs=extra, **kwargs)

    with_options = copy

    @property
    def _kvturn_root(self) -> str:
        return self.kvturn_url or router_root(self.base_url)

    @property
    def user_agent(self) -> str:
        # openai derives it from the class name; keep openai's own value, so the router and any
        # proxy see the client they would see without kvturn (not "Conversation/Python").
        return f"OpenAI/Python {openai.__version__}"

    # Same overloads, in the same order, as openai's SyncAPIClient.request.
    @overload
    def request(self, cast_to: type[_T], options: FinalRequestOptions, *,
                stream: Literal[True], stream_cls: type[_S]) -> _S: ...

    @overload
    def request(self, cast_to: type[_T], options: FinalRequestOptions, *,
                stream: Literal[False] = False) -> _T: ...

    @overload
    def request(self, cast_to: type[_T], options: FinalRequestOptions, *, stream: bool = False,
                stream_cls: type[_S] | None = None) -> _T | _S: ...

    def request(self, cast_to: type[_T], options: FinalRequestOptions, *, stream: bool = False,
                stream_cls: type[_S] | None = None) -> _T | _S:
        state = self._kvturn_conversation
        options, attempts, plan = _own_options(options, self.max_retries, state)
        send = super().request
        succeeded = 1

        def attempt(number: int) -> _T | _S:
            nonlocal succeeded
            succeeded = number
            if number == 1:
                return send(cast_to, options, stream=stream, stream_cls=stream_cls)
            token = _RETRIES_TAKEN.set(number - 1)
            try:
                return send(cast_to, _for_attempt(options, number), stream=stream,
                            stream_cls=stream_cls)
            finally:
                _RETRIES_TAKEN.reset(token)

        on_retry = None if state is None else (lambda *_: state.stats.add("retries"))
        result = call_with_retries(attempt, attempts=attempts, policy=self.retry_policy,
                                   replayable=_replayable(options), on_retry=on_retry)
        if state is not None:
            response = _response_of(result)
            if plan is not None and response is not None:
                _observe_turn(state, plan, result, response, succeeded, stream)
        return result

    def _process_response_data(self, *, data: object, cast_to: type[_T],
                               response: httpx2.Response) -> _T:
        state = self._kvturn_conversation
        if state is not None:
            follow = state.followers.get(response)
            if follow is not None:
                follow(data, response)
        return super()._process_response_data(data=data, cast_to=cast_to, response=response)

    def _process_response(self, *, cast_to: type[_T], options: FinalRequestOptions,
                          response: httpx2.Response, stream: bool,
                          stream_cls: type[Stream[Any]] | type[AsyncStream[Any]] | None,
                          retries_taken: int = 0) -> _T:
        if self._kvturn_conversation is not None:
            _RESPONSE.set(response)
        return super()._process_response(cast_to=cast_to, options=options, response=response,
                                         stream=stream, stream_cls=stream_cls,
                                         retries_taken=max(retries_taken, _RETRIES_TAKEN.get()))


class AsyncOpenAI(openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` for a kvturn router; the async twin of ``kvturn.OpenAI``.

    >>> import kvturn
    >>> client = kvturn.AsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
    >>> async with client.conversation() as chat:  # doctest: +SKIP
    ...     reply = await chat.chat.completions.create(model="kvturn-tiny", messages=messages)
    """

    retry_policy: RetryPolicy
    keepalive_interval: float
    kvturn_url: str | None
    _kvturn_conversation: ConversationState | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        target: type[Any] = cls
        if kwargs.get("_kvturn_conversation") is not None:
            from kvturn._conversation import scoped_class

            target = scoped_class(cls)
        return cast(Self, object.__new__(target))

    def __init__(
        self,
        *,
        api_key: str | Callable[[], Awaitable[str]] | None = None,
        organization: str | None = None,
        project: str | None = None,
        base_url: str | httpx2.URL | NotGiven | None = not_given,
        timeout: float | Timeout | NotGiven | None = not_given,
        max_retries: int = DEFAULT_MAX_RETRIES,
        default_headers: Mapping[str, str] | None = None,
        default_query: Mapping[str, object] | None = None,
        http_client: httpx2.AsyncClient | None = None,
        retry_policy: RetryPolicy | None = None,
        keepalive_interval: float = DEFAULT_KEEPALIVE_INTERVAL,
        kvturn_url: str | None = None,
        _kvturn_conversation: ConversationState | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(api_key=api_key, organization=organization, project=project,
                         base_url=base_url, timeout=timeout, max_retries=max_retries,
                         default_headers=default_headers, default_query=default_query,
                         http_client=http_client, **kwargs)
        self.retry_policy = retry_policy or RetryPolicy()
        self.keepalive_interval = _check_interval(keepalive_interval)
        self.kvturn_url = kvturn_url
        self._kvturn_conversation = _kvturn_conversation

    def conversation(self, id: str | None = None, *,
                     keepalive_interval: float | None = None) -> AsyncConversation:
        """A client scoped to one conversation (see ``kvturn.OpenAI.conversation``)."""
        conversation_id = new_conversation_id() if id is None else validate_conversation_id(id)
        interval = self.keepalive_interval if keepalive_interval is None else keepalive_interval
        state = ConversationState(conversation_id, keepalive_interval=_check_interval(interval))
        return cast("AsyncConversation",
                    self.copy(_extra_kwargs={"_kvturn_conversation": state}))

    def copy(
        self,
        *,
        api_key: str | Callable[[], Awaitable[str]] | None = None,
        organization: str | None = None,
        project: str | None = None,
        base_url: str | httpx2.URL | NotGiven | None = not_given,
        timeout: float | Timeout | NotGiven | None = not_given,
        http_client: httpx2.AsyncClient | None = None,
        max_retries: int | NotGiven = not_given,
        default_headers: Mapping[str, str] | None = None,
        set_default_headers: Mapping[str, str] | None = None,
        default_query: Mapping[str, object] | None = None,
        set_default_query: Mapping[str, object] | None = None,
        retry_policy: RetryPolicy | None = None,
        keepalive_interval: float | None = None,
        kvturn_url: str | None = None,
        _extra_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Self:
        """openai's ``copy``/``with_options``, keeping kvturn's settings and the conversation."""
        extra = {"retry_policy": retry_policy or self.retry_policy,
                 "keepalive_interval": (self.keepalive_interval if keepalive_interval is None
                                        else keepalive_interval),
                 "kvturn_url": kvturn_url or self.kvturn_url,
                 "_kvturn_conversation": self._kvturn_conversation, **(_extra_kwargs or {})}
        return super().copy(api_key=api_key, organization=organization, project=project,
                            base_url=base_url, timeout=timeout, http_client=http_client,
                            max_retries=max_retries, default_headers=default_headers,
                            set_default_headers=set_default_headers, default_query=default_query,
                            set_default_query=set_default_query, _extra_kwargs=extra, **kwargs)

    with_options = copy

    @property
    def _kvturn_root(self) -> str:
        return self.kvturn_url or router_root(self.base_url)

    @property
    def user_agent(self) -> str:
        return f"AsyncOpenAI/Python {openai.__version__}"

    # Same overloads, in the same order, as openai's AsyncAPIClient.request.
    @overload
    async def request(self, cast_to: type[_T], options: FinalRequestOptions, *,
                      stream: Literal[False] = False) -> _T: ...

    @overload
    async def request(self, cast_to: type[_T], options: FinalRequestOptions, *,
                      stream: Literal[True], stream_cls: type[_AS]) -> _AS: ...

    @overload
    async def request(self, cast_to: type[_T], options: FinalRequestOptions, *,
                      stream: bool, stream_cls: type[_AS] | None = None) -> _T | _AS: ...

    async def request(self, cast_to: type[_T], options: FinalRequestOptions, *,
                      stream: bool = False, stream_cls: type[_AS] | None = None) -> _T | _AS:
        state = self._kvturn_conversation
        options, attempts, plan = _own_options(options, self.max_retries, state)
        send = super().request
        succeeded = 1

        async def attempt(number: int) -> _T | _AS:
            nonlocal succeeded
            succeeded = number
            if number == 1:
                return await send(cast_to, options, stream=stream, stream_cls=stream_cls)
            token = _RETRIES_TAKEN.set(number - 1)
            try:
                return await send(cast_to, _for_attempt(options, number), stream=stream,
                                  stream_cls=stream_cls)
            finally:
                _RETRIES_TAKEN.reset(token)

        on_retry = None if state is None else (lambda *_: state.stats.add("retries"))
        result = await acall_with_retries(attempt, attempts=attempts, policy=self.retry_policy,
                                          replayable=_replayable(options), on_retry=on_retry)
        if state is not None:
            response = _response_of(result)
            if plan is not None and response is not None:
                _observe_turn(state, plan, result, response, succeeded, stream)
        return result

    def _process_response_data(self, *, data: object, cast_to: type[_T],
                               response: httpx2.Response) -> _T:
        state = self._kvturn_conversation
        if state is not None:
            follow = state.followers.get(response)
            if follow is not None:
                follow(data, response)
        return super()._process_response_data(data=data, cast_to=cast_to, response=response)

    async def _process_response(self, *, cast_to: type[_T], options: FinalRequestOptions,
                                response: httpx2.Response, stream: bool,
                                stream_cls: type[Stream[Any]] | type[AsyncStream[Any]] | None,
                                retries_taken: int = 0) -> _T:
        if self._kvturn_conversation is not None:
            _RESPONSE.set(response)
        return await super()._process_response(
            cast_to=cast_to, options=options, response=response, stream=stream,
            stream_cls=stream_cls, retries_taken=max(retries_taken, _RETRIES_TAKEN.get()))


def _observe_turn(state: ConversationState, plan: TurnPlan, result: Any,
                  response: httpx2.Response, attempts: int, stream: bool) -> None:
    state.started(plan, response, attempts=attempts, streamed=stream)
    observe_reply(state, plan, result)
