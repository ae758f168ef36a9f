"""kvturn for LangGraph and LangChain: every LangGraph thread is a kvturn conversation.

Each model call carries the conversation id of its place in the graph (``thread_id``, plus a
fork per subgraph and per parallel branch), so every turn after the first reuses the KV the
decode retained from the turn before; tool calls keep the lease alive; the root run's end
releases it (``LeasePolicy``). See docs/langgraph.md.

    from kvturn_langgraph import KVTurnChatOpenAI, KVTurnMiddleware
    from langchain.agents import create_agent

    model = KVTurnChatOpenAI(model="kvturn-tiny", base_url="http://127.0.0.1:8000/v1",
                             api_key="-")
    agent = create_agent(model, tools, middleware=[KVTurnMiddleware()])
    agent.invoke({"messages": [("user", "Plan my trip")]},
                 {"configurable": {"thread_id": "trip-1"}})
"""

from kvturn_langgraph._middleware import KVTurnMiddleware
from kvturn_langgraph._model import KVTurnChatOpenAI
from kvturn_langgraph._nodes import current_conversation, kvturn_node
from kvturn_langgraph._policy import LeasePolicy
from kvturn_langgraph._tools import KVTurnToolNode, akeepalive_tool_call, keepalive_tool_call

__all__ = [
    "KVTurnChatOpenAI",
    "KVTurnMiddleware",
    "KVTurnToolNode",
    "LeasePolicy",
    "akeepalive_tool_call",
    "current_conversation",
    "keepalive_tool_call",
    "kvturn_node",
]
