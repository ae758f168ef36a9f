"""One conversation's state, shared by every client view of it (``with_options`` copies)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Literal, TypeVar, cast

import httpx2
from openai import NotGiven

from kvturn._compat import FinalRequestOptions
from kvturn._constants import CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH
from kvturn._errors import ConversationClosedError, InvalidConversationIdError
from kvturn._identity import child_id
from kvturn._turns import ConversationStats, StatsCounter, TurnInfo, TurnReport
from kvturn.wire import BODY_CONVERSATION_ID, HEADER_CONVERSATION_ID, HEADER_NO_REUSE

_H = TypeVar("_H")

Api = Literal["chat", "completions", "responses"]
_TURN_APIS: dict[str, Api] = {CHAT_PATH: "chat", COMPLETIONS_PATH: "completions",
                              RESPONSES_PATH: "responses"}


class TurnPlan:
    """One turn as the SDK sent it, and the router's report once it answered."""

    __slots__ = ("api", "no_reuse", "report", "usage")

    def __init__(self, api: Api, no_reuse: str | None, usage: bool) -> None:
        self.api = api
        self.no_reuse = no_reuse  # the caller's own X-KVTurn-No-Reuse, if it sent one
        self.usage = usage  # a stream that asked for usage (stream_options.include_usage)
        self.report: TurnReport | None = None


def _as_dict(value: Any) -> Mapping[str, Any] | None:
    """``value`` if it is a mapping; a plain ``dict`` (the usual case) skips the ABC check."""
    if type(value) is dict or (not isinstance(value, NotGiven) and isinstance(value, Mapping)):
        return cast(Mapping[str, Any], value)
    return None


def _header(headers: Mapping[str, Any], name: str) -> Any:
    """The value of header ``name`` in any case (the last spelling, as ``_pop_header``)."""
    lowered = name.lower()
    value = None
    for key, item in headers.items():
        if key.lower() == lowered:
            value = item
    return value


def _pop_header(headers: MutableMapping[str, Any], name: str) -> Any:
    """Remove every case variant of ``name`` and return the last value (headers are
    case-insensitive; two spellings would be sent as a repeated header)."""
    lowered = name.lower()
    value = None
    for key in [key for key in headers if key.lower() == lowered]:
        value = headers.pop(key)
    return value


def _multipart(headers: Mapping[str, Any]) -> bool:
    """Whether openai sends the body as multipart form fields (its own test: a Content-Type
    starting with ``multipart/form-data``)."""
    return any(key.lower() == "content-type" and isinstance(value, str)
               and value.startswith("multipart/form-data") for key, value in headers.items())


class ConversationState:
    """Identity, reuse counters and lifecycle of one conversation.

    It keeps nothing of a turn's messages or reply: whether a turn extends the previous one is
    the server's to find out, exactly (the router's message digests decide whether the decode
    may continue it; the prefill's connector reads only blocks whose content hashes verify).
    """

    # Slots: a turn touches these a few times each, between openai's much larger work, where
    # every object it reaches is cold: the fewer places they live in, the cheaper.
    __slots__ = ("_last", "_lock", "children", "closed", "heartbeat", "id",
                 "keepalive_interval", "stats")

    def __init__(self, conversation_id: str, *, keepalive_interval: float) -> None:
        self.id = conversation_id
        self.keepalive_interval = keepalive_interval
        self._lock = threading.Lock()
        # One lock for the last report and the counters: a turn updates both at once.
        self.stats = StatsCounter(self._lock)
        self._last: TurnReport | None = None
        self.closed = False
        self.children: dict[str, ConversationState] = {}
        # Created by the first pause() (it needs the client that sends the keepalives).
        self.heartbeat: Any = None

    # --- structure and lifecycle -------------------------------------------------------------

    def child(self, name: str) -> ConversationState:
        """The open branch called ``name``, created on first use."""
        with self._lock:
            child = self.children.get(name)
            if child is None or child.closed:
                child = ConversationState(child_id(self.id, name),
                                          keepalive_interval=self.keepalive_interval)
                self.children[name] = child
            return child

    def open_tree(self) -> list[ConversationState]:
        """This conversation and its open branches, branches first (released before it)."""
        with self._lock:
            children = list(self.children.values())
        found = [state for child in children for state in child.open_tree()]
        if not self.closed:
            found.append(self)
        return found

    def ensure_heartbeat(self, create: Callable[[], _H]) -> _H:
        """The conversation's one heartbeat, created by the first pause (under the lock, so
        two threads pausing at once still share one loop)."""
        with self._lock:
            if self.heartbeat is None:
                self.heartbeat = create()
            heartbeat: _H = self.heartbeat
            return heartbeat

    def close(self) -> bool:
        """Mark closed; True the first time (the caller then releases the retention)."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            return True

    # --- before sending ---------------------------------------------------------------------

    def prepare(self, options: FinalRequestOptions) -> TurnPlan | None:
        """Make ``options`` (openai's own copy for one attempt: changing it changes nothing of
        the caller's) carry this conversation. Returns the turn's plan, or None for requests
        that are not turns.

        The id goes in the body when there is a JSON body (the router's first source), else in
        the ``X-Conversation-ID`` header. Not in both: with httpx2 every header costs each
        later header lookup of the request a step (openai and httpx2 make dozens), which made
        the header the largest single part of the SDK's per-call overhead.
        """
        given = options.headers  # usually openai's NotGiven (falsy, by a method call)
        headers = dict(given) if type(given) is not NotGiven and given else None
        header_id = None
        if headers:
            header_id = _pop_header(headers, HEADER_CONVERSATION_ID)
            self._check_scope(header_id, "header")
        body = options.json_data
        if type(body) is not dict:
            body = _as_dict(body)
        extra = options.extra_json
        if body is not None and body.get(BODY_CONVERSATION_ID) is not None:
            self._check_scope(body[BODY_CONVERSATION_ID], "body")
        if extra:
            self._check_scope(extra.get(BODY_CONVERSATION_ID), "body")

        plan = None
        method = options.method
        api = (_TURN_APIS.get(options.url) if method == "post" or method.lower() == "post"
               else None)
        if api is not None and body is not None:
            if self.closed:
                raise ConversationClosedError(
                    f"conversation {self.id!r} is closed (its retention was released); "
                    "start a new one with client.conversation(...)")
            # The caller's own opt-out goes to the router as written; the report names it.
            requested = _header(headers, HEADER_NO_REUSE) if headers else None
            plan = TurnPlan(api, requested if isinstance(requested, str) else None,
                            _asks_usage({**body, **extra} if extra else body))

        # A body with files, or a multipart Content-Type, is sent as form fields (or, files
        # without that header, not at all), where the router never looks: not a JSON body.
        json_body = body if body is not None and options.files is None and not (
            headers and _multipart(headers)) else None
        if json_body is None or header_id is not None:
            # No JSON body to carry it, or the caller named it in a header too: then exactly
            # one copy of the header goes (two spellings would be sent as a repeated header).
            headers = headers if headers is not None else {}
            headers[HEADER_CONVERSATION_ID] = self.id
        # New objects, never the shared ones changed in place: openai's copy is shallow.
        if headers is not None:
            options.headers = headers
        if json_body is not None:
            # In the body itself: an extra_json makes openai merge the two (a walk of the body).
            # Written to the field's storage: pydantic's __setattr__ only adds the name to
            # the fields set, and json_data is in it (openai constructs every request's
            # options with it; tests/sdk/test_canary.py).
            vars(options)["json_data"] = {**json_body, BODY_CONVERSATION_ID: self.id}
            if extra and BODY_CONVERSATION_ID in extra:  # None there would win the merge
                options.extra_json = {**extra, BODY_CONVERSATION_ID: self.id}
        return plan

    def _check_scope(self, value: Any, where: str) -> None:
        if value is not None and value != self.id:
            raise InvalidConversationIdError(
                f"this client is scoped to conversation {self.id!r} but the request's {where} "
                f"names {value!r}; use client.conversation({value!r}) for that one")

    # --- after the router answered -----------------------------------------------------------

    def started(self, plan: TurnPlan, response: httpx2.Response, *, attempts: int,
                streamed: bool) -> TurnReport:
        """The router answered the turn (``response``): its report is the last turn's."""
        report = TurnReport(response.headers, conversation_id=self.id, api=plan.api,
                            no_reuse_reason=plan.no_reuse, attempts=attempts, streamed=streamed)
        plan.report = report
        with self._lock:  # the counters' lock too
            self._last = report
            self.stats.turn_locked(report)
        return report

    @property
    def last_turn(self) -> TurnInfo | None:
        last = self._last
        return None if last is None else last.info()

    def snapshot(self) -> ConversationStats:
        return self.stats.snapshot()

    def settle(self, plan: TurnPlan, usage: Any) -> bool:
        """A stream's usage event (``usage``, its JSON) has been read: a ``pending`` report
        of turn ``plan`` is settled from its cached tokens (``TurnInfo.settled``). False when
        the usage does not say them (then a later event may)."""
        report = plan.report
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if report is None or type(prompt) is not int or type(cached) is not int:
            return False
        with self._lock:
            self.stats.settle_locked(report, prompt, cached)
        return True


def _asks_usage(body: Mapping[str, Any]) -> bool:
    """A streamed turn whose usage event the caller will read (the router cuts it out of a
    stream that did not ask)."""
    if body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    return type(options) is dict and options.get("include_usage") is True
