"""The SDK against the real router (docs/http-api.md, section A), in-process.

The router's ASGI app runs over ``httpx2.ASGITransport`` with the server tests' scripted
prefill/decode/control fakes behind it: no sockets, no vLLM. If this fails while the SDK's own
tests pass, the two sides of the contract have drifted apart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest

import kvturn
from kvturn_server.router import Router, RouterConfig, create_app
from tests.fakes.backends import Cluster, ManualClock
from tests.fakes.router_harness import TEST_SETTINGS


@pytest.fixture
async def routed() -> AsyncIterator[tuple[kvturn.AsyncOpenAI, Router, Cluster]]:
    cluster = Cluster()
    config = RouterConfig(**{"prefill": cluster.prefill_urls, "decode": cluster.decode_urls,
                             **TEST_SETTINGS})
    app = create_app(config, cluster.transport(), clock=ManualClock())
    router: Router = app.state.router
    await router.start(health_checks=False)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
    client = kvturn.AsyncOpenAI(base_url="http://router.test/v1", api_key="sk-contract",
                                http_client=http, max_retries=0)
    try:
        yield client, router, cluster
    finally:
        await client.close()
        await router.aclose()


async def test_turns_reuse_hints_keepalive_and_release(
        routed: tuple[kvturn.AsyncOpenAI, Router, Cluster]) -> None:
    client, router, cluster = routed
    async with client.conversation("agent/run:1#x") as chat:
        messages: list[Any] = [{"role": "user", "content": "hi"}]
        reply = await chat.chat.completions.create(model="m", messages=messages)
        await router.wait_idle()
        assert chat.last_turn is not None and chat.last_turn.reuse == "miss"
        assert chat.last_turn.router_conversation == "agent/run:1#x"

        messages += [reply.choices[0].message, {"role": "user", "content": "more"}]
        stream = await chat.chat.completions.create(model="m", messages=messages, stream=True)
        assert chat.last_turn.reuse == "hit" and chat.last_turn.reused_tokens > 0
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        await router.wait_idle()

        # An edited history goes as written: the router pins the retention and hands it to
        # the prefill, whose connector reads only the blocks that verify (up to the edit).
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "x"}]
        messages[0] = {"role": "user", "content": "edited"}
        cluster.log.clear()
        await chat.chat.completions.create(model="m", messages=messages)
        await router.wait_idle()
        assert cluster.calls("decode0.control", "POST") != []  # the pin
        [prefill] = cluster.bodies("prefill0")
        assert prefill["kv_transfer_params"]["remote_engine_id"] is not None
        assert chat.last_turn.no_reuse_reason is None and chat.last_turn.reuse == "hit"

        # The caller's explicit opt-out is the router's to honour, and the report names it.
        await chat.chat.completions.create(model="m", messages=messages,
                                           extra_headers={"X-KVTurn-No-Reuse": "policy"})
        await router.wait_idle()
        assert chat.last_turn.no_reuse_reason == "policy"
        assert chat.last_turn.reuse == "disabled"

        lease = await chat.keepalive()
        assert lease.retained and lease.conversation_id == "agent/run:1#x"
    assert chat.stats.release_failures == 0
    with pytest.raises(kvturn.ConversationNotFoundError):
        await chat.keepalive()  # released: the router holds nothing for it any more
