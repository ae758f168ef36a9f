"""Following a stream for its usage event: what settles a ``pending`` report.

A stream the decode continued alone says ``X-KVTurn-Reuse: pending`` in its headers, and the
truth comes in the decode's usage event at the end (``prompt_tokens_details.cached_tokens``),
which a call gets when it asks (``stream_options.include_usage``). Only such a stream is
followed, and only for that event: its replies are the caller's and the server's business
(docs/sdk.md, "Edited histories").

openai's ``Stream`` / ``AsyncStream`` hands every chunk's JSON to its client's
``_process_response_data`` as the caller iterates (``Stream.__stream__`` reads that method
from its client when iteration starts). A followed stream's client is a ``StreamClient``
standing in for the conversation in that one stream, whose ``_process_response_data`` is the
follower's ``take``: it looks for the usage, then decodes the chunk with the conversation's
own method. So every other stream pays nothing per chunk.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, TypeVar, cast

import httpx2

if TYPE_CHECKING:
    from openai import AsyncStream, Stream

    from kvturn._state import ConversationState, TurnPlan

log = logging.getLogger("kvturn")

_T = TypeVar("_T")


class StreamClient:
    """The client of one followed stream (``Stream._client``): openai's stream reads only
    ``_process_response_data`` from it once it is built, and this one is a follower's
    ``take``. Every other attribute is the conversation's (a newer openai may read more, and
    code that reaches the HTTP client through ``stream._client._client`` still finds it)."""

    __slots__ = ("_kvturn_target", "_process_response_data")

    def __init__(self, client: Any, take: Any) -> None:
        self._kvturn_target = client
        self._process_response_data = take

    def __getattr__(self, name: str) -> Any:
        if name == "_kvturn_target":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._kvturn_target, name)


class StreamFollower:
    """Settles turn ``plan`` from the first usage event of its stream that gives the cached
    tokens (vLLM sends usage after every choice finished; with continuous usage every chunk
    has one, and their prompt counts are the same)."""

    __slots__ = ("_decode", "_plan", "_state", "following")

    def __init__(self, state: ConversationState, plan: TurnPlan,
                 stream: Stream[Any] | AsyncStream[Any]) -> None:
        self._state, self._plan = state, plan
        self.following = True  # False once settled, or when a chunk cannot be read
        # The stream binds its client's _process_response_data when the caller starts
        # iterating, which is after this (openai builds the stream, kvturn's
        # _process_response sees it, then the caller gets it).
        client = stream._client
        self._decode = client._process_response_data
        stream._client = cast(Any, StreamClient(client, self.take))

    def take(self, *, data: object, cast_to: type[_T], response: httpx2.Response) -> _T:
        """One chunk's JSON, on its way to openai's decoding."""
        if self.following and type(data) is dict:
            usage = data.get("usage")
            if usage:
                try:
                    self.following = not self._state.settle(self._plan, usage)
                except Exception:  # bookkeeping must never break the caller's iteration
                    self.following = False
                    log.debug("kvturn: cannot read the usage of conversation %s's stream; "
                              "its turn stays pending", self._state.id, exc_info=True)
        result: _T = self._decode(data=data, cast_to=cast_to, response=response)
        return result
