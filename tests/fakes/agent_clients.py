"""What the integration tests' clients on the fake router (``agent_router.py``) share: their
keepalive interval, short enough that heartbeats show up in milliseconds, and the type of the
``make_model`` fixture (``tests/integrations/conftest.py``) that builds models on them."""

from __future__ import annotations

from collections.abc import Callable

from kvturn_langgraph import KVTurnChatOpenAI

KEEPALIVE = 0.01

ModelFactory = Callable[..., KVTurnChatOpenAI]
