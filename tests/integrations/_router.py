"""The integration tests' fake router lives in ``tests/fakes/agent_router.py``; this name stays
so that the integration's test modules keep importing it from here."""

from __future__ import annotations

from tests.fakes.agent_router import ToolCallingRouter as FakeRouter
from tests.fakes.router_api import Recorded

__all__ = ["FakeRouter", "Recorded"]
