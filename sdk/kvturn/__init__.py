"""kvturn: a drop-in OpenAI client that carries conversations to a kvturn router.

``kvturn.OpenAI`` / ``kvturn.AsyncOpenAI`` are openai's clients: code written for openai runs
unchanged. ``client.conversation()`` returns a client of the same API scoped to one
conversation, so that each turn can reuse the KV the decode retained from the previous one::

    import kvturn

    client = kvturn.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
    with client.conversation() as chat:
        messages = [{"role": "user", "content": "Hello!"}]
        reply = chat.chat.completions.create(model="kvturn-tiny", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "And then?"}]
        chat.chat.completions.create(model="kvturn-tiny", messages=messages)
        print(chat.last_turn.reuse, chat.last_turn.reused_tokens)   # e.g. hit 48
"""

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from kvturn.wire import REUSE_OUTCOMES

if TYPE_CHECKING:
    from kvturn._client import AsyncOpenAI, OpenAI
    from kvturn._conversation import AsyncConversation, Conversation
    from kvturn._errors import (
        ConversationClosedError,
        ConversationNotFoundError,
        InvalidConversationIdError,
        KVTurnError,
    )
    from kvturn._keepalive import Heartbeat
    from kvturn._retry import RetryPolicy
    from kvturn._turns import ConversationStats, Lease, TurnInfo

# The clients load openai (and its models: tens of thousands of objects) when first used, not
# when a server process imports ``kvturn.wire`` (its vocabulary) and with it this package: a
# router's garbage collector then walks a third of the objects (router bench: about 15 % more
# requests per second at 64 clients).
_WHERE = {
    "AsyncOpenAI": "_client", "OpenAI": "_client",
    "AsyncConversation": "_conversation", "Conversation": "_conversation",
    "ConversationClosedError": "_errors", "ConversationNotFoundError": "_errors",
    "InvalidConversationIdError": "_errors", "KVTurnError": "_errors",
    "Heartbeat": "_keepalive", "RetryPolicy": "_retry",
    "ConversationStats": "_turns", "Lease": "_turns", "TurnInfo": "_turns",
}


def __getattr__(name: str) -> Any:
    """Every client name at once, on the first use of any (they import each other anyway)."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    for attribute, module in _WHERE.items():
        globals()[attribute] = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    return globals()[name]


try:
    __version__ = version("kvturn")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"

__all__ = [
    "REUSE_OUTCOMES",
    "AsyncConversation",
    "AsyncOpenAI",
    "Conversation",
    "ConversationClosedError",
    "ConversationNotFoundError",
    "ConversationStats",
    "Heartbeat",
    "InvalidConversationIdError",
    "KVTurnError",
    "Lease",
    "OpenAI",
    "RetryPolicy",
    "TurnInfo",
    "__version__",
]
