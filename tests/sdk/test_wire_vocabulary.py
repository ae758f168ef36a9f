"""The wire vocabulary (``kvturn.wire``) against docs/http-api.md and against the code on
both ends of the wire.

``kvturn.wire`` is the one list of kvturn's wire words: header names, paths, the control and
conversation APIs' fields, gone codes, reuse values. The SDK, the router, the connector and the
tools import it; nothing spells those words out again. This test holds the list to the page
(every header, path, field and value the page names is the module's, and the other way round)
and to the code (what the router and the connector really say, through their apps).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import httpx2
import pytest

from kvturn import _constants as sdk
from kvturn import wire
from kvturn._errors import InvalidConversationIdError
from kvturn._identity import validate_conversation_id
from kvturn._turns import TurnInfo
from kvturn_server._defaults import KEEPALIVES_PER_TTL, RETENTION_TTL
from kvturn_server.connector._config import ConnectorConfig
from kvturn_server.router import Router, RouterConfig, create_app
from kvturn_server.router._errors import ApiError
from kvturn_server.router._identity import _SOURCES, validate_id
from kvturn_server.router._legs import DecodeUsage, continued_reuse
from tests.fakes.backends import Cluster, ManualClock
from tests.fakes.router_harness import TEST_SETTINGS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "http-api.md").read_text()
_ROOT = "http://router.test/"


def _fields(body: Any) -> set[str]:
    """The field names of a ``TypedDict`` (its parents' too)."""
    return set(body.__required_keys__ | body.__optional_keys__)


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def test_reuse_outcomes_are_the_reasons_plus_pending() -> None:
    # The reports' reasons, plus the router's own "pending" (a continued stream).
    assert set(wire.REUSE_OUTCOMES) == wire.REUSE_REASONS | {wire.PENDING}
    assert wire.PENDING not in wire.REUSE_REASONS
    assert len(wire.REUSE_OUTCOMES) == len(set(wire.REUSE_OUTCOMES))
    assert wire.REUSED_OUTCOMES < wire.REUSE_REASONS
    assert sdk.UNREPORTED not in wire.REUSE_OUTCOMES
    import kvturn
    assert kvturn.REUSE_OUTCOMES is wire.REUSE_OUTCOMES


def test_the_sdk_settles_a_pending_turn_as_the_router_does() -> None:
    pending = TurnInfo("c", "chat", wire.PENDING, 0, None, None, None, 1, True, None)
    for block_size in (0, 16, 128):
        for prompt in (1, 16, 17, 64, 129, 300):
            for cached in (0, 16, 32, 48, 64, 128, 256, 300):
                settled = pending._replace(block_size=block_size or None).settled(prompt,
                                                                                  cached)
                found = continued_reuse(DecodeUsage(prompt, 1, cached), None, block_size)
                assert found is not None
                assert (settled.reuse, settled.reused_tokens) == \
                    (found.reason, found.reused_tokens), (block_size, prompt, cached)


def test_gone_codes_are_the_decodes_plus_stale() -> None:
    assert set(wire.GONE_CODES) == {reason.value for reason in wire.GoneReason} | {"stale"}
    assert wire.ReuseReason.STALE in wire.GONE_CODES


@pytest.mark.parametrize(("code", "read"), [
    ("expired", "expired"), ("no_retention", "no_retention"), ("replaced", "replaced"),
    ("stale", "no_retention"), ("some_new_word", "no_retention"), ("", "no_retention"),
    (None, "no_retention"), (7, "no_retention")])
def test_a_gone_code_is_read_as_a_known_one(code: object, read: str) -> None:
    assert wire.gone_reason(code) == read and isinstance(wire.gone_reason(code),
                                                         wire.GoneReason)


def test_identity_fields() -> None:
    expected = (("body", wire.BODY_CONVERSATION_ID),
                ("header", wire.HEADER_CONVERSATION_ID.lower()),
                ("header", wire.HEADER_SESSION_ID.lower()), ("body", wire.BODY_SESSION_ID))
    assert expected == _SOURCES


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
    # the longest id both take is the wire's limit
    validate_id("x" * wire.ID_MAX_LENGTH, "conversation_id")
    validate_conversation_id("x" * wire.ID_MAX_LENGTH)


def test_paths_keep_an_id_in_one_segment() -> None:
    assert wire.conversation_path("a/b c", wire.KEEPALIVE) == \
        "/kvturn/v1/conversations/a%2Fb%20c/keepalive"
    assert wire.retention_path("t/k#1") == "/kvturn/v1/retentions/t%2Fk%231"
    assert wire.retention_path("k", wire.PIN) == "/kvturn/v1/retentions/k/pin"
    assert wire.pin_path("p?1") == "/kvturn/v1/pins/p%3F1"
    assert wire.lost_path(3, 10.0) == "/kvturn/v1/lost?after=3&wait=10"
    assert wire.CONVERSATIONS_PREFIX.startswith(wire.API_PREFIX + "/")


def test_metric_labels_are_snake_case() -> None:
    assert wire.metric_label(wire.ReuseReason.BELOW_THRESHOLD) == "below_threshold"
    assert wire.metric_label(wire.PrefillChoice.ROUND_ROBIN) == "round_robin"
    assert wire.metric_label("decode_failed") == "decode_failed"


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
                                    headers={wire.HEADER_CONVERSATION_ID: "wire"})
            await router.wait_idle()
            assert first.status_code == 200, first.text
            assert first.headers[wire.HEADER_CONVERSATION_ECHO] == "wire"
            assert first.headers[wire.HEADER_REUSE] in wire.REUSE_OUTCOMES
            assert int(first.headers[wire.HEADER_REUSED_TOKENS]) >= 0
            assert first.headers[wire.HEADER_REQUEST_ID]
            assert first.headers[wire.HEADER_ROUTE] == wire.Route.PREFILL
            assert first.headers[wire.HEADER_PREFILL_CHOICE] in set(wire.PrefillChoice)

            hinted = await http.post(
                sdk.CHAT_PATH.lstrip("/"), json={**body, wire.BODY_CONVERSATION_ID: "wire"},
                headers={wire.HEADER_NO_REUSE: "edited"})
            await router.wait_idle()
            assert hinted.headers[wire.HEADER_REUSE] == wire.ReuseReason.DISABLED

            completion = await http.post(sdk.COMPLETIONS_PATH.lstrip("/"),
                                         json={"model": "m", "prompt": "hi"})
            assert completion.status_code == 200, completion.text

            # A stream the decode continues alone: pending, with the block size.
            continued = await http.post(
                sdk.CHAT_PATH.lstrip("/"),
                json={**body, "stream": True, "messages": [
                    *body["messages"], {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "and?"}]},
                headers={wire.HEADER_CONVERSATION_ID: "wire"})
            await router.wait_idle()
            assert continued.headers[wire.HEADER_REUSE] == wire.PENDING
            assert continued.headers[wire.HEADER_ROUTE] == wire.Route.DECODE
            assert int(continued.headers[wire.HEADER_BLOCK_SIZE]) > 0

            kept = await http.post(_ROOT.rstrip("/") + wire.conversation_path(
                "wire", wire.KEEPALIVE))
            assert kept.status_code == 200
            assert set(kept.json()) == _fields(wire.KeepaliveBody)
            released = await http.delete(_ROOT.rstrip("/") + wire.conversation_path("wire"))
            assert released.status_code == 200 and released.json()["released"] is True
            assert set(released.json()) == _fields(wire.ReleaseBody)
            gone = await http.post(_ROOT.rstrip("/") + wire.conversation_path(
                "wire", wire.KEEPALIVE))
            assert gone.status_code == 404 and gone.json()["error"]["code"] in wire.GONE_CODES
    finally:
        await router.aclose()


# -- docs/http-api.md and the module ---------------------------------------------------------

def _section(title: str) -> str:
    """The page's text from the heading ``title`` to the next heading of its level or above."""
    start = re.search(rf"^(#+) {re.escape(title)}.*$", DOC, re.MULTILINE)
    assert start is not None, title
    level = len(start.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(DOC, start.end())
    return DOC[start.end():end.start() if end else len(DOC)]


def _rows(text: str) -> dict[str, str]:
    """A table's rows: first cell (without its backticks) -> the rest of the row."""
    rows = {}
    for line in text.splitlines():
        cells = re.match(r"^\| `([^`]+)`[^|]*\| (.*) \|$", line)
        if cells:
            rows[cells.group(1)] = cells.group(2)
    return rows


def _values(cell: str) -> list[str]:
    """The values a cell lists: each backticked word followed by its explanation ``(...)``, or
    last in the cell."""
    return re.findall(r"`([a-z_-]+)`(?= \(|$)", cell)


def _keys(text: str) -> set[str]:
    """The JSON keys an answer shown as ``{"a", "b": ..., ...}`` names (not its values)."""
    return set(re.findall(r'(?<!: )"([a-z_]+)"', text))


def test_the_docs_reuse_report_is_the_modules() -> None:
    rows = _rows(_section("Reuse report"))
    assert tuple(rows) == (*wire.RESPONSE_HEADERS, wire.HEADER_REQUEST_ID)
    assert tuple(_values(rows[wire.HEADER_REUSE])) == wire.REUSE_OUTCOMES
    assert _values(rows[wire.HEADER_ROUTE]) == [route.value for route in wire.Route]
    assert _values(rows[wire.HEADER_PREFILL_CHOICE]) == \
        [choice.value for choice in wire.PrefillChoice]
    hints = _rows(_section("Reuse hints"))
    assert [name.split(":")[0] for name in hints] == [wire.HEADER_NO_REUSE]


def test_the_docs_identity_sources_are_the_modules() -> None:
    listed = re.findall(r"^\d\. (body|header) `([^`]+)`", _section("Conversation identity"),
                        re.MULTILINE)
    assert [(where, name.lower() if where == "header" else name)
            for where, name in listed[:4]] == list(_SOURCES)
    assert f"1\u2013{wire.ID_MAX_LENGTH} printable ASCII" in _section("Conversation identity")


def test_the_docs_conversation_endpoints_are_the_modules() -> None:
    rows = _rows(_section("Conversation endpoints"))
    keepalive = f"POST {wire.CONVERSATIONS_PREFIX}{{id}}/{wire.KEEPALIVE}"
    release = f"DELETE {wire.CONVERSATIONS_PREFIX}{{id}}"
    assert list(rows) == [keepalive, release]
    answer = rows[keepalive].split("}")[0]
    assert _keys(answer) == _fields(wire.KeepaliveBody)
    assert _keys(rows[release].split("}")[0]) == _fields(wire.ReleaseBody)
    codes = set(re.findall(r"`([a-z_]+)`", rows[keepalive]))
    assert set(wire.GONE_CODES) <= codes


def test_the_docs_control_api_is_the_modules() -> None:
    text = _section("C. Control API")
    rows = _rows(text)
    retention = f"{wire.API_PREFIX}/{wire.RETENTIONS}/{{key}}"
    assert list(rows) == [
        f"GET {wire.HEALTH_PATH}", f"GET {retention}",
        f"POST {retention}/{wire.PIN}", f"DELETE {wire.API_PREFIX}/{wire.PINS}/{{pin_id}}",
        f"POST {retention}/{wire.KEEPALIVE}", f"DELETE {retention}", f"GET {wire.STATS_PATH}",
        f"GET {wire.LOST_PATH}?{wire.LOST_AFTER}=N&{wire.LOST_WAIT}=S"]
    assert _keys(rows[f"GET {wire.HEALTH_PATH}"]) == _fields(wire.ControlHealth)
    assert _keys(rows[f"DELETE {wire.API_PREFIX}/{wire.PINS}/{{pin_id}}"]) == \
        _fields(wire.UnpinBody)
    assert _keys(rows[f"DELETE {retention}"]) == _fields(wire.RetentionReleased)
    # A Gone's extra fields: a describe's (what the prefix cache kept), a pin's (what the host
    # tier alone holds).
    gone_extras = _fields(wire.GoneBody) - _fields(wire.ErrorBody)
    assert {field for field in gone_extras if f'"{field}"' in rows[f"GET {retention}"]} == \
        {"cached_tokens"}
    # The pin's answer: a Retention plus the pin (its request body is the ttl), or a Gone.
    pin, pin_gone = rows[f"POST {retention}/{wire.PIN}"].split("Retention + ")[1].split(" or ")
    assert _keys(pin) == _fields(wire.PinBody) - _fields(wire.RetentionBody)
    assert {field for field in gone_extras if f'"{field}"' in pin_gone} == {"host_tokens"}
    lost = rows[f"GET {wire.LOST_PATH}?{wire.LOST_AFTER}=N&{wire.LOST_WAIT}=S"]
    lost_body, entry = lost.split("[", 1)
    assert _keys(lost_body) == _fields(wire.LostBody)
    assert _keys(entry.split("]")[0]) == _fields(wire.LostEntry)

    body = re.search(r"`Retention` = `(\{.*?\})`", text, re.DOTALL)
    assert body is not None and _keys(body.group(1)) == _fields(wire.RetentionBody)
    assert all(f"`{where.value}`" in text for where in wire.Where)
    gone = re.search(r"`Gone` = `(\{.*?\}\})` with `code` one of\s(.*?)\. ", text, re.DOTALL)
    assert gone is not None
    assert _keys(gone.group(1)) == {"error"} | _fields(wire.ErrorDetail)
    assert set(re.findall(r"`([a-z_]+)`", gone.group(2))) == {r.value for r in wire.GoneReason}
    for code in wire.ControlErrorCode:
        assert re.search(rf"`[^`]*\b{code.value}\b[^`]*`", text), code
    assert f"`{wire.HEADER_CONTROL_SECRET}: <secret>`" in text
