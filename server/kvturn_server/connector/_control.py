"""The connector's control endpoint: a small HTTP server in the engine process.

Routes and bodies are the contract in docs/http-api.md, section C. The server runs on its own
daemon threads; everything it does goes through :class:`RetentionKeeper`, which never touches
vLLM state off the engine thread. It listens where ``control_host``/``control_port`` say
(loopback by default) and answers only the routes below.

With a shared secret configured (``_control_secret.py``) every route, ``/health`` included,
answers ``401`` to a request without it, before anything else is looked at: a pin or a release
changes what the decode holds, and stats and retentions name conversations.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote

from kvturn.wire import (
    API_PREFIX,
    HEADER_CONTROL_SECRET,
    HEALTH_PATH,
    KEEPALIVE,
    LOST,
    LOST_AFTER,
    LOST_WAIT,
    PIN,
    PINS,
    RETENTIONS,
    STATS,
    ControlErrorCode,
    ControlHealth,
    ErrorBody,
    GoneBody,
    GoneReason,
    LostBody,
    RetentionReleased,
    UnpinBody,
)
from kvturn_server._control_secret import is_loopback, secret_matches
from kvturn_server.connector._keeper import RetentionKeeper
from kvturn_server.connector._lease import Gone

log = logging.getLogger("kvturn.connector")

_API = API_PREFIX.strip("/").split("/")
_HEALTH = HEALTH_PATH.strip("/").split("/")
MAX_BODY = 64 * 1024
MAX_LOST_WAIT = 30.0
"""The longest a ``GET .../lost`` waits for an entry (each waiting request holds a thread)."""
REFUSED_LOG_INTERVAL = 60.0


class _Server(ThreadingHTTPServer):
    # Listen backlog. socketserver's default of 5 drops a burst of new connections (the
    # router's pins for many turns at once), and each dropped one waits out a 1 s SYN retry.
    request_queue_size = 128


class ControlServer:
    """Serve describe / pin / unpin / keepalive / release / stats for one instance.

    ``keeper`` is None on a prefill (or a decode with retention off): then only ``/health``
    and ``/kvturn/v1/stats`` answer, and retention routes say that nothing is retained here.
    ``advertise`` is the address ``url`` names when ``host`` is a wildcard (``0.0.0.0``,
    ``::``), which no peer can dial: the instance's own fleet address.
    """

    def __init__(self, host: str, port: int, *, engine_id: str, role: str,
                 keeper: RetentionKeeper | None,
                 extra_stats: Callable[[], dict[str, Any]] | None = None,
                 secret: str | None = None, advertise: str | None = None) -> None:
        self.engine_id = engine_id
        self._advertise = advertise
        self.role = role
        self.keeper = keeper
        self.extra_stats = extra_stats or dict
        self._secret = secret
        self._host = host
        self.refused = 0
        self._lock = threading.Lock()
        self._refused_logged_at = -REFUSED_LOG_INTERVAL
        handler = type("Handler", (_Handler,), {"control": self})
        try:
            self._server = _Server((host, port), handler)
        except OSError as exc:
            raise OSError(
                f"kvturn control endpoint cannot listen on {host}:{port}: {exc} (set "
                "kv_connector_extra_config.control_port to a free port)") from exc
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="kvturn-control", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        """The URL peers dial (what the decode reports in ``kv_transfer_params``)."""
        return dial_url(*self.address, self._advertise)

    def start(self) -> ControlServer:
        self._thread.start()
        log.info("kvturn control endpoint on %s (%s, engine %s, %s)", self.url, self.role,
                 self.engine_id,
                 "shared secret required" if self._secret else "no authentication")
        warning = exposure_warning(self._host, self._secret, self.url)
        if warning is not None:
            log.warning("%s", warning)
        return self

    def note_refused(self, what: str) -> None:
        """Count a refused request; log one line per interval (a flood must not fill logs)."""
        with self._lock:
            self.refused += 1
            now = time.monotonic()
            if now - self._refused_logged_at < REFUSED_LOG_INTERVAL:
                return
            self._refused_logged_at = now
            count = self.refused
        log.warning("kvturn control request %s refused: missing or wrong %s (%d refused so "
                    "far)", what, HEADER_CONTROL_SECRET, count)

    def authorized(self, given: str | None) -> bool:
        """Whether a request carrying ``given`` in the secret header may be served."""
        return self._secret is None or secret_matches(given, self._secret)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # Routing: (method, path segments) -> (status, body).

    def handle(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        parts = [unquote(p) for p in path.split("?", 1)[0].strip("/").split("/")]
        if method == "GET" and parts == _HEALTH:
            return 200, ControlHealth(engine_id=self.engine_id, role=self.role)
        if parts[:len(_API)] != _API:
            return _not_found(f"no route {method} {path}")
        route = parts[len(_API):]
        if method == "GET" and route == [STATS]:
            stats: dict[str, Any] = {"engine_id": self.engine_id, "role": self.role,
                                     **self.extra_stats()}
            if self.keeper is not None and self.keeper.bound:
                stats["retention"] = self.keeper.stats()
            return 200, stats
        keeper = self.keeper
        if keeper is None or not keeper.bound:
            return 404, _error("this instance retains no KV (a prefill, or retention is off)",
                               "not_found", GoneReason.NO_RETENTION)
        if len(route) == 2 and route[0] == RETENTIONS and method in ("GET", "DELETE"):
            key = route[1]
            if method == "GET":
                return _answer(keeper.describe(key))
            released = keeper.release(key)
            if isinstance(released, Gone):
                return _answer(released)
            return 200, RetentionReleased(key=key, released=True)
        if len(route) == 3 and route[0] == RETENTIONS and method == "POST":
            key, action = route[1], route[2]
            if action == KEEPALIVE:
                return _answer(keeper.keepalive(key))
            if action == PIN:
                ttl = body.get("ttl", 30)
                if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
                    return 400, _error(f"ttl must be a positive number of seconds, got {ttl!r}",
                                       "invalid_request_error", ControlErrorCode.BAD_TTL)
                host_reads = body.get("host_reads", False)
                if not isinstance(host_reads, bool):
                    return 400, _error(f"host_reads must be true or false, got {host_reads!r}",
                                       "invalid_request_error", ControlErrorCode.BAD_BODY)
                return _answer(keeper.pin(key, float(ttl), host_reads=host_reads))
        if len(route) == 2 and route[0] == PINS and method == "DELETE":
            return 200, UnpinBody(pin_id=route[1], unpinned=keeper.unpin(route[1]))
        if method == "GET" and route == [LOST]:
            return self._lost(keeper, path)
        return _not_found(f"no route {method} {path}")

    def _lost(self, keeper: RetentionKeeper, path: str) -> tuple[int, Any]:
        """``GET .../lost?after=N&wait=S``: the retentions dropped on their own (evicted,
        expired) after entry ``N``, waiting up to ``S`` seconds (at most ``MAX_LOST_WAIT``)
        for one (``_lost.py``)."""
        query = parse_qs(path.split("?", 1)[1]) if "?" in path else {}
        try:
            after = int(query.get(LOST_AFTER, ["0"])[0])
            wait = float(query.get(LOST_WAIT, ["0"])[0])
        except ValueError:
            return 400, _error(f"{LOST_AFTER} must be a whole number and {LOST_WAIT} a number "
                               "of seconds", "invalid_request_error", ControlErrorCode.BAD_QUERY)
        if not 0 <= wait <= MAX_LOST_WAIT or after < 0:
            return 400, _error(f"need {LOST_AFTER} >= 0 and 0 <= {LOST_WAIT} <= "
                               f"{MAX_LOST_WAIT:g}", "invalid_request_error",
                               ControlErrorCode.BAD_QUERY)
        found = keeper.lost.since(after, wait)
        return 200, LostBody(engine_id=self.engine_id, seq=found.seq,
                             truncated=found.truncated,
                             lost=[{"key": key, "reason": reason, "read_id": read_id}
                                   for key, reason, read_id in found.lost])


def dial_url(host: str, port: int, advertise: str | None = None) -> str:
    """The URL of an endpoint bound to ``host``: a wildcard bind is named by ``advertise``."""
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        wildcard = False
    if advertise and wildcard:
        host = advertise
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def exposure_warning(host: str, secret: str | None, url: str) -> str | None:
    """What to warn about an endpoint bound to ``host``: None on loopback or with a secret."""
    if secret is not None or is_loopback(host):
        return None
    return (f"kvturn control endpoint {url} listens on {host} with no shared secret: anyone "
            "who reaches it can pin, describe and release this instance's retentions. Set "
            "KVTURN_CONTROL_SECRET_FILE (or kv_connector_extra_config.control_secret_file) here "
            "and on the routers (docs/connector.md, \"Network exposure\")")


def _error(message: str, type_: str, code: str) -> ErrorBody:
    return {"error": {"message": message, "type": type_, "code": code}}


def _not_found(message: str) -> tuple[int, Any]:
    return 404, _error(message, "not_found", ControlErrorCode.NO_ROUTE)


def _answer(result: dict[str, Any] | Gone) -> tuple[int, Any]:
    if isinstance(result, Gone):
        error = _error(f"no live retention for {result.key!r}: {result.reason.value}",
                       "not_found", result.reason.value)
        body: GoneBody = {"error": error["error"]}
        if result.cached_tokens is not None:
            body["cached_tokens"] = result.cached_tokens
        if result.host_tokens:
            body["host_tokens"] = result.host_tokens
        return 404, body
    return 200, result


class _Handler(BaseHTTPRequestHandler):
    control: ControlServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        authorized = self.control.authorized(self.headers.get(HEADER_CONTROL_SECRET))
        try:
            body = self._read_body()
        except ValueError as exc:
            # The body may be unread: what is left of it must not be parsed as a request.
            if not authorized:
                self._unauthorized(close=True)
            else:
                self._send(400, _error(str(exc), "invalid_request_error",
                                       ControlErrorCode.BAD_BODY), close=True)
            return
        if not authorized:
            self._unauthorized()
            return
        try:
            status, payload = self.control.handle(method, self.path, body)
        except Exception as exc:  # one bad request must not take the endpoint down
            log.exception("control request %s %s failed", method, self.path)
            status, payload = 500, _error(f"{type(exc).__name__}: {exc}", "server_error",
                                          ControlErrorCode.INTERNAL)
        self._send(status, payload)

    def _unauthorized(self, *, close: bool = False) -> None:
        self.control.note_refused(f"{self.command} {self.path.split('?', 1)[0][:200]} from "
                                  f"{self.client_address[0]}")
        self._send(401, _error(f"this control endpoint requires the fleet's shared secret in "
                               f"the {HEADER_CONTROL_SECRET} header", "authentication_error",
                               ControlErrorCode.UNAUTHORIZED), close=close)

    def _read_body(self) -> dict[str, Any]:
        if self.headers.get("Transfer-Encoding"):
            raise ValueError("send the body with a Content-Length (no Transfer-Encoding)")
        length = int(self.headers.get("Content-Length") or 0)
        if length < 0:
            raise ValueError(f"negative Content-Length {length}")
        if length > MAX_BODY:
            # Read (a bounded amount of) it anyway: closing with it unread would reset the
            # connection, and the client could lose this 400.
            left = min(length, 16 * MAX_BODY)
            while left > 0 and (chunk := self.rfile.read(min(left, MAX_BODY))):
                left -= len(chunk)
            raise ValueError(f"body larger than {MAX_BODY} bytes")
        if not length:
            return {}
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        return body

    def _send(self, status: int, payload: Any, *, close: bool = False) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")  # also ends this connection's loop
        try:
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            # The caller went away first: a router stopping mid long poll (GET /lost?wait=).
            # Nothing to answer; not an error of this server's.
            log.debug("control: %s %s: the client closed before the answer", self.command,
                      self.path)
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("control %s", format % args)
