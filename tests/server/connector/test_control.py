"""The connector's control endpoint over real HTTP on loopback (docs/http-api.md, section C).

A real :class:`ControlServer` on 127.0.0.1, port 0, in front of a keeper over a fake block pool.
Requests go through urllib, with no proxy, the way any HTTP client would send them.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

from kvturn_server.connector._control import MAX_BODY, ControlServer, dial_url
from kvturn_server.connector._keeper import RetentionKeeper
from tests.fakes.keeper import BS, FakeBlockPool, FakeClock, finish, make_keeper

KEY = "3f2a9c0d1e4b5a67/conv:42/turns"  # tenant-scoped: "/" and ":" inside the key
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def call(server: ControlServer, method: str, path: str, body: Any = None, *,
         raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with _opener.open(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def retention(key: str = KEY) -> str:
    return f"/kvturn/v1/retentions/{quote(key, safe='')}"


def code(answer: tuple[int, Any]) -> tuple[int, str]:
    status, body = answer
    return status, body["error"]["code"]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pool() -> FakeBlockPool:
    return FakeBlockPool(33)


@pytest.fixture
def keeper(pool: FakeBlockPool, clock: FakeClock) -> RetentionKeeper:
    return make_keeper(pool, clock, ttl=60.0, max_hold=600.0, max_pin=30.0)


@pytest.fixture(scope="module")
def shared_server() -> Iterator[ControlServer]:
    # One server for the module: stopping one waits out socketserver's 0.5 s poll interval.
    srv = ControlServer("127.0.0.1", 0, engine_id="decode-engine", role="decode",
                        keeper=None, extra_stats=lambda: {"extra": 1}).start()
    yield srv
    srv.stop()


@pytest.fixture
def server(shared_server: ControlServer, keeper: RetentionKeeper) -> Iterator[ControlServer]:
    shared_server.keeper = keeper  # read per request
    yield shared_server
    shared_server.keeper = None


@pytest.fixture
def retained(pool: FakeBlockPool, keeper: RetentionKeeper) -> list[int]:
    ids, kept = finish(pool, keeper, KEY, "req-1", 3)
    assert kept is not None
    return ids


def test_health_names_the_engine_and_role(server: ControlServer) -> None:
    assert call(server, "GET", "/health") == (200, {"engine_id": "decode-engine",
                                                    "role": "decode"})


def test_the_url_is_the_loopback_address_it_listens_on(server: ControlServer) -> None:
    host, port = server.address
    assert host == "127.0.0.1" and port > 0
    assert server.url == f"http://127.0.0.1:{port}"


def test_stats_carry_the_extra_stats_and_the_keepers(server: ControlServer,
                                                     retained: list[int]) -> None:
    status, body = call(server, "GET", "/kvturn/v1/stats")
    assert status == 200
    assert body["engine_id"] == "decode-engine" and body["role"] == "decode"
    assert body["extra"] == 1
    assert body["retention"]["retentions"] == 1
    assert body["retention"]["held_blocks"] == 3
    assert body["retention"]["events"]["created"] == 1


def test_describe_a_percent_encoded_key(server: ControlServer, retained: list[int]) -> None:
    status, body = call(server, "GET", retention())
    assert status == 200
    assert body["key"] == KEY
    assert set(body) == {"key", "engine_id", "params", "num_tokens", "num_blocks", "expires_in",
                         "hold_remaining", "created_ago", "where", "host_tokens"}
    assert body["params"]["remote_block_ids"] == [retained]
    assert (body["num_tokens"], body["num_blocks"], body["expires_in"]) == (12, 3, 60.0)


def test_a_query_string_does_not_change_the_route(server: ControlServer,
                                                  retained: list[int]) -> None:
    assert call(server, "GET", retention() + "?verbose=1")[0] == 200


def test_pin_then_unpin(server: ControlServer, keeper: RetentionKeeper,
                        retained: list[int]) -> None:
    status, body = call(server, "POST", retention() + "/pin", {"ttl": 5})
    assert status == 200
    assert body["key"] == KEY and body["pin_expires_in"] == 5.0
    pin_id = body["pin_id"]
    assert keeper.has_pins()
    path = f"/kvturn/v1/pins/{quote(pin_id, safe='')}"
    assert call(server, "DELETE", path) == (200, {"pin_id": pin_id, "unpinned": True})
    assert call(server, "DELETE", path) == (200, {"pin_id": pin_id, "unpinned": False})
    assert not keeper.has_pins()


def test_pin_without_a_body_uses_the_default_ttl_capped_at_max_pin(
        server: ControlServer, retained: list[int]) -> None:
    status, body = call(server, "POST", retention() + "/pin")
    assert status == 200
    assert body["pin_expires_in"] == 30.0  # default 30 s, max_pin 30 s


@pytest.mark.parametrize("ttl", [0, -1, "5", True, None, [5]])
def test_a_bad_pin_ttl_is_a_400_and_pins_nothing(server: ControlServer, keeper: RetentionKeeper,
                                                 retained: list[int], ttl: Any) -> None:
    status, body = call(server, "POST", retention() + "/pin", {"ttl": ttl})
    assert (status, body["error"]["code"]) == (400, "bad_ttl")
    assert body["error"]["type"] == "invalid_request_error"
    assert not keeper.has_pins()


@pytest.mark.parametrize("host_reads", ["yes", 1, None])
def test_a_pins_host_reads_must_be_true_or_false(server: ControlServer, keeper: RetentionKeeper,
                                                 retained: list[int], host_reads: Any) -> None:
    status, body = call(server, "POST", retention() + "/pin", {"ttl": 5, "host_reads": host_reads})
    assert (status, body["error"]["code"]) == (400, "bad_body")
    assert not keeper.has_pins()


def test_a_device_retention_pinned_asking_host_reads_is_pinned_as_ever(
        server: ControlServer, retained: list[int]) -> None:
    status, body = call(server, "POST", retention() + "/pin", {"ttl": 5, "host_reads": True})
    assert status == 200 and body["where"] == "device" and body["pin_id"]


def test_keepalive_renews_the_lease(server: ControlServer, clock: FakeClock,
                                    retained: list[int]) -> None:
    clock.advance(20)
    status, body = call(server, "POST", retention() + "/keepalive")
    assert status == 200
    assert body["expires_in"] == 60.0 and body["created_ago"] == 20.0


def test_release_then_every_retention_route_says_released(
        server: ControlServer, keeper: RetentionKeeper, pool: FakeBlockPool,
        retained: list[int]) -> None:
    assert call(server, "DELETE", retention()) == (200, {"key": KEY, "released": True})
    keeper.service()  # the engine thread frees what the control thread released
    assert pool.refs(retained) == [0, 0, 0]
    for method, suffix in (("GET", ""), ("DELETE", ""), ("POST", "/pin"),
                           ("POST", "/keepalive")):
        status, body = call(server, method, retention() + suffix)
        assert (status, body["error"]["code"]) == (404, "released"), (method, suffix)
        assert body["error"]["type"] == "not_found"
        assert KEY in body["error"]["message"]
    # A describe also says what the released history left in the prefix cache (all of it:
    # nothing took its blocks since); the other routes do not look.
    assert call(server, "GET", retention())[1]["cached_tokens"] == len(retained) * BS
    assert "cached_tokens" not in call(server, "POST", retention() + "/keepalive")[1]


def test_an_unknown_key_is_404_no_retention(server: ControlServer) -> None:
    assert code(call(server, "GET", retention("nobody/here"))) == (404, "no_retention")
    assert code(call(server, "POST", retention("nobody") + "/keepalive")) == (404,
                                                                              "no_retention")


def test_an_expired_retention_is_404_expired(server: ControlServer, clock: FakeClock,
                                            retained: list[int]) -> None:
    clock.advance(60)
    assert code(call(server, "GET", retention())) == (404, "expired")


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/"),
    ("GET", "/nope"),
    ("GET", "/kvturn/v2/stats"),
    ("GET", "/kvturn/v1/retentions"),
    ("POST", "/kvturn/v1/retentions/k"),
    ("POST", "/kvturn/v1/retentions/k/forget"),
    ("GET", "/kvturn/v1/retentions/k/pin"),
    ("GET", "/kvturn/v1/pins/pin-1"),
    ("DELETE", "/kvturn/v1/stats"),
    ("POST", "/health"),
])
def test_an_unknown_route_is_404_no_route(server: ControlServer, method: str,
                                         path: str) -> None:
    assert code(call(server, method, path)) == (404, "no_route")


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"ttl"', b"5",
                                 b"\xff\xfe"], ids=["bad json", "array", "string", "number",
                                                    "not utf-8"])
def test_a_body_that_is_not_a_json_object_is_400(server: ControlServer,
                                                 keeper: RetentionKeeper, retained: list[int],
                                                 raw: bytes) -> None:
    status, body = call(server, "POST", retention() + "/pin", raw=raw)
    assert (status, body["error"]["code"]) == (400, "bad_body")
    assert not keeper.has_pins()


def test_an_oversized_body_is_400(server: ControlServer, keeper: RetentionKeeper,
                                  retained: list[int]) -> None:
    raw = json.dumps({"ttl": 5, "pad": "x" * MAX_BODY}).encode()
    status, body = call(server, "POST", retention() + "/pin", raw=raw)
    assert (status, body["error"]["code"]) == (400, "bad_body")
    assert not keeper.has_pins()


def _raw_request(server: ControlServer, head: bytes, body: bytes = b"", *,
                 half_close: bool = True) -> bytes:
    """Send raw bytes; return everything the server answers before it closes the connection.

    Without ``half_close`` the client keeps its side open, like a keep-alive client: a server
    waiting for more body bytes then never answers and the read times out.
    """
    host, port = server.address
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(head + body)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("length", [b"-1", b"abc"])
def test_a_malformed_content_length_is_400_not_a_hang(server: ControlServer,
                                                      retained: list[int],
                                                      length: bytes) -> None:
    head = (b"POST " + retention().encode() + b"/pin HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: " + length + b"\r\nConnection: close\r\n\r\n")
    answer = _raw_request(server, head, half_close=False)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b'"bad_body"' in answer


def test_a_rejected_body_ends_the_connection_and_the_client_reconnects(
        server: ControlServer, retained: list[int]) -> None:
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("POST", retention() + "/pin", body=b"{not json")
        resp = conn.getresponse()
        assert resp.status == 400
        assert resp.getheader("Connection") == "close"
        resp.read()
        conn.request("GET", "/health")
        resp = conn.getresponse()
        assert resp.status == 200
        assert json.loads(resp.read())["role"] == "decode"
    finally:
        conn.close()


def test_a_chunked_body_is_400_not_silently_ignored(server: ControlServer,
                                                    keeper: RetentionKeeper,
                                                    retained: list[int]) -> None:
    body = b'{"ttl": 5}'
    head = (b"POST " + retention().encode() + b"/pin HTTP/1.1\r\nHost: x\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    answer = _raw_request(server, head, chunked)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b'"bad_body"' in answer
    assert not keeper.has_pins()


def test_an_oversized_body_never_leaks_into_the_next_request_on_the_connection(
        server: ControlServer, retained: list[int]) -> None:
    # A body the server refuses to read must not be parsed as the next request.
    smuggled = b"GET /kvturn/v1/stats HTTP/1.1\r\nHost: x\r\n\r\n"
    body = smuggled + b" " * (MAX_BODY + 1 - len(smuggled))
    head = (b"POST " + retention().encode() + b"/pin HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    answer = _raw_request(server, head, body)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert answer.count(b"HTTP/1.1 ") == 1


def test_a_failing_handler_is_a_500_and_the_endpoint_keeps_serving(
        keeper: RetentionKeeper) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("stats exploded")

    srv = ControlServer("127.0.0.1", 0, engine_id="e", role="decode", keeper=keeper,
                        extra_stats=broken).start()
    try:
        status, body = call(srv, "GET", "/kvturn/v1/stats")
        assert (status, body["error"]["code"]) == (500, "internal")
        assert "stats exploded" in body["error"]["message"]
        assert call(srv, "GET", "/health")[0] == 200
    finally:
        srv.stop()


# Without retention: a prefill, or a decode whose keeper has no block pool yet.


@pytest.mark.parametrize("flavour", ["prefill", "unbound"])
def test_without_a_bound_keeper_only_health_and_stats_answer(clock: FakeClock,
                                                            flavour: str) -> None:
    keeper = make_keeper(None, clock) if flavour == "unbound" else None
    srv = ControlServer("127.0.0.1", 0, engine_id="prefill-engine", role="prefill",
                        keeper=keeper).start()
    try:
        assert call(srv, "GET", "/health") == (200, {"engine_id": "prefill-engine",
                                                     "role": "prefill"})
        assert call(srv, "GET", "/kvturn/v1/stats") == (200, {"engine_id": "prefill-engine",
                                                              "role": "prefill"})
        for method, path in (("GET", retention()), ("DELETE", retention()),
                             ("POST", retention() + "/pin"),
                             ("POST", retention() + "/keepalive"),
                             ("DELETE", "/kvturn/v1/pins/pin-1")):
            assert code(call(srv, method, path)) == (404, "no_retention"), (method, path)
    finally:
        srv.stop()


# Lifecycle.


def test_stop_releases_the_port(keeper: RetentionKeeper) -> None:
    srv = ControlServer("127.0.0.1", 0, engine_id="e", role="decode", keeper=keeper).start()
    host, port = srv.address
    assert call(srv, "GET", "/health")[0] == 200
    srv.stop()
    with pytest.raises(ConnectionRefusedError), socket.create_connection((host, port),
                                                                         timeout=5):
        pass
    again = ControlServer(host, port, engine_id="e2", role="decode", keeper=keeper).start()
    try:
        assert call(again, "GET", "/health") == (200, {"engine_id": "e2", "role": "decode"})
    finally:
        again.stop()


def test_a_burst_of_connections_waits_in_the_listen_backlog(keeper: RetentionKeeper) -> None:
    srv = ControlServer("127.0.0.1", 0, engine_id="e", role="decode", keeper=keeper)
    socks: list[socket.socket] = []
    try:
        # Not accepting yet: every connection has to fit in the backlog, or its connect
        # stalls on a SYN retry (the router's pins for a burst of turns).
        for _ in range(32):
            socks.append(socket.create_connection(srv.address, timeout=2))
    finally:
        for sock in socks:
            sock.close()
        srv.start().stop()


def test_a_port_in_use_names_the_setting_to_change(keeper: RetentionKeeper) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match="control_port"):
            ControlServer("127.0.0.1", port, engine_id="e", role="decode", keeper=keeper)


def test_concurrent_requests_are_served(server: ControlServer, keeper: RetentionKeeper,
                                        retained: list[int]) -> None:
    results: list[int] = []
    lock = threading.Lock()

    def pin_and_unpin() -> None:
        status, body = call(server, "POST", retention() + "/pin", {"ttl": 5})
        status2, _ = call(server, "DELETE", f"/kvturn/v1/pins/{body['pin_id']}")
        with lock:
            results.extend([status, status2])

    threads = [threading.Thread(target=pin_and_unpin) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not any(thread.is_alive() for thread in threads)
    assert results == [200] * 16
    assert not keeper.has_pins()


def test_the_reported_url_is_one_a_peer_can_dial() -> None:
    # A control endpoint bound to a wildcard reports the instance's fleet address (its NIXL
    # side-channel host): routers and tools on other hosts cannot dial 0.0.0.0.
    assert dial_url("0.0.0.0", 8101, "10.0.0.21") == "http://10.0.0.21:8101"
    assert dial_url("::", 8101, "fd00::21") == "http://[fd00::21]:8101"
    assert dial_url("10.0.0.21", 8101, "10.0.0.99") == "http://10.0.0.21:8101"
    assert dial_url("0.0.0.0", 8101, None) == "http://0.0.0.0:8101"
    srv = ControlServer("127.0.0.3", 0, engine_id="e", role="decode", keeper=None,
                        advertise="127.0.0.9")
    try:
        assert srv.url == f"http://127.0.0.3:{srv.address[1]}"
    finally:
        srv.start().stop()


def test_answer_to_a_client_that_went_away_is_dropped_quietly() -> None:
    """A router that stops mid long poll closes its socket; the answer is dropped, no
    traceback (BrokenPipeError used to reach socketserver's handle_error)."""
    from kvturn_server.connector._control import _Handler

    class _Gone:
        def write(self, data: bytes) -> None:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    handler = _Handler.__new__(_Handler)
    handler.wfile = _Gone()  # type: ignore[assignment]
    handler.request_version = "HTTP/1.1"
    handler.command, handler.path = "GET", "/kvturn/v1/lost?after=0&wait=10"
    handler.requestline = "GET /kvturn/v1/lost HTTP/1.1"
    handler.client_address = ("127.0.0.1", 1)
    handler.close_connection = False
    handler._send(200, {"entries": []})
    assert handler.close_connection is True
