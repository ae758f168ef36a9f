"""kvturn's wire words: the names and values its parts say to each other over HTTP.

One list, imported by every end: the SDK, the router, the connector's control endpoint, and
the tools (``kvturn bench``, ``kvturn up``, the demo). docs/http-api.md is the contract these
spell out; ``tests/sdk/test_wire_vocabulary.py`` holds the page, this module and the code that
speaks them together, so a word changed in one place only fails there, not in production.

It needs the standard library only. It lives in the SDK because the SDK must not depend on
``kvturn_server``, while the server ships in the same distribution and may import the SDK.
Importing it loads the ``kvturn`` package (openai's client) too, which every process that
imports it has loaded already: vLLM's engine and API server import openai, and so does the
``kvturn`` command.

Values are typed where both ends read them (``StrEnum``: a member *is* its string, so it goes
on the wire, into JSON and into logs as is); bodies are ``TypedDict``s naming their fields.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Final, TypedDict
from urllib.parse import quote

# -- A. The router API: headers --------------------------------------------------------------

# Request: the conversation id, first found of the body field, then the headers, then vLLM's
# own body field (docs/http-api.md, "Conversation identity"; coding agents' headers follow).
BODY_CONVERSATION_ID: Final = "conversation_id"
HEADER_CONVERSATION_ID: Final = "X-Conversation-ID"
HEADER_SESSION_ID: Final = "X-Session-ID"
BODY_SESSION_ID: Final = "session_id"
ID_MAX_LENGTH: Final = 256
"""The longest conversation id the router accepts (1-256 printable ASCII characters)."""

HEADER_NO_REUSE: Final = "X-KVTurn-No-Reuse"
HEADER_REQUEST_ID: Final = "x-request-id"

# Response: the router's report of what a turn reused and where it ran.
HEADER_REUSE: Final = "X-KVTurn-Reuse"
HEADER_REUSED_TOKENS: Final = "X-KVTurn-Reused-Tokens"
HEADER_BLOCK_SIZE: Final = "X-KVTurn-Block-Size"
"""Sent with ``pending``: the decode's block size, which tells ``hit`` from ``partial`` once the
stream's usage says how many prompt tokens the decode had cached."""
HEADER_ROUTE: Final = "X-KVTurn-Route"
HEADER_PREFILL_CHOICE: Final = "X-KVTurn-Prefill-Choice"
HEADER_CONVERSATION_ECHO: Final = "X-KVTurn-Conversation"

RESPONSE_HEADERS: Final = (HEADER_REUSE, HEADER_REUSED_TOKENS, HEADER_BLOCK_SIZE, HEADER_ROUTE,
                           HEADER_PREFILL_CHOICE, HEADER_CONVERSATION_ECHO)
"""Every ``X-KVTurn-*`` header of the reuse report, in the order docs/http-api.md lists them."""


class ReuseReason(StrEnum):
    """A turn's reuse value, as ``X-KVTurn-Reuse`` and a prefill's ``kvturn.reuse.reason``
    report it (docs/http-api.md, "Reuse report"). The connector's reuse decision says which
    applies (``connector/_reuse.py``); the router passes it on or finds its own."""

    HIT = "hit"
    PARTIAL = "partial"
    MISS = "miss"
    EXPIRED = "expired"
    STALE = "stale"
    BELOW_THRESHOLD = "below-threshold"
    UNVERIFIED = "unverified"
    DISABLED = "disabled"


PENDING: Final = "pending"
"""The router's own ``X-KVTurn-Reuse`` for a stream the decode continued alone: not known when
the headers go out. Never a prefill's report, so not a :class:`ReuseReason`."""

REUSE_REASONS: Final = frozenset(reason.value for reason in ReuseReason)
"""The values a report may carry (a prefill's, or a decode's own coverage)."""
REUSE_OUTCOMES: Final = (*(reason.value for reason in ReuseReason), PENDING)
"""Every value ``X-KVTurn-Reuse`` takes."""
REUSED_OUTCOMES: Final = frozenset({ReuseReason.HIT.value, ReuseReason.PARTIAL.value})
"""The values that say something was reused."""


class Route(StrEnum):
    """``X-KVTurn-Route``: where a turn ran."""

    DECODE = "decode"
    """The decode holding the conversation continued it alone (no prefill leg)."""
    PREFILL = "prefill"
    """A prefill leg, then a decode leg."""
    FALLBACK = "fallback"
    """No prefill leg succeeded; the decode computed the prompt."""


class PrefillChoice(StrEnum):
    """``X-KVTurn-Prefill-Choice``, with route ``prefill``: why that prefill."""

    HOLDER = "holder"
    AFFINITY = "affinity"
    LOAD = "load"
    ROUND_ROBIN = "round-robin"


# -- Paths ----------------------------------------------------------------------------------

# The router's own endpoints and the connector's control API share one prefix.
API_PREFIX: Final = "/kvturn/v1"
CONVERSATIONS: Final = "conversations"
RETENTIONS: Final = "retentions"
PINS: Final = "pins"
STATS: Final = "stats"
LOST: Final = "lost"
KEEPALIVE: Final = "keepalive"
PIN: Final = "pin"
HEALTH_PATH: Final = "/health"

CONVERSATIONS_PREFIX: Final = f"{API_PREFIX}/{CONVERSATIONS}/"
STATS_PATH: Final = f"{API_PREFIX}/{STATS}"
LOST_PATH: Final = f"{API_PREFIX}/{LOST}"
LOST_AFTER: Final = "after"
LOST_WAIT: Final = "wait"


def _segment(part: str) -> str:
    # Ids and keys may hold "/", ":", "#", "%", "?", ...: each must stay one path segment.
    return quote(part, safe="")


def conversation_path(conversation_id: str, action: str | None = None) -> str:
    """``/kvturn/v1/conversations/{id}[/{action}]`` (router API), the id percent-encoded."""
    path = CONVERSATIONS_PREFIX + _segment(conversation_id)
    return f"{path}/{action}" if action else path


def retention_path(key: str, action: str | None = None) -> str:
    """``/kvturn/v1/retentions/{key}[/{action}]`` (control API), the key percent-encoded."""
    path = f"{API_PREFIX}/{RETENTIONS}/{_segment(key)}"
    return f"{path}/{action}" if action else path


def pin_path(pin_id: str) -> str:
    """``/kvturn/v1/pins/{pin_id}`` (control API)."""
    return f"{API_PREFIX}/{PINS}/{_segment(pin_id)}"


def lost_path(after: int, wait: float) -> str:
    """``/kvturn/v1/lost?after=N&wait=S`` (control API)."""
    return f"{LOST_PATH}?{LOST_AFTER}={int(after)}&{LOST_WAIT}={wait:g}"


# -- C. The control API (router -> a decode's connector) ------------------------------------

HEADER_CONTROL_SECRET: Final = "X-KVTurn-Control-Secret"
"""The fleet's shared secret (not ``Authorization``: that one carries vLLM's ``--api-key``)."""


class GoneReason(StrEnum):
    """Why a decode has no live retention under a key: the ``code`` of its ``404 Gone``."""

    NO_RETENTION = "no_retention"
    """Never retained there, or forgotten."""
    EXPIRED = "expired"
    RELEASED = "released"
    EVICTED = "evicted"
    REPLACED = "replaced"


GONE_CODES: Final = (*(reason.value for reason in GoneReason), ReuseReason.STALE.value)
"""Every ``error.code`` of a conversation keepalive's ``404``: the decode's reasons, or
``stale`` (the holding decode restarted or left the configuration)."""


def gone_reason(code: object) -> GoneReason:
    """A decode's Gone ``code`` as one of the known reasons. Anything else (a newer
    connector's word, or no word) is ``no_retention``: there is none, for a reason this end
    does not know, and a raw word from a peer never reaches a client or a metric label."""
    if isinstance(code, str):
        try:
            return GoneReason(code)
        except ValueError:
            pass
    return GoneReason.NO_RETENTION


class Where(StrEnum):
    """Where a retention lives (its ``where`` field)."""

    DEVICE = "device"
    BOTH = "both"
    HOST = "host"


class ControlErrorCode(StrEnum):
    """The control API's other error ``code`` values."""

    UNAUTHORIZED = "unauthorized"
    BAD_BODY = "bad_body"
    BAD_TTL = "bad_ttl"
    BAD_QUERY = "bad_query"
    NO_ROUTE = "no_route"
    INTERNAL = "internal"


class ControlHealth(TypedDict):
    """``GET /health`` of a control endpoint."""

    engine_id: str
    role: str


class RetentionBody(TypedDict):
    """``Retention``: a decode's answer about one retention (describe, pin, keepalive)."""

    key: str
    engine_id: str
    params: dict[str, Any]
    num_tokens: int
    num_blocks: int
    expires_in: float
    hold_remaining: float
    created_ago: float
    where: Where
    host_tokens: int


class PinBody(RetentionBody):
    """A pin's answer: the retention, plus the pin."""

    pin_id: str
    pin_expires_in: float


class UnpinBody(TypedDict):
    pin_id: str
    unpinned: bool


class RetentionReleased(TypedDict):
    key: str
    released: bool


class LostEntry(TypedDict):
    """One retention a decode dropped on its own; ``reason`` is ``evicted`` or ``expired``."""

    key: str
    reason: str
    read_id: str


class LostBody(TypedDict):
    """``GET .../lost``: the entries after the caller's cursor; ``seq`` is the next cursor."""

    engine_id: str
    seq: int
    truncated: bool
    lost: list[LostEntry]


class ErrorDetail(TypedDict):
    message: str
    type: str
    code: str


class ErrorBody(TypedDict):
    """The control API's errors (the router's are OpenAI-shaped: ``param`` too)."""

    error: ErrorDetail


class GoneBody(ErrorBody, total=False):
    """A describe's ``404``: with ``cached_tokens`` when the decode remembers the key's last
    dropped retention (how much of that history its prefix cache still holds). A pin's
    ``404 evicted``: with ``host_tokens`` when the retention lives on in the decode's host tier
    alone (how much of the history, from its start, the decode can load from host memory)."""

    cached_tokens: int
    host_tokens: int


# -- The router's conversation endpoints -----------------------------------------------------

class KeepaliveBody(TypedDict):
    """``POST /kvturn/v1/conversations/{id}/keepalive``: the renewed lease."""

    conversation_id: str
    retained: bool
    expires_in: float
    hold_remaining: float | None
    num_tokens: int


class ReleaseBody(TypedDict):
    """``DELETE /kvturn/v1/conversations/{id}``."""

    conversation_id: str
    released: bool


# -- Prometheus label values ----------------------------------------------------------------

def metric_label(value: str) -> str:
    """``value`` as a Prometheus label value: every label value of kvturn's metrics is
    snake_case, so a wire value with a hyphen (``below-threshold``, ``round-robin``) is
    counted under its underscore form (``below_threshold``)."""
    return value.replace("-", "_")
