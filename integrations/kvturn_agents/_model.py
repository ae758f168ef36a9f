"""``KVTurnModel``: an Agents SDK ``Model`` whose calls run on the kvturn conversation of
their run.

It holds no client of its own: each call asks ``RunLeases`` for its run's conversation and
runs the SDK's own model (``OpenAIChatCompletionsModel`` or ``OpenAIResponsesModel``) on that
conversation's scoped ``kvturn.AsyncConversation``, so the request and reply handling are the
SDK's, unchanged, and kvturn adds only the conversation id, the reuse report, the keepalive
between turns and the release at the run's end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Literal

from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel
from agents.models.interface import Model

import kvturn
from kvturn_agents._runs import RunLease, RunLeases

if TYPE_CHECKING:
    from agents.items import ModelResponse, TResponseStreamEvent

API = Literal["chat", "responses"]
OnTurn = Callable[[kvturn.AsyncConversation], None]


def sdk_model(api: API, name: str, conversation: kvturn.AsyncConversation) -> Model:
    """The SDK's own model for ``api`` on a conversation's client."""
    if api == "responses":
        return OpenAIResponsesModel(model=name, openai_client=conversation)
    return OpenAIChatCompletionsModel(model=name, openai_client=conversation)


class KVTurnModel(Model):
    """One model name of a ``KVTurnModelProvider``; get it from ``provider.get_model(name)``."""

    def __init__(self, name: str, api: API, leases: RunLeases,
                 on_turn: OnTurn | None = None) -> None:
        self.name = name
        self.api = api
        self._leases = leases
        self._on_turn = on_turn

    async def _start(self) -> tuple[object | None, RunLease, Model]:
        owner, _ = self._leases.current()
        lease = self._leases.open(owner)
        await lease.resume()
        return owner, lease, sdk_model(self.api, self.name, lease.conversation)

    async def _end(self, owner: object | None, lease: RunLease, *, answered: bool) -> None:
        if answered and self._on_turn is not None:
            self._on_turn(lease.conversation)
        if owner is None:
            await lease.finish()  # a call outside any run is a conversation of its own
        else:
            await lease.hold()  # the run goes on with its tools: keep the lease alive

    # Both calls take the SDK's ``Model`` parameters and forward them as they came: the model
    # that runs the call is the SDK's own, so whatever the runner passes (a later release's
    # new parameters too) reaches it unchanged; kvturn reads none of them.

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        owner, lease, model = await self._start()
        answered = False
        try:
            response = await model.get_response(*args, **kwargs)
            answered = True
            return response
        finally:
            await self._end(owner, lease, answered=answered)

    async def stream_response(self, *args: Any,
                              **kwargs: Any) -> AsyncIterator[TResponseStreamEvent]:
        owner, lease, model = await self._start()
        answered = False
        try:
            async for event in model.stream_response(*args, **kwargs):
                yield event
            answered = True
        finally:
            await self._end(owner, lease, answered=answered)

    async def _cleanup_on_run_end(self, owner: object) -> None:
        # The SDK calls this once per model per run, from the run's ``finally``.
        await self._leases.finish(owner)
