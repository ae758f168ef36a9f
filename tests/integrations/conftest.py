"""Fixtures: a fake router behind ``httpx2.MockTransport`` and kvturn clients on it, with a
keepalive interval short enough that heartbeats show up in milliseconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

import kvturn
from kvturn_langgraph import KVTurnChatOpenAI, LeasePolicy
from tests.fakes.agent_clients import KEEPALIVE, ModelFactory
from tests.fakes.router_api import BASE_URL
from tests.integrations._router import FakeRouter


@pytest.fixture
def router() -> FakeRouter:
    return FakeRouter()


@pytest.fixture(autouse=True)
def no_lease_threads_left() -> Iterator[None]:
    """Every keepalive and hold loop a test starts has ended when the test is over."""
    yield
    deadline = time.monotonic() + 5
    for thread in threading.enumerate():
        if thread.name.startswith(("kvturn-hold:", "kvturn-keepalive:")):
            thread.join(max(deadline - time.monotonic(), 0))
            assert not thread.is_alive(), f"{thread.name} still running after the test"


@pytest.fixture
def clients(router: FakeRouter) -> Iterator[tuple[kvturn.OpenAI, kvturn.AsyncOpenAI]]:
    transport = httpx2.MockTransport(router)
    sync = kvturn.OpenAI(base_url=BASE_URL, api_key="tenant", keepalive_interval=KEEPALIVE,
                         http_client=httpx2.Client(transport=transport), max_retries=0)
    aio = kvturn.AsyncOpenAI(base_url=BASE_URL, api_key="tenant", keepalive_interval=KEEPALIVE,
                             http_client=httpx2.AsyncClient(transport=transport), max_retries=0)
    yield sync, aio
    sync.close()


@pytest.fixture
def make_model(router: FakeRouter,
               clients: tuple[kvturn.OpenAI, kvturn.AsyncOpenAI]) -> ModelFactory:
    """A KVTurnChatOpenAI on the fake router; ``new_clients=True`` gives it kvturn clients of
    its own (nothing shared with earlier models: what another process would have)."""

    def make(*, policy: LeasePolicy | None = None, new_clients: bool = False,
             **kwargs: Any) -> KVTurnChatOpenAI:
        sync, aio = clients
        if new_clients:
            transport = httpx2.MockTransport(router)
            sync = kvturn.OpenAI(base_url=BASE_URL, api_key="tenant",
                                 keepalive_interval=KEEPALIVE, max_retries=0,
                                 http_client=httpx2.Client(transport=transport))
            aio = kvturn.AsyncOpenAI(base_url=BASE_URL, api_key="tenant",
                                     keepalive_interval=KEEPALIVE, max_retries=0,
                                     http_client=httpx2.AsyncClient(transport=transport))
        return KVTurnChatOpenAI(model="kvturn-tiny", root_client=sync, root_async_client=aio,
                                lease_policy=policy or LeasePolicy(), **kwargs)

    return make


@pytest.fixture
def model(make_model: ModelFactory) -> KVTurnChatOpenAI:
    return make_model()
