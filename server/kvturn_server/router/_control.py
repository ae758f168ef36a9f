"""Client of the decode connectors' control API (docs/http-api.md, section C).

Every call is bounded by the control timeout. Answers come back typed: a ``Retention``, a
``Gone`` (the decode says there is nothing under that key, and why), or a ``ControlError``
(unreachable, timed out, refused for a missing or wrong secret, or an answer that is not the
contract's). With a secret configured, every call carries it (``_control_secret.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvturn.wire import (
    HEADER_CONTROL_SECRET,
    HEALTH_PATH,
    KEEPALIVE,
    LOST_PATH,
    PIN,
    GoneReason,
    gone_reason,
    lost_path,
    pin_path,
    retention_path,
)
from kvturn_server.router._backend import BackendClient, BackendError, Reply


class ControlError(Exception):
    """The control endpoint could not be used; ``kind`` as BackendError's, ``bad_reply``, or
    ``unauthorized`` (it answered 401: the secrets differ)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Retention:
    """A decode's answer about a retention (describe, pin, keepalive)."""

    key: str
    engine_id: str | None
    params: dict[str, Any]
    num_tokens: int
    expires_in: float
    hold_remaining: float | None = None
    created_ago: float | None = None
    pin_id: str | None = None


@dataclass(frozen=True, slots=True)
class Gone:
    """``404 Gone``: why the decode has no retention under the key. A code this router does
    not know (a newer connector's) is read as ``no_retention``: it goes on to clients and
    into metric labels, where only known words may (``message`` keeps the decode's text).
    ``cached_tokens``: a describe's, what the dropped retention left in the decode's prefix
    cache from its start (None: the decode does not know, or did not say). ``host_tokens``:
    a pin's, what the decode's host tier alone holds of a retention whose lease goes on
    there (no device blocks to read; None: not that case)."""

    code: GoneReason
    message: str
    cached_tokens: int | None = None
    host_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Lost:
    """A decode's answer to ``GET .../lost``: the retentions it dropped on its own (evicted,
    expired) after the caller's cursor, as ``(key, reason, read id)``; ``seq`` is the next
    cursor; ``truncated`` says some were missed (or the cursor was another engine's). A reason
    this router does not know is read as ``evicted``: the retention is gone either way."""

    engine_id: str | None
    seq: int
    lost: tuple[tuple[str, GoneReason, str], ...]
    truncated: bool


class ControlClient:
    def __init__(self, client: BackendClient, *, timeout: float,
                 secret: str | None = None) -> None:
        self.client = client
        self.timeout = timeout
        self.headers = {HEADER_CONTROL_SECRET: secret} if secret else None

    async def pin(self, control_url: str, key: str, ttl: float, *,
                  host_reads: bool = False) -> Retention | Gone:
        """Hold the retention's blocks for ``ttl`` seconds; its params are safe to read until
        then (or until unpinned). With ``host_reads`` a retention the decode keeps in its host
        tier alone is pinned there, and its params read it from host memory."""
        body = b'{"ttl":%s%s}' % (repr(float(ttl)).encode(),
                                  b',"host_reads":true' if host_reads else b"")
        reply = await self._call("POST", control_url + retention_path(key, PIN), body)
        result = _retention_or_gone(reply)
        if isinstance(result, Retention) and not result.pin_id:
            raise ControlError("bad_reply", f"{control_url}: pin answer without a pin_id")
        return result

    async def unpin(self, control_url: str, pin_id: str) -> bool:
        reply = await self._call("DELETE", control_url + pin_path(pin_id))
        data = _json_object(reply) if reply.status == 200 else None
        return bool(data and data.get("unpinned"))

    async def describe(self, control_url: str, key: str) -> Retention | Gone:
        reply = await self._call("GET", control_url + retention_path(key))
        return _retention_or_gone(reply)

    async def keepalive(self, control_url: str, key: str) -> Retention | Gone:
        reply = await self._call("POST", control_url + retention_path(key, KEEPALIVE), b"{}")
        return _retention_or_gone(reply)

    async def release(self, control_url: str, key: str) -> bool | Gone:
        """True when released, Gone when there was nothing to release."""
        reply = await self._call("DELETE", control_url + retention_path(key))
        if reply.status == 404:
            return _gone(reply)
        if reply.status != 200:
            raise ControlError("bad_reply", f"{control_url}: release answered {reply.status}")
        return True

    async def lost(self, control_url: str, after: int, wait: float) -> Lost:
        """The retentions the decode dropped on its own after entry ``after``, waiting up to
        ``wait`` seconds for one (the call's timeout is the control timeout beyond that)."""
        try:
            reply = await self.client.call(
                "GET", control_url + lost_path(after, wait),
                timeout=wait + self.timeout, headers=self.headers)
        except BackendError as exc:
            raise ControlError(exc.kind, str(exc)) from exc
        if reply.status == 401:
            raise ControlError("unauthorized", f"GET {control_url}{LOST_PATH}: the control "
                                               f"endpoint refused this router's secret")
        data = _json_object(reply) if reply.status == 200 else None
        entries = data.get("lost") if data is not None else None
        seq = data.get("seq") if data is not None else None
        if data is None or not isinstance(entries, list) or not isinstance(seq, int) \
                or isinstance(seq, bool):
            raise ControlError("bad_reply", f"{control_url}: lost answered {reply.status}")
        engine_id = data.get("engine_id")
        lost = tuple((e["key"], _lost_reason(e.get("reason")), e["read_id"]) for e in entries
                     if isinstance(e, dict) and isinstance(e.get("key"), str)
                     and isinstance(e.get("read_id"), str))
        return Lost(str(engine_id) if engine_id is not None else None, seq, lost,
                    data.get("truncated") is True)

    async def health(self, control_url: str, *, timeout: float) -> Reply:
        """``GET /health`` (the engine id), for the health checker."""
        return await self.client.call("GET", control_url + HEALTH_PATH, timeout=timeout,
                                      headers=self.headers)

    async def _call(self, method: str, url: str, body: bytes | None = None) -> Reply:
        try:
            reply = await self.client.call(method, url, body, timeout=self.timeout,
                                           headers=self.headers)
        except BackendError as exc:
            raise ControlError(exc.kind, str(exc)) from exc
        if reply.status == 401:
            raise ControlError("unauthorized", f"{method} {url}: the control endpoint refused "
                                               f"this router's secret ({HEADER_CONTROL_SECRET})")
        return reply


def _lost_reason(reason: object) -> GoneReason:
    """A lost entry's reason: ``evicted`` or ``expired``; anything else counts as evicted."""
    found = gone_reason(reason)
    return found if found is GoneReason.EXPIRED else GoneReason.EVICTED


def _json_object(reply: Reply) -> dict[str, Any] | None:
    try:
        data = reply.json()
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _gone(reply: Reply) -> Gone:
    data = _json_object(reply) or {}
    error = data.get("error")
    cached = data.get("cached_tokens")
    cached_tokens = _int(cached) if isinstance(cached, int) else None
    host = data.get("host_tokens")
    host_tokens = _int(host) if isinstance(host, int) else None
    if isinstance(error, dict):
        message = error.get("message")
        return Gone(gone_reason(error.get("code")), message if isinstance(message, str) else "",
                    cached_tokens, host_tokens)
    return Gone(GoneReason.NO_RETENTION, "", cached_tokens, host_tokens)


def _retention_or_gone(reply: Reply) -> Retention | Gone:
    if reply.status == 404:
        return _gone(reply)
    if reply.status != 200:
        raise ControlError("bad_reply", f"control endpoint answered {reply.status}")
    data = _json_object(reply)
    if data is None:
        raise ControlError("bad_reply", "control endpoint answer is not a JSON object")
    params = data.get("params")
    if not isinstance(params, dict):
        raise ControlError("bad_reply", "retention without params")
    engine_id = data.get("engine_id")
    pin_id = data.get("pin_id")
    return Retention(
        key=str(data.get("key", "")),
        engine_id=str(engine_id) if engine_id is not None else None,
        params=params,
        num_tokens=_int(data.get("num_tokens")),
        expires_in=_float(data.get("expires_in")) or 0.0,
        hold_remaining=_float(data.get("hold_remaining")),
        created_ago=_float(data.get("created_ago")),
        pin_id=str(pin_id) if pin_id is not None else None)


def _float(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return 0
