"""kvturn for LangGraph and LangChain: every graph run is a conversation (in development)."""

__all__: list[str] = []
