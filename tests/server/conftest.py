"""Fixtures of the server tests: routers over scripted fakes (``tests/fakes/router_harness.py``).
The redis-server fixtures are in ``tests/conftest.py``, shared with the e2e suite."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest

from kvturn_server.router import Router, RouterConfig, create_app
from kvturn_server.router._state import ConversationStore
from tests.fakes.backends import Cluster, ManualClock
from tests.fakes.router_harness import TEST_SETTINGS, Harness, MakeHarness


@pytest.fixture
async def make_harness() -> AsyncIterator[MakeHarness]:
    made: list[Harness] = []

    async def make(cluster: Cluster | None = None, *, store: ConversationStore | None = None,
                   clock: ManualClock | None = None, health_checks: bool = False,
                   **settings: Any) -> Harness:
        cluster = cluster or Cluster()
        clock = clock or ManualClock()
        config = RouterConfig(**{"prefill": cluster.prefill_urls,
                                 "decode": cluster.decode_urls, **TEST_SETTINGS, **settings})
        app = create_app(config, cluster.transport(), store=store, clock=clock)
        router: Router = app.state.router
        await router.start(health_checks=health_checks)
        client = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                    base_url="http://router")
        harness = Harness(cluster, router, app, client, clock)
        made.append(harness)
        return harness

    yield make
    for h in made:
        await h.client.aclose()
        if h.router.started:
            await h.router.aclose()
    await asyncio.sleep(0)
