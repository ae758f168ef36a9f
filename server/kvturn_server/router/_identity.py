"""Conversation identity: which conversation a request continues, scoped by tenant.

The id is the first present of body ``conversation_id``, header ``X-Conversation-ID``, header
``X-Session-ID``, body ``session_id`` (vLLM's field). An id is 1-256 printable ASCII characters
(0x21-0x7E). Anything else is a 400 naming the field; nothing is changed before the check.
Without any of those, coding agents' own session headers name it (``agent_session``).

The key the router stores (and the decode retains under) is ``tenant + "/" + id``, where the
tenant is the first 16 hex digits of the SHA-256 of the ``Authorization`` header, or ``-`` when
there is none (``-`` is not a hex digit, so it never collides with a hashed credential). Two
tenants using the same id never share a retention. See docs/http-api.md, section A.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvturn.wire import (
    BODY_CONVERSATION_ID,
    BODY_SESSION_ID,
    HEADER_CONVERSATION_ID,
    HEADER_SESSION_ID,
    ID_MAX_LENGTH,
)
from kvturn_server.router._errors import ApiError

_VALID_ID = re.compile(rf"[\x21-\x7e]{{1,{ID_MAX_LENGTH}}}")
ANONYMOUS_TENANT = "-"

# (where, name) in resolution order: body fields by their JSON name, headers lower-cased.
_SOURCES = (("body", BODY_CONVERSATION_ID), ("header", HEADER_CONVERSATION_ID.lower()),
            ("header", HEADER_SESSION_ID.lower()), ("body", BODY_SESSION_ID))
_PARAM_NAMES = {HEADER_CONVERSATION_ID.lower(): HEADER_CONVERSATION_ID,
                HEADER_SESSION_ID.lower(): HEADER_SESSION_ID}


@dataclass(frozen=True, slots=True)
class Identity:
    """The conversation a request belongs to.

    Attributes:
        conversation_id: the client's id, echoed in ``X-KVTurn-Conversation``.
        key: ``tenant/id``, what the state store and the decode's retention use.
        source: the body field or header it came from.
    """

    conversation_id: str
    key: str
    source: str


def tenant_of(authorization: str | None) -> str:
    """The tenant scope of a credential (the credential itself is never stored or logged)."""
    if authorization is None:
        return ANONYMOUS_TENANT
    return hashlib.sha256(authorization.encode("latin-1")).hexdigest()[:16]


def credential_of(headers: Mapping[str, str]) -> str | None:
    """The credential a request scopes its conversations by: ``Authorization``, else the
    Anthropic clients' ``x-api-key`` (prefixed, so that the two headers never name one
    tenant), else None (the anonymous tenant)."""
    authorization = headers.get("authorization")
    if authorization is not None:
        return authorization
    api_key = headers.get("x-api-key")
    return None if api_key is None else f"x-api-key:{api_key}"


def conversation_key(conversation_id: str, authorization: str | None) -> str:
    return f"{tenant_of(authorization)}/{conversation_id}"


def validate_id(value: Any, param: str) -> str:
    """``value`` if it is a valid conversation id, else an ApiError(400) naming ``param``."""
    if not isinstance(value, str):
        raise ApiError(400, f"{param} must be a string conversation id, got "
                            f"{type(value).__name__}", param=param,
                       code="invalid_conversation_id")
    if _VALID_ID.fullmatch(value) is None:
        if not value:
            why = "it is empty"
        elif len(value) > ID_MAX_LENGTH:
            why = f"it has {len(value)} characters"
        else:
            bad = next(c for c in value if not "\x21" <= c <= "\x7e")
            why = f"it contains {bad!r} at position {value.index(bad)}"
        raise ApiError(400, f"{param} must be 1-{ID_MAX_LENGTH} printable ASCII characters "
                            f"(no spaces or control characters); {why}", param=param,
                       code="invalid_conversation_id")
    return value


# Agents' own session headers, as NVIDIA Dynamo maps them (``x-dynamo-session-id``, then the
# coding agents': dynamo-llm ``lib/llm/src/protocols/agents.rs``, ``AGENT_HEADER_MAPPINGS``):
# (session header, per-agent header or None, the name a log shows). Claude Code's subagents
# share the session id and name themselves in the agent id: each has a prompt of its own, so
# each is its own conversation here. OpenCode's ``x-session-id`` is kvturn's own already.
_AGENT_HEADERS = (("x-dynamo-session-id", None, "X-Dynamo-Session-ID"),
                  ("x-claude-code-session-id", "x-claude-code-agent-id",
                   "X-Claude-Code-Session-Id"),
                  ("thread-id", None, "thread-id"),
                  ("x-deepseek-harness-session-id", None, "X-DeepSeek-Harness-Session-Id"))


def agent_session(headers: Mapping[str, str]) -> tuple[str, str] | None:
    """(conversation id, source) from an agent's own session headers, or None.

    These are read after kvturn's own conventions, and only valid ids count: an agent that
    never heard of kvturn is not refused for a header it does not control (it runs without
    reuse instead)."""
    for session_header, agent_header, name in _AGENT_HEADERS:
        session = headers.get(session_header)
        if session is None or _VALID_ID.fullmatch(session) is None:
            continue
        agent = headers.get(agent_header) if agent_header is not None else None
        if agent is not None and agent != session:
            combined = f"{session}:{agent}"
            if _VALID_ID.fullmatch(combined) is not None:
                return combined, name
        return session, name
    return None


def resolve_identity(body: Mapping[str, Any], headers: Mapping[str, str]) -> Identity | None:
    """The request's conversation, or None when it names none (then it runs without reuse).

    A JSON ``null`` in a body field counts as absent (SDKs serialise unset fields that way).
    """
    authorization = credential_of(headers)
    for where, name in _SOURCES:
        value = body.get(name) if where == "body" else headers.get(name)
        if value is None:
            continue
        param = _PARAM_NAMES.get(name, name)
        conversation_id = validate_id(value, param)
        return Identity(conversation_id, conversation_key(conversation_id, authorization),
                        param)
    found = agent_session(headers)
    if found is not None:
        return Identity(found[0], conversation_key(found[0], authorization), found[1])
    return None
