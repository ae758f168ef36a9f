"""``kvturn.OpenAI`` and ``kvturn.AsyncOpenAI``: openai's clients plus conversations and retries.

Thin shells over ``KVTurnClientBase`` (``_base_client``), which holds everything the two share;
here is only what differs: the retry sleep (blocking or awaited), ``_process_response`` (async
in the async client), and ``conversation()``'s return type.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar, cast

import httpx2
import openai
from openai import AsyncStream, Stream

from kvturn._base_client import KVTurnClientBase
from kvturn._compat import FinalRequestOptions

if TYPE_CHECKING:
    from kvturn._conversation import AsyncConversation, Conversation

_T = TypeVar("_T")
_StreamClass = type[Stream[Any]] | type[AsyncStream[Any]] | None


class OpenAI(KVTurnClientBase, openai.OpenAI):
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

    _openai_name = "OpenAI"

    def conversation(self, id: str | None = None, *,
                     keepalive_interval: float | None = None) -> Conversation:
        """A client scoped to one conversation: same API, every request carries its id.

        ``id`` defaults to a random one, stable for the object's life. Use it as a context
        manager to release the router's retention at the end (``close()``).
        """
        return cast("Conversation", self._scoped(id, keepalive_interval))

    def _sleep_for_retry(self, *, retries_taken: int, max_retries: int,
                         options: FinalRequestOptions, response: httpx2.Response | None) -> None:
        self.retry_policy.sleep(self._kvturn_retry_wait(response))

    def _process_response(self, *, cast_to: type[_T], options: FinalRequestOptions,
                          response: httpx2.Response, stream: bool, stream_cls: _StreamClass,
                          retries_taken: int = 0) -> _T:
        result: _T = super()._process_response(
            cast_to=cast_to, options=options, response=response, stream=stream,
            stream_cls=stream_cls, retries_taken=retries_taken)
        return self._kvturn_answered(options, response, stream, retries_taken, result)


class AsyncOpenAI(KVTurnClientBase, openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` for a kvturn router; the async twin of ``kvturn.OpenAI``.

    >>> import kvturn
    >>> client = kvturn.AsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
    >>> async with client.conversation() as chat:  # doctest: +SKIP
    ...     reply = await chat.chat.completions.create(model="kvturn-tiny", messages=messages)
    """

    _openai_name = "AsyncOpenAI"

    def conversation(self, id: str | None = None, *,
                     keepalive_interval: float | None = None) -> AsyncConversation:
        """A client scoped to one conversation (see ``kvturn.OpenAI.conversation``)."""
        return cast("AsyncConversation", self._scoped(id, keepalive_interval))

    async def _sleep_for_retry(self, *, retries_taken: int, max_retries: int,
                               options: FinalRequestOptions,
                               response: httpx2.Response | None) -> None:
        await self.retry_policy.async_sleep(self._kvturn_retry_wait(response))

    async def _process_response(self, *, cast_to: type[_T], options: FinalRequestOptions,
                                response: httpx2.Response, stream: bool,
                                stream_cls: _StreamClass, retries_taken: int = 0) -> _T:
        result: _T = await super()._process_response(
            cast_to=cast_to, options=options, response=response, stream=stream,
            stream_cls=stream_cls, retries_taken=retries_taken)
        return self._kvturn_answered(options, response, stream, retries_taken, result)
