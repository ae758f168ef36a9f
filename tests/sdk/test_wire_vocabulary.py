"""The SDK's copy of the wire vocabulary (``kvturn._constants``) against the server's.

The SDK stays dependency-free (it must not import ``kvturn_server``), so it spells the router
API's names and defaults out itself (docs/http-api.md, section A). This test imports both sides
and holds them together: a name changed on one side only fails here, not in production. Names
the router only writes inline (response headers) are checked through the router's own app.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx2
import pytest

from kvturn import _constants as sdk
from kvturn._errors import InvalidConversationIdError
from kvturn._identity import validate_conversation_id
from kvturn._turns import TurnInfo
from kvturn_server._defaults import KEEPALIVES_PER_TTL, RETENTION_TTL
from kvturn_server.connector._config import ConnectorConfig
from kvturn_server.connector._control import PREFIX as CONTROL_PREFIX
from kvturn_server.connector._lease import GoneReason
from kvturn_server.connector._reuse import ReuseReason
from kvturn_server.router import Router, RouterConfig, create_app
from kvturn_server.router._conversations import PREFIX as CONVERSATIONS_PREFIX
from kvturn_server.router._errors import ApiError
from kvturn_server.router._identity import _SOURCES, MAX_ID_LENGTH, validate_id
from kvturn_server.router._legs import PENDING, REUSE_REASONS, DecodeUsage, continued_reuse
from tests.fakes.backends import Cluster, ManualClock
from tests.fakes.router_harness import TEST_SETTINGS

_ROOT = "http://router.test/"


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def test_reuse_outcomes_are_the_routers_and_the_connectors() -> None:
    # The connector's reasons, plus the router's own "pending" (a continued stream).
    assert {reason.value for reason in ReuseReason} == REUSE_REASONS
    assert set(sdk.REUSE_OUTCOMES) == REUSE_REASONS | {PENDING}
    assert sdk.PENDING == PENDING and PENDING not in REUSE_REASONS
    assert len(sdk.REUSE_OUTCOMES) == len(set(sdk.REUSE_OUTCOMES))
    assert {ReuseReason.HIT.value, ReuseReason.PARTIAL.value} == sdk.REUSED_OUTCOMES
    assert sdk.UNREPORTED not in REUSE_REASONS


def test_the_sdk_settles_a_pending_turn_as_the_router_does() -> None:
    pending = TurnInfo("c", "chat", PENDING, 0, None, None, None, 1, True, None)
    for block_size in (0, 16, 128):
        for prompt in (1, 16, 17, 64, 129, 300):
            for cached in (0, 16, 32, 48, 64, 128, 256, 300):
                settled = pending._replace(block_size=block_size or None).settled(prompt,
                                                                                  cached)
                found = continued_reuse(DecodeUsage(prompt, 1, cached), None, block_size)
                assert found is not None
                assert (settled.reuse, settled.reused_tokens) == \
                    (found.reason, found.reused_tokens), (block_size, prompt, cached)


def test_gone_codes_are_the_connectors_plus_stale() -> None:
    assert set(sdk.GONE_CODES) == {reason.value for reason in GoneReason} | {"stale"}
    assert GoneReason.NO_RETENTION.value == sdk.NO_RETENTION_CODE


def test_identity_fields_and_id_limit() -> None:
    assert _SOURCES[0] == ("body", sdk.BODY_CONVERSATION_ID)
    assert _SOURCES[1] == ("header", sdk.HEADER_CONVERSATION_ID.lower())
    assert sdk.ID_MAX_LENGTH == MAX_ID_LENGTH


@pytest.mark.parametrize("candidate", [
    "a", "x" * 256, "x" * 257, "", "with space", "caf\u00e9", "tab\there", "~!#%/:?", "kvt-0",
    "\x7f", 7])
def test_the_sdk_accepts_exactly_the_ids_the_router_accepts(candidate: object) -> None:
    try:
        validate_id(candidate, "conversation_id")
        router_accepts = True
    except ApiError:
        router_accepts = False
    try:
        validate_conversation_id(candidate)
        sdk_accepts = True
    except InvalidConversationIdError:
        sdk_accepts = False
    assert sdk_accepts == router_accepts
    # a generated id is one the router takes
    validate_id(sdk.GENERATED_ID_PREFIX + "0" * 32, "conversation_id")


def test_path_prefixes() -> None:
    assert "/" + sdk.CONVERSATIONS_PATH == CONVERSATIONS_PREFIX
    assert CONVERSATIONS_PREFIX.startswith(CONTROL_PREFIX + "/")


def test_default_lease_is_the_connectors_and_the_routers() -> None:
    assert sdk.DEFAULT_RETENTION_TTL == RETENTION_TTL == sdk.DEFAULT_LEASE_TTL
    assert _default(ConnectorConfig, "decoder_kv_blocks_ttl") == sdk.DEFAULT_RETENTION_TTL
    assert _default(RouterConfig, "retention_ttl") == sdk.DEFAULT_RETENTION_TTL
    # the SDK renews as often as the server's benchmarks and simulator assume
    assert sdk.DEFAULT_KEEPALIVE_INTERVAL == RETENTION_TTL / KEEPALIVES_PER_TTL
    # several renewals fit in one lease, so one lost heartbeat never ends a retention
    assert sdk.DEFAULT_KEEPALIVE_INTERVAL * 4 <= sdk.DEFAULT_RETENTION_TTL


async def test_header_names_and_paths_through_the_router() -> None:
    cluster = Cluster()
    config = RouterConfig(**{"prefill": cluster.prefill_urls, "decode": cluster.decode_urls,
                             **TEST_SETTINGS, "decode_continue_tokens": 512})
    app = create_app(config, cluster.transport(), clock=ManualClock())
    router: Router = app.state.router
    await router.start(health_checks=False)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                      base_url=f"{_ROOT}v1/") as http:
            # The id in the header alone (the SDK sends it there on every request) is enough.
            first = await http.post(sdk.CHAT_PATH.lstrip("/"), json=body,
                                    headers={sdk.HEADER_CONVERSATION_ID: "wire"})
            await router.wait_idle()
            assert first.status_code == 200, first.text
            assert first.headers[sdk.HEADER_CONVERSATION_ECHO] == "wire"
            assert first.headers[sdk.HEADER_REUSE] in sdk.REUSE_OUTCOMES
            assert int(first.headers[sdk.HEADER_REUSED_TOKENS]) >= 0
            assert first.headers[sdk.HEADER_REQUEST_ID]

            hinted = await http.post(
                sdk.CHAT_PATH.lstrip("/"), json={**body, sdk.BODY_CONVERSATION_ID: "wire"},
                headers={sdk.HEADER_NO_REUSE: "edited"})
            await router.wait_idle()
            assert hinted.headers[sdk.HEADER_REUSE] == "disabled"

            completion = await http.post(sdk.COMPLETIONS_PATH.lstrip("/"),
                                         json={"model": "m", "prompt": "hi"})
            assert completion.status_code == 200, completion.text

            # A stream the decode continues alone: pending, with the block size.
            continued = await http.post(
                sdk.CHAT_PATH.lstrip("/"),
                json={**body, "stream": True, "messages": [
                    *body["messages"], {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "and?"}]},
                headers={sdk.HEADER_CONVERSATION_ID: "wire"})
            await router.wait_idle()
            assert continued.headers[sdk.HEADER_REUSE] == sdk.PENDING
            assert int(continued.headers[sdk.HEADER_BLOCK_SIZE]) > 0

            released = await http.delete(f"{_ROOT}{sdk.CONVERSATIONS_PATH}wire")
            assert released.status_code == 200 and released.json()["released"] is True
            gone = await http.post(f"{_ROOT}{sdk.CONVERSATIONS_PATH}wire/keepalive")
            assert gone.status_code == 404 and gone.json()["error"]["code"] in sdk.GONE_CODES
    finally:
        await router.aclose()
