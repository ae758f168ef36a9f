"""Fixtures: a fake router behind httpx2.MockTransport, and kvturn clients wired to it with a
fake clock, so retries never sleep and nothing opens a socket."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx2
import pytest

import kvturn
from tests.fakes.router import FakeClock, FakeRouter
from tests.fakes.router_api import BASE_URL


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def policy(clock: FakeClock) -> kvturn.RetryPolicy:
    return kvturn.RetryPolicy(sleep=clock.sleep, async_sleep=clock.async_sleep, clock=clock)


@pytest.fixture
def router() -> FakeRouter:
    return FakeRouter()


@pytest.fixture
def arouter() -> FakeRouter:
    return FakeRouter(async_bodies=True)


@pytest.fixture
def client(router: FakeRouter, policy: kvturn.RetryPolicy) -> Iterator[kvturn.OpenAI]:
    http = httpx2.Client(transport=httpx2.MockTransport(router))
    with kvturn.OpenAI(base_url=BASE_URL, api_key="sk-test", http_client=http,
                       retry_policy=policy) as c:
        yield c


@pytest.fixture
async def aclient(arouter: FakeRouter,
                  policy: kvturn.RetryPolicy) -> AsyncIterator[kvturn.AsyncOpenAI]:
    http = httpx2.AsyncClient(transport=httpx2.MockTransport(arouter))
    async with kvturn.AsyncOpenAI(base_url=BASE_URL, api_key="sk-test", http_client=http,
                                  retry_policy=policy) as c:
        yield c
