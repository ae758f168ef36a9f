"""Relaying a decode's SSE stream to the client, byte for byte, as it arrives.

The decode's chunks are passed on unparsed and unbuffered: each complete event goes out as soon
as it is read. The only bytes ever held back are the tail of an event the decode has not
finished sending, so that if the stream breaks the client sees whole events followed by one
error event, never half an event glued to an error. When the stream ends (completed, broken
off, or the client gone) the relay closes the decode's reply (which makes vLLM abort a request
the client abandoned) and runs the turn's ``finish`` hook: metrics, logging and capturing the
retention the decode made.

A stream that completes holds back its final ``data: [DONE]`` event until the ``before_done``
hook (the capture) has run: an agent sends its next turn the moment it reads ``[DONE]``, and
that turn must find this turn's retention already recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from kvturn_server.router import _json
from kvturn_server.router._backend import BackendError, UpstreamStream
from kvturn_server.router._legs import without_transfer_params

log = logging.getLogger("kvturn.router")


def complete_events(data: bytes) -> int:
    """Length of the prefix of ``data`` made of complete SSE events."""
    if data.endswith(b"\n\n") or data.endswith(b"\r\n\r\n"):
        return len(data)
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


DONE_EVENT = b"data: [DONE]"


def split_done(data: bytes) -> tuple[bytes, bytes]:
    """``data`` (complete events) split into what precedes a final ``[DONE]`` event and that
    event; ``(data, b"")`` when it does not end with one."""
    body = data.rstrip(b"\r\n")
    if not body.endswith(DONE_EVENT):
        return data, b""
    start = len(body) - len(DONE_EVENT)
    if start and not data[:start].endswith(b"\n"):
        return data, b""  # "[DONE]" inside another event's data line
    return data[:start], data[start:]


_TRANSFER_KEY = b'"kv_transfer_params"'
_EVENT_SPLIT = re.compile(rb"(\r?\n\r?\n)")


def scrub_events(data: bytes) -> bytes:
    """``data`` (SSE events) with any ``kv_transfer_params`` a backend put in an event removed.

    vLLM 0.32 sends none in stream events, but a later one (or another connector) may, and
    they name the decode's blocks and hosts. The check is one substring search per chunk: the
    quoted key can only appear unescaped as a JSON key (inside generated text its quotes are
    escaped), so the common case passes through untouched. An event that names the key but
    cannot be parsed is dropped whole rather than passed on.
    """
    if _TRANSFER_KEY not in data:
        return data
    parts = _EVENT_SPLIT.split(data)
    out: list[bytes] = []
    for i in range(0, len(parts), 2):
        event_bytes = parts[i]
        sep = parts[i + 1] if i + 1 < len(parts) else b""
        if _TRANSFER_KEY not in event_bytes:
            out.append(event_bytes + sep)
            continue
        scrubbed = _scrub_event(event_bytes)
        if scrubbed is not None:
            out.append(scrubbed + (sep or b""))
    return b"".join(out)


def _scrub_event(event_bytes: bytes) -> bytes | None:
    other = [line for line in event_bytes.replace(b"\r\n", b"\n").split(b"\n")
             if not line.startswith(b"data:")]
    try:
        payload = event_data(event_bytes)
    except ValueError:
        return None
    payload, _ = without_transfer_params(payload)
    return b"\n".join([*other, b"data: " + _json.dumps(payload)])


_USAGE_KEY = b'"usage":'


class UsageTap:
    """The decode's usage in a relayed stream, found without parsing its chunks.

    A decode reports usage once, at the end of its stream: Chat and Completions in one event
    just before ``[DONE]`` (when asked, ``_apis.py``), Messages in ``message_delta`` just before
    ``message_stop``, Responses inside the final ``response.completed``. So the tap keeps a
    reference to the last batch of events relayed (one assignment per chunk) and looks for
    the usage only once, when the stream has ended (``event``). When the router asked for
    the usage and the client did not (``strip``), each batch is also searched for the quoted
    key, as ``scrub_events`` does (unescaped, it can only be a JSON key: in generated text
    its quotes are escaped), and the usage event is cut out, so that the client's stream is
    byte for byte what it would have been.
    """

    __slots__ = ("_cut", "_last", "strip")

    def __init__(self, *, strip: bool) -> None:
        self.strip = strip
        self._last = b""  # the last batch of events relayed
        self._cut = b""  # the usage event cut out of the client's stream

    def take(self, events: bytes) -> bytes:
        """``events`` (complete events, about to be relayed) as the client should get them."""
        if not self.strip:
            if events:
                self._last = events
            return events
        if _USAGE_KEY not in events:
            return events
        parts = _EVENT_SPLIT.split(events)
        kept: list[bytes] = []
        for i in range(0, len(parts), 2):
            one = parts[i] + (parts[i + 1] if i + 1 < len(parts) else b"")
            if _USAGE_KEY in one:
                self._cut = one
            else:
                kept.append(one)
        return b"".join(kept)

    def event(self, final: bytes = b"") -> Any:
        """The last event of the stream that carries usage (its JSON data), looked for in the
        held ``final`` event, then in what was cut or last relayed; None when there is none."""
        for data in (final, self._cut, self._last):
            if _USAGE_KEY not in data:
                continue
            events = [e for e in _EVENT_SPLIT.split(data)[::2] if _USAGE_KEY in e]
            try:
                return event_data(events[-1])
            except ValueError:
                return None
        return None


def event_data(event_bytes: bytes) -> Any:
    """The JSON of one SSE event's ``data:`` lines; ValueError when it is not JSON."""
    lines = event_bytes.replace(b"\r\n", b"\n").split(b"\n")
    return _json.loads(b"\n".join(line[5:].removeprefix(b" ") for line in lines
                                  if line.startswith(b"data:")))


def error_event(message: str, code: str = "backend_stream_error") -> bytes:
    """An OpenAI-style error event, then ``[DONE]`` (what vLLM itself sends on errors)."""
    payload = _json.dumps({"error": {"message": message, "type": "server_error",
                                     "param": None, "code": code}})
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"


def _default_error_event(message: str, code: str) -> bytes:
    return error_event(message, code)


class StreamEnd:
    """How a relayed stream ended: ``ok``, ``stream_error`` or ``client_gone``."""

    __slots__ = ("error", "outcome")

    def __init__(self) -> None:
        self.outcome = "ok"
        self.error: BackendError | None = None


class RelayResponse(Response):
    """An ASGI response that relays ``upstream`` (whose first chunk was already read).

    Args:
        upstream: the decode's open reply.
        first: its first chunk (read before responding, so that a decode that fails before
            its first byte can still be retried elsewhere).
        finish: awaited once the stream is over, however it ended.
        before_done: awaited when the decode has sent its whole stream, before the client gets
            the final ``[DONE]`` event (and the end of the body); it is given that held final
            event (empty when the stream had none).
        split_final: splits a chunk's final event off (``split_done``: ``data: [DONE]``;
            other APIs end with a named event, ``_apis.py``).
        error_event: the events a stream broken off ends with (``error_event`` by default).
        usage: finds the decode's usage in the stream (and cuts it out when the client did
            not ask for it); None: the stream is relayed as it is.
    """

    def __init__(self, upstream: UpstreamStream, first: bytes, headers: Mapping[str, str],
                 media_type: str, finish: Callable[[StreamEnd], Awaitable[None]],
                 before_done: Callable[[bytes], Awaitable[None]] | None = None, *,
                 split_final: Callable[[bytes], tuple[bytes, bytes]] | None = None,
                 error_event: Callable[[str, str], bytes] | None = None,
                 usage: UsageTap | None = None) -> None:
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)
        self._upstream = upstream
        self._first = first
        self._finish = finish
        self._before_done = before_done
        self._split = split_final or split_done
        self._error_event = error_event or _default_error_event
        self._usage = usage
        self._end = StreamEnd()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The body is sent by a child task while this one watches for the client leaving:
        # ASGI servers drop sends to a gone client silently, so only receive() tells.
        sender = asyncio.ensure_future(self._send_body(send))
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            await asyncio.wait((sender, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not sender.done():
                self._end.outcome = "client_gone"
                sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
        finally:
            watcher.cancel()
            if not sender.done():
                sender.cancel()
            await self._upstream.aclose()
            try:
                await self._finish(self._end)
            except Exception:  # the client has its answer; a bug here must not hide that
                log.exception("finishing a relayed stream failed")

    async def _watch(self, receive: Receive) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                return

    async def _send_body(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        upstream = self._upstream
        pending = b""
        done = b""  # a [DONE] event held back until the capture has run
        chunk: bytes | None = self._first
        while chunk is not None:
            data = pending + chunk if pending else chunk
            cut = complete_events(data)
            if cut:
                events, held = self._split(data[:cut] if cut < len(data) else data)
                events, done = done + events, held  # events after a [DONE]: pass all on
                events = scrub_events(events)
                if self._usage is not None:
                    events = self._usage.take(events)
                if events:
                    await send({"type": "http.response.body", "body": events,
                                "more_body": True})
            pending = data[cut:]
            try:
                chunk = await upstream.next_chunk()
            except BackendError as exc:
                if done:  # the answer was complete; only the connection's end went wrong
                    break
                self._end.outcome = "stream_error"
                self._end.error = exc
                await send({"type": "http.response.body",
                            "body": self._error_event("the decode backend broke off the "
                                                      f"stream ({exc.kind}); retry the "
                                                      "request", "backend_stream_error"),
                            "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
        if self._before_done is not None:
            try:
                await self._before_done(done)
            except Exception:  # the capture is best effort; the answer is not
                log.exception("capturing a relayed stream's retention failed")
        tail = scrub_events(done + pending)  # pending: the decode ended mid-event
        if tail:
            await send({"type": "http.response.body", "body": tail, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
