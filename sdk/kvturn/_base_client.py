"""What ``kvturn.OpenAI`` and ``kvturn.AsyncOpenAI`` share: everything but sleeping and awaiting.

The clients subclass openai's, the way openai's own ``AzureOpenAI`` does, and leave openai's
request loop (``request``) alone: one API call costs what it costs in openai plus a few
microseconds in these hooks (``tests/sdk/test_canary.py`` pins each):

* ``_build_request``: called by openai's loop for each attempt, on its own copy of the request
  options. A scoped client stamps the conversation id there (``ConversationState.prepare``),
  and the call's bookkeeping for the retry hooks is noted (in a context variable, so threads
  and tasks never mix calls up).
* ``_should_retry`` and ``_sleep_for_retry``: openai's loop asks them whether and when to try
  again; kvturn's ``RetryPolicy`` answers (rules in ``_retry``).
* ``_process_response``: the response of the attempt that succeeded; a scoped client reads the
  router's reuse report there (``_observe``); a ``pending`` stream that asked for usage is
  followed for its usage event through a stand-in client of that one stream, so other calls
  pay nothing per chunk.
* ``copy`` / ``with_options``: carry kvturn's settings and the conversation to the copy; and
  ``__new__`` picks the scoped class when a conversation is handed over.
* ``user_agent``: openai's own value, whatever the subclass is called.

``_client.py`` holds the two thin shells: the hooks that sleep or await (``_sleep_for_retry``,
``_process_response``) and the typed ``conversation()``.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar, cast

import httpx2
import openai

from kvturn._compat import FinalRequestOptions, get_platform, timeout_exceptions
from kvturn._constants import DEFAULT_KEEPALIVE_INTERVAL
from kvturn._endpoints import router_root
from kvturn._identity import new_conversation_id, validate_conversation_id
from kvturn._observe import observe_turn
from kvturn._retry import RetryPolicy, past_deadline, retry_wait, transient_status
from kvturn._state import ConversationState, TurnPlan

if TYPE_CHECKING:
    from openai._base_client import BaseClient

    _OpenAIClient = BaseClient[Any, Any]
else:
    _OpenAIClient = object

_T = TypeVar("_T")

log = logging.getLogger("kvturn")


class _Call:
    """The API call in flight in this thread or task, as the hooks of its attempts see it."""

    __slots__ = ("attempt", "options", "plan", "request", "start", "wait")

    def __init__(self, start: float) -> None:
        self.start = start  # on the retry policy's clock, when attempt 1 was built
        self.attempt = 1
        self.options: FinalRequestOptions | None = None
        self.plan: TurnPlan | None = None
        self.request: httpx2.Request | None = None
        self.wait = 0.0  # decided by _should_retry for the coming _sleep_for_retry

    def replayable(self) -> bool:
        # A JSON body is rebuilt for every attempt; a file or a one-shot stream may not be.
        options = self.options
        return options is None or (options.files is None and (
            options.content is None or isinstance(options.content, bytes | bytearray)))


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("kvturn_call", default=None)


def _check_interval(value: float) -> float:
    if not value > 0:
        raise ValueError(f"keepalive_interval must be positive, got {value}")
    return value


class KVTurnClientBase(_OpenAIClient):
    """The shared body of ``kvturn.OpenAI`` and ``kvturn.AsyncOpenAI`` (see the module
    docstring); it comes first in their bases, before openai's client."""

    retry_policy: RetryPolicy
    keepalive_interval: float
    kvturn_url: str | None
    _kvturn_conversation: ConversationState | None
    # openai's class name, for user_agent.
    _openai_name: ClassVar[str]

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # openai's copy() rebuilds a client with self.__class__(...), so the class of a scoped
        # client is chosen here, from the conversation handed over in the constructor kwargs.
        target: type[Any] = cls
        if kwargs.get("_kvturn_conversation") is not None:
            from kvturn._conversation import scoped_class

            target = scoped_class(cls)
        return cast(Self, object.__new__(target))

    def __init__(self, *, retry_policy: RetryPolicy | None = None,
                 keepalive_interval: float = DEFAULT_KEEPALIVE_INTERVAL,
                 kvturn_url: str | None = None,
                 _kvturn_conversation: ConversationState | None = None,
                 **kwargs: Any) -> None:
        """openai's arguments (``api_key``, ``base_url``, ``http_client``, ...) go to openai's
        client unchanged; kvturn's are keyword-only and documented on the class."""
        super().__init__(**kwargs)
        self.retry_policy = retry_policy or RetryPolicy()
        self.keepalive_interval = _check_interval(keepalive_interval)
        self.kvturn_url = kvturn_url
        self._kvturn_conversation = _kvturn_conversation

    def _scoped(self, id: str | None, keepalive_interval: float | None) -> Self:
        """A copy of this client scoped to conversation ``id`` (``conversation()``)."""
        conversation_id = new_conversation_id() if id is None else validate_conversation_id(id)
        interval = self.keepalive_interval if keepalive_interval is None else keepalive_interval
        state = ConversationState(conversation_id, keepalive_interval=_check_interval(interval))
        return self.copy(_extra_kwargs={"_kvturn_conversation": state})

    def copy(self, *, retry_policy: RetryPolicy | None = None,
             keepalive_interval: float | None = None, kvturn_url: str | None = None,
             _extra_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> Self:
        """openai's ``copy``/``with_options`` (its arguments pass through), keeping kvturn's
        settings and the conversation (a copy of a scoped client is the same conversation:
        same id, last report and counters)."""
        extra = {"retry_policy": retry_policy or self.retry_policy,
                 "keepalive_interval": (self.keepalive_interval if keepalive_interval is None
                                        else keepalive_interval),
                 "kvturn_url": kvturn_url or self.kvturn_url,
                 "_kvturn_conversation": self._kvturn_conversation, **(_extra_kwargs or {})}
        copied: Self = cast(Any, super()).copy(_extra_kwargs=extra, **kwargs)
        # openai's async client finds its platform in a worker thread on a client's first
        # request (hundreds of microseconds), and every conversation is a new client: find it
        # once for the client and its copies (one small file read, cached by the stdlib).
        if self._platform is None:
            self._platform = get_platform()
        copied._platform = self._platform
        return copied

    with_options = copy

    @property
    def _kvturn_root(self) -> str:
        return self.kvturn_url or router_root(self.base_url)

    @property
    def user_agent(self) -> str:
        # openai derives it from the class name; keep openai's own value, so the router and any
        # proxy see the client they would see without kvturn (not "Conversation/Python").
        return f"{self._openai_name}/Python {openai.__version__}"

    # --- hooks of openai's request loop ------------------------------------------------------

    def _build_request(self, options: FinalRequestOptions, *,
                       retries_taken: int = 0) -> httpx2.Request:
        state = self._kvturn_conversation
        plan = state.prepare(options) if state is not None else None
        request = super()._build_request(options, retries_taken=retries_taken)
        call = _CALL.get() if retries_taken else None
        if call is None:
            call = _Call(self.retry_policy.clock())
            _CALL.set(call)
        call.attempt = retries_taken + 1
        call.options, call.plan, call.request = options, plan, request
        return request

    def _should_retry(self, response: httpx2.Response) -> bool:
        """Whether openai's loop may send this failed request again (status errors)."""
        call, policy = _CALL.get(), self.retry_policy
        if (call is None or not call.replayable()
                or not transient_status(response.status_code, response.headers, policy)):
            return False
        wait = retry_wait(policy, call.attempt, response.headers)
        if past_deadline(policy, call.start, wait):
            return False
        call.wait = wait
        return True

    def _kvturn_retry_wait(self, response: httpx2.Response | None) -> float:
        """The wait before the next attempt, for ``_sleep_for_retry``.

        openai's loop retries a connection error or timeout without asking ``_should_retry``,
        so that decision is made here: when the policy says no, this raises the error openai's
        loop raises when it stops (it is called inside the loop's ``except`` block).
        """
        call, policy = _CALL.get(), self.retry_policy
        assert call is not None, "_sleep_for_retry outside a call"
        if response is None:
            wait = retry_wait(policy, call.attempt, None)
            if not call.replayable() or past_deadline(policy, call.start, wait):
                error = sys.exc_info()[1]
                request = cast(httpx2.Request, call.request)
                if isinstance(error, timeout_exceptions()):
                    raise openai.APITimeoutError(request=request) from error
                raise openai.APIConnectionError(request=request) from error
            failure = type(sys.exc_info()[1]).__name__
        else:
            wait, failure = call.wait, f"HTTP {response.status_code}"
        log.info("kvturn: attempt %d failed (%s); retrying in %.2f s", call.attempt, failure,
                 wait)
        state = self._kvturn_conversation
        if state is not None:
            state.stats.add("retries")
        return wait

    def _kvturn_answered(self, options: FinalRequestOptions, response: httpx2.Response,
                         stream: bool, retries_taken: int, result: _T) -> _T:
        """``result``, openai's processed response, after a scoped client has noted the
        router's report on the turn and arranged to see its reply (``_process_response``)."""
        call = _CALL.get()
        if call is None:
            return result
        _CALL.set(None)  # do not keep this call's objects alive in this context
        state, plan = self._kvturn_conversation, call.plan
        if state is not None and plan is not None and call.options is options:
            observe_turn(state, plan, response, result, attempts=retries_taken + 1,
                         streamed=stream)
        return result
