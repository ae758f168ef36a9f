"""``KVTurnModelProvider``: the Agents SDK's model provider on a ``kvturn.AsyncOpenAI``."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from agents.exceptions import UserError
from agents.models.interface import Model, ModelProvider

import kvturn
from kvturn_agents._model import API, KVTurnModel, OnTurn
from kvturn_agents._runs import RunLeases


class KVTurnModelProvider(ModelProvider):
    """Every ``Runner.run`` on this provider is one kvturn conversation.

    ``api``: ``"chat"`` runs the SDK's ``OpenAIChatCompletionsModel``, ``"responses"`` its
    ``OpenAIResponsesModel``, both on ``client``. ``model``: the name used when the agent
    names none. ``on_turn(conversation)``: called after each answered model call with the
    conversation it ran on (``.id``, ``.last_turn``, ``.stats``). ``keepalive_interval``:
    seconds between lease renewals while the run's tools execute (default: the client's).

    >>> provider = KVTurnModelProvider(kvturn.AsyncOpenAI(base_url=url, api_key="-"))
    >>> result = await Runner.run(agent, "Plan my trip",  # doctest: +SKIP
    ...                           run_config=RunConfig(model_provider=provider))
    """

    def __init__(self, client: kvturn.AsyncOpenAI, *, api: API = "chat",
                 model: str | None = None, on_turn: OnTurn | None = None,
                 keepalive_interval: float | None = None) -> None:
        if not isinstance(client, kvturn.AsyncOpenAI):
            raise TypeError("KVTurnModelProvider needs a kvturn.AsyncOpenAI client, got "
                            f"{type(client).__name__}")
        if api not in ("chat", "responses"):
            raise ValueError(f"api must be 'chat' or 'responses', got {api!r}")
        if isinstance(client, kvturn.AsyncConversation):
            raise TypeError("pass the kvturn.AsyncOpenAI client, not a conversation: the "
                            "provider opens one per run (or use provider.conversation(id))")
        self.client = client
        self.api: API = api
        self.default_model = model
        self._leases = RunLeases(client, keepalive_interval)
        self._on_turn = on_turn
        self._models: dict[str, KVTurnModel] = {}

    def get_model(self, model_name: str | None) -> Model:
        name = model_name or self.default_model
        if not name:
            raise UserError("the agent names no model and KVTurnModelProvider(model=...) "
                            "was not given one")
        # One object per name: the SDK notes each model it resolves once per run and calls
        # its run-end cleanup once.
        model = self._models.get(name)
        if model is None:
            model = self._models[name] = KVTurnModel(name, self.api, self._leases,
                                                     self._on_turn)
        return model

    def conversation(self, id: str | None = None
                     ) -> AbstractAsyncContextManager[kvturn.AsyncConversation]:
        """One conversation for the runs started inside, released at the exit: what an SDK
        ``Session`` needs, so that each user message's run reuses the KV of the one before.

        >>> async with provider.conversation(session.session_id):  # doctest: +SKIP
        ...     await Runner.run(agent, "Plan my trip", session=session, run_config=config)
        ...     await Runner.run(agent, "Cheaper, please", session=session, run_config=config)

        Runs take it one at a time; a run started while another holds it (an agent used as
        a tool) gets a conversation of its own.
        """
        return self._leases.scope(id)
