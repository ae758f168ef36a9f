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

from importlib.metadata import PackageNotFoundError, version

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
from kvturn.wire import REUSE_OUTCOMES

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
