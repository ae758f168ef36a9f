"""Conversation identity: sources in order, validation, tenant scoping."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from kvturn_server.router._errors import ApiError
from kvturn_server.router._identity import (
    credential_of,
    resolve_identity,
    tenant_of,
    validate_id,
)
from tests.fakes.router_harness import MakeHarness


def _tenant(auth: str) -> str:
    return hashlib.sha256(auth.encode()).hexdigest()[:16]


@pytest.mark.parametrize(("body", "headers", "expected", "source"), [
    ({"conversation_id": "body", "session_id": "sess"},
     {"x-conversation-id": "hdr", "x-session-id": "sid"}, "body", "conversation_id"),
    ({"session_id": "sess"}, {"x-conversation-id": "hdr", "x-session-id": "sid"}, "hdr",
     "X-Conversation-ID"),
    ({"session_id": "sess"}, {"x-session-id": "sid"}, "sid", "X-Session-ID"),
    ({"session_id": "sess"}, {}, "sess", "session_id"),
    ({"conversation_id": None, "session_id": "sess"}, {}, "sess", "session_id"),
])
def test_the_first_present_source_wins(body: dict[str, Any], headers: dict[str, str],
                                       expected: str, source: str) -> None:
    identity = resolve_identity(body, headers)
    assert identity is not None
    assert identity.conversation_id == expected and identity.source == source
    assert identity.key == f"-/{expected}"


def test_no_source_means_no_conversation() -> None:
    assert resolve_identity({"model": "m"}, {}) is None


@pytest.mark.parametrize(("value", "why"), [
    ("", "empty"), ("x" * 257, "257 characters"), ("has space", "' ' at position 3"),
    ("tab\there", "'\\t'"), ("caf\u00e9", "'\u00e9'"), (42, "got int"), (["a"], "got list"),
])
def test_invalid_ids_are_a_400_naming_the_field(value: Any, why: str) -> None:
    with pytest.raises(ApiError) as exc:
        validate_id(value, "X-Session-ID")
    assert exc.value.status == 400
    assert exc.value.param == "X-Session-ID"
    assert why in exc.value.message


def test_ids_may_use_every_printable_ascii_character() -> None:
    value = "".join(chr(c) for c in range(0x21, 0x7F))
    assert validate_id(value, "p") == value
    assert validate_id("x" * 256, "p") == "x" * 256


def test_tenants_are_credential_hashes() -> None:
    assert tenant_of(None) == "-"
    assert tenant_of("Bearer a") == _tenant("Bearer a")
    assert tenant_of("Bearer a") != tenant_of("Bearer b")


def test_anthropic_clients_are_scoped_by_their_x_api_key() -> None:
    assert credential_of({"authorization": "Bearer a", "x-api-key": "k"}) == "Bearer a"
    assert credential_of({"x-api-key": "k"}) == "x-api-key:k"
    assert credential_of({}) is None
    # The two headers never name one tenant, even with the same text.
    assert tenant_of(credential_of({"x-api-key": "k"})) != tenant_of(
        credential_of({"authorization": "k"}))
    alice = resolve_identity({}, {"x-claude-code-session-id": "s1", "x-api-key": "alice"})
    bob = resolve_identity({}, {"x-claude-code-session-id": "s1", "x-api-key": "bob"})
    assert alice is not None and bob is not None and alice.key != bob.key


@pytest.mark.parametrize(("where", "name"), [
    ("body", "conversation_id"), ("header", "X-Conversation-ID"), ("header", "X-Session-ID"),
    ("body", "session_id")])
async def test_invalid_ids_change_nothing(make_harness: MakeHarness, where: str,
                                          name: str) -> None:
    h = await make_harness()
    body: dict[str, Any] = {"model": "m", "prompt": "hi"}
    headers = {}
    if where == "body":
        body[name] = "bad id"
    else:
        headers[name] = "bad id"
    resp = await h.client.post("/v1/completions", json=body, headers=headers)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == name and error["code"] == "invalid_conversation_id"
    assert "printable ASCII" in error["message"]
    assert resp.headers["x-should-retry"] == "false"
    assert h.cluster.log == []
    assert await h.router.store.size() == 0


async def test_tenants_never_share_a_retention(make_harness: MakeHarness) -> None:
    h = await make_harness()
    alice = {"Authorization": "Bearer alice"}
    bob = {"Authorization": "Bearer bob"}
    await h.chat("shared", headers=alice)
    resp = await h.chat("shared", headers=bob)
    # Bob's first turn of "shared" finds nothing, although Alice has one.
    assert resp.headers["X-KVTurn-Reuse"] == "miss"
    assert h.cluster.calls("decode0.control", "POST") == []
    retentions = h.cluster.decodes[0].retentions
    assert set(retentions) == {f"{_tenant('Bearer alice')}/shared",
                               f"{_tenant('Bearer bob')}/shared"}
    resp = await h.chat("shared", headers=alice)
    assert resp.headers["X-KVTurn-Reuse"] == "hit"
    [pin] = h.cluster.calls("decode0.control", "POST")
    assert pin.path == f"/kvturn/v1/retentions/{_tenant('Bearer alice')}/shared/pin"
    # The credential itself never reaches a backend.
    assert all("authorization" not in e.headers for e in h.cluster.log)


async def test_x_api_key_tenants_never_share_a_retention(make_harness: MakeHarness) -> None:
    h = await make_harness()
    await h.chat("shared", headers={"x-api-key": "alice"})
    resp = await h.chat("shared", headers={"x-api-key": "bob"})
    assert resp.headers["X-KVTurn-Reuse"] == "miss"
    assert h.cluster.calls("decode0.control", "POST") == []
    assert all("x-api-key" not in e.headers for e in h.cluster.log)


async def test_ids_with_reserved_characters_round_trip(make_harness: MakeHarness) -> None:
    h = await make_harness()
    weird = "a/b:c#d?e%f&g"
    await h.chat(weird)
    resp = await h.chat(weird)
    assert resp.headers["X-KVTurn-Reuse"] == "hit"
    assert resp.headers["X-KVTurn-Conversation"] == weird
    assert f"-/{weird}" in h.cluster.decodes[0].retentions
