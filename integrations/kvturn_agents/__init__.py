"""kvturn for the OpenAI Agents SDK: every ``Runner.run`` is a kvturn conversation.

Each model call of a run carries the run's conversation id, so every turn after the first
reuses the KV the decode retained from the turn before; the lease is kept alive while the
run's tools execute and released when the run ends. Both of the SDK's OpenAI models work:
``api="chat"`` (``OpenAIChatCompletionsModel``) and ``api="responses"``
(``OpenAIResponsesModel``). See docs/agents.md.

    import kvturn
    from agents import Agent, RunConfig, Runner
    from kvturn_agents import KVTurnModelProvider

    provider = KVTurnModelProvider(kvturn.AsyncOpenAI(base_url="http://127.0.0.1:8000/v1",
                                                      api_key="-"), model="kvturn-tiny")
    agent = Agent(name="planner", instructions="...", tools=[...])
    result = await Runner.run(agent, "Plan my trip",
                              run_config=RunConfig(model_provider=provider))
"""

from kvturn_agents._model import KVTurnModel
from kvturn_agents._provider import KVTurnModelProvider

__all__ = ["KVTurnModel", "KVTurnModelProvider"]
