"""The control API's shared secret (docs/http-api.md, section C, "Authentication").

A real :class:`ControlServer` on loopback with a secret, in front of a keeper over a fake block
pool: every route refuses a request without the secret (or with a wrong one) with a 401 and
leaves the keeper as it was; the right secret is served as before.
"""

from __future__ import annotations

import http.client
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from kvturn.wire import HEADER_CONTROL_SECRET
from kvturn_server._control_secret import (
    ENV,
    ENV_FILE,
    ControlSecretError,
    is_loopback,
    resolve_secret,
    secret_matches,
)
from kvturn_server.connector._config import ConnectorConfig, ConnectorConfigError
from kvturn_server.connector._control import ControlServer, exposure_warning
from kvturn_server.connector._keeper import RetentionKeeper
from tests.fakes.keeper import FakeBlockPool, FakeClock, finish, make_keeper

SECRET = "s3cret-of-the-fleet-0123456789"
KEY = "tenant/conv:1"
RETENTION = f"/kvturn/v1/retentions/{quote(KEY, safe='')}"


def call(server: ControlServer, method: str, path: str, body: Any = None,
         secret: str | None = None, raw: bytes | None = None) -> tuple[int, Any]:
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if secret is not None:
        headers[HEADER_CONTROL_SECRET] = secret
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pool() -> FakeBlockPool:
    return FakeBlockPool(33)


@pytest.fixture
def keeper(pool: FakeBlockPool, clock: FakeClock) -> RetentionKeeper:
    keeper = make_keeper(pool, clock, ttl=60.0, max_hold=600.0, max_pin=30.0)
    _, kept = finish(pool, keeper, KEY, "req-1", 3)
    assert kept is not None
    return keeper


@pytest.fixture(scope="module")
def shared_server() -> Iterator[ControlServer]:
    srv = ControlServer("127.0.0.1", 0, engine_id="decode-engine", role="decode", keeper=None,
                        secret=SECRET).start()
    yield srv
    srv.stop()


@pytest.fixture
def server(shared_server: ControlServer, keeper: RetentionKeeper) -> Iterator[ControlServer]:
    shared_server.keeper = keeper
    yield shared_server
    shared_server.keeper = None


def _state(keeper: RetentionKeeper) -> Any:
    view = keeper.describe(KEY)
    assert isinstance(view, dict)
    return keeper.has_pins(), view["expires_in"], view["hold_remaining"], keeper.stats()


ROUTES = [
    ("GET", "/health", None),
    ("GET", "/kvturn/v1/stats", None),
    ("GET", RETENTION, None),
    ("POST", RETENTION + "/pin", {"ttl": 5}),
    ("POST", RETENTION + "/keepalive", {}),
    ("DELETE", RETENTION, None),
    ("DELETE", "/kvturn/v1/pins/any-pin", None),
    ("GET", "/no/such/route", None),
]


@pytest.mark.parametrize("given", [None, "", "wrong-secret-0123456789", SECRET + "x",
                                   SECRET[:-1], SECRET.upper()],
                         ids=["none", "empty", "wrong", "longer", "shorter", "case"])
@pytest.mark.parametrize(("method", "path", "body"), ROUTES,
                         ids=[f"{m} {p.rsplit('/', 1)[-1]}" for m, p, _ in ROUTES])
def test_without_the_secret_every_route_is_401_and_changes_nothing(
        server: ControlServer, keeper: RetentionKeeper, clock: FakeClock, method: str,
        path: str, body: Any, given: str | None) -> None:
    clock.advance(10)  # a keepalive, if served, would move expires_in back up
    before = _state(keeper)
    status, answer = call(server, method, path, body, secret=given)
    assert status == 401
    assert answer["error"]["code"] == "unauthorized"
    assert answer["error"]["type"] == "authentication_error"
    assert "decode-engine" not in json.dumps(answer)  # not even the engine id
    keeper.service()
    assert _state(keeper) == before


def test_a_bad_body_without_the_secret_is_401_not_400(server: ControlServer,
                                                     keeper: RetentionKeeper) -> None:
    status, answer = call(server, "POST", RETENTION + "/pin", raw=b"{not json")
    assert (status, answer["error"]["code"]) == (401, "unauthorized")
    assert not keeper.has_pins()


def test_with_the_secret_every_route_is_served(server: ControlServer,
                                               keeper: RetentionKeeper,
                                               clock: FakeClock) -> None:
    assert call(server, "GET", "/health", secret=SECRET) == (
        200, {"engine_id": "decode-engine", "role": "decode"})
    clock.advance(10)
    status, pin = call(server, "POST", RETENTION + "/pin", {"ttl": 5}, secret=SECRET)
    assert status == 200 and keeper.has_pins()
    pin_path = "/kvturn/v1/pins/" + quote(pin["pin_id"], safe="")
    assert call(server, "DELETE", pin_path, secret=SECRET)[1]["unpinned"] is True
    status, renewed = call(server, "POST", RETENTION + "/keepalive", {}, secret=SECRET)
    assert status == 200 and renewed["expires_in"] == 60.0
    assert call(server, "DELETE", RETENTION, secret=SECRET) == (
        200, {"key": KEY, "released": True})


def test_refusals_are_counted_and_logged_once_per_interval(
        server: ControlServer, caplog: pytest.LogCaptureFixture) -> None:
    before = server.refused
    with caplog.at_level(logging.WARNING, logger="kvturn.connector"):
        for _ in range(3):
            assert call(server, "DELETE", RETENTION)[0] == 401
    assert server.refused == before + 3
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) <= 1


def test_without_a_secret_the_endpoint_serves_as_before() -> None:
    srv = ControlServer("127.0.0.1", 0, engine_id="e", role="prefill", keeper=None).start()
    try:
        assert call(srv, "GET", "/health") == (200, {"engine_id": "e", "role": "prefill"})
    finally:
        srv.stop()


@pytest.mark.parametrize(("host", "secret", "warns"), [
    ("0.0.0.0", None, True), ("::", None, True), ("10.1.2.3", None, True),
    ("0.0.0.0", SECRET, False), ("127.0.0.1", None, False), ("::1", None, False),
    ("localhost", None, False), ("127.0.0.2", None, False)])
def test_an_exposed_endpoint_without_a_secret_warns(host: str, secret: str | None,
                                                    warns: bool) -> None:
    warning = exposure_warning(host, secret, "http://x:1")
    assert (warning is not None) == warns
    if warning:
        assert "KVTURN_CONTROL_SECRET_FILE" in warning and host in warning


def test_start_logs_the_exposure_warning(caplog: pytest.LogCaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Bound on loopback (tests bind nothing else); the check sees the configured host.
    srv = ControlServer("127.0.0.1", 0, engine_id="e", role="decode", keeper=None)
    monkeypatch.setattr(srv, "_host", "0.0.0.0")
    with caplog.at_level(logging.WARNING, logger="kvturn.connector"):
        srv.start()
    srv.stop()
    assert any("no shared secret" in r.getMessage() for r in caplog.records)


# Where the secret comes from.

def test_the_secret_comes_from_a_file_else_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert resolve_secret({}, path) == SECRET
    assert resolve_secret({ENV_FILE: str(path), ENV: "other-secret-0123456789"}) == SECRET
    assert resolve_secret({ENV: "  env-secret-0123456789 "}) == "env-secret-0123456789"
    assert resolve_secret({}) is None
    assert resolve_secret({ENV: ""}) is None


@pytest.mark.parametrize("text", ["short", "with space in the secret", "tab\there-0123456789",
                                  "x" * 2000])
def test_an_unusable_secret_is_refused_with_the_reason(tmp_path: Path, text: str) -> None:
    with pytest.raises(ControlSecretError, match="control secret"):
        resolve_secret({ENV: text})
    path = tmp_path / "s"
    path.write_text(text)
    with pytest.raises(ControlSecretError, match=str(path)):
        resolve_secret({}, path)


def test_a_missing_secret_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ControlSecretError, match="cannot read"):
        resolve_secret({ENV_FILE: str(tmp_path / "absent")})


def test_secret_matches_compares_whole_values() -> None:
    assert secret_matches(SECRET, SECRET)
    assert not secret_matches(None, SECRET)
    assert not secret_matches(SECRET[:-1], SECRET)
    assert not secret_matches("\u00e9" * 20, SECRET)  # odd header bytes do not raise


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::")
    assert not is_loopback("192.168.1.1") and not is_loopback("decode.internal")


def test_the_connector_config_takes_a_secret_file_path_never_the_secret() -> None:
    cfg = ConnectorConfig.from_extra({"control_secret_file": "/run/kvturn/secret"})
    assert cfg.control_secret_file == "/run/kvturn/secret"
    with pytest.raises(ConnectorConfigError, match="control_secret_file"):
        ConnectorConfig.from_extra({"control_secret_file": 5})
    # "control_secret" is not a kvturn key: a secret in the extra config would be on vLLM's
    # command line; it passes through to vLLM untouched and authenticates nothing.
    assert "control_secret" not in ConnectorConfig.__dataclass_fields__
