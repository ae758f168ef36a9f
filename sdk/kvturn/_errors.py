"""kvturn's errors: all are ``openai.OpenAIError`` subclasses, so ``except openai.OpenAIError``
keeps working in code written for openai. Router errors that are not kvturn-specific surface as
openai's own classes (``RateLimitError``, ``InternalServerError``, ...), unchanged."""

from __future__ import annotations

import openai


class KVTurnError(openai.OpenAIError):
    """Base class of the errors kvturn raises itself."""


class InvalidConversationIdError(KVTurnError, ValueError):
    """A conversation id or fork name the router would reject (raised before anything is sent).

    The router accepts 1-256 printable ASCII characters (0x21-0x7E): no spaces, no control
    characters, no non-ASCII.
    """


class ConversationClosedError(KVTurnError):
    """A turn was sent through a conversation that was already closed (its retention released).

    Start a new one with ``client.conversation(...)``; reusing the id is allowed.
    """


class ConversationNotFoundError(KVTurnError, openai.NotFoundError):
    """The router holds no live retention for the conversation (``404``, code ``no_retention``).

    Raised by an explicit ``conversation.keepalive()``; the heartbeat of ``pause()`` only counts
    it. Nothing is lost: the next turn recomputes its prompt.
    """
