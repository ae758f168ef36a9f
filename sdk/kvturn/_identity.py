"""Conversation ids: the router's validity rule, generated ids, and ids of forked branches."""

from __future__ import annotations

import hashlib
import secrets

from kvturn._constants import GENERATED_ID_PREFIX
from kvturn._errors import InvalidConversationIdError
from kvturn.wire import ID_MAX_LENGTH

# A fork's name is kept short so that parent id + "/" + name always fits the router's limit once
# a long parent id is replaced by its digest (see child_id).
FORK_NAME_MAX_LENGTH = 128
_DIGEST_PREFIX_LENGTH = len(GENERATED_ID_PREFIX) + 32


def _printable_ascii(value: str) -> bool:
    return all("!" <= ch <= "~" for ch in value)


def validate_conversation_id(value: object) -> str:
    """Return ``value`` if the router would accept it as a conversation id, else raise.

    Checked here so that a bad id fails at the call site with a clear message instead of as a
    ``400`` from the router on the first turn.
    """
    if not isinstance(value, str):
        raise InvalidConversationIdError(
            f"conversation id must be a string, got {type(value).__name__}")
    if not 1 <= len(value) <= ID_MAX_LENGTH:
        raise InvalidConversationIdError(
            f"conversation id must be 1-{ID_MAX_LENGTH} characters, got {len(value)}")
    if not _printable_ascii(value):
        raise InvalidConversationIdError(
            f"conversation id {value!r} must be printable ASCII without spaces (0x21-0x7E)")
    return value


def new_conversation_id() -> str:
    """A random id (128 bits): unguessable, so two clients never collide on a retention."""
    return GENERATED_ID_PREFIX + secrets.token_hex(16)


def validate_fork_name(value: object) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= FORK_NAME_MAX_LENGTH:
        raise InvalidConversationIdError(
            f"fork name must be a string of 1-{FORK_NAME_MAX_LENGTH} characters, got {value!r}")
    if not _printable_ascii(value):
        raise InvalidConversationIdError(
            f"fork name {value!r} must be printable ASCII without spaces (0x21-0x7E)")
    return value


def child_id(parent: str, name: str) -> str:
    """The id of branch ``name`` of conversation ``parent``: ``"<parent>/<name>"``.

    Deterministic, so a branch re-created under the same name (e.g. by a LangGraph node that
    restarts) finds its own retention again. A parent too long to prefix is replaced by a digest.
    """
    candidate = f"{parent}/{name}"
    if len(candidate) <= ID_MAX_LENGTH:
        return candidate
    digest = hashlib.sha256(parent.encode()).hexdigest()[: _DIGEST_PREFIX_LENGTH - 4]
    return f"{GENERATED_ID_PREFIX}{digest}/{name}"
