"""What the router remembers of a conversation's messages, and what it estimates from it.

The router never tokenizes. To decide whether the decode that holds a conversation can continue
the next turn itself (``_placement.py``), it needs two facts about the new request: does it
extend the history the decode holds (the same messages, in the same order, plus new ones), and
about how many tokens are new. Both come from the request's ``messages`` serialised once:

- a **digest** of the first ``n`` messages equals the recorded one exactly when the client sent
  the same ``n`` messages again (any edit, reorder or re-rendering changes it);
- the **size** of the new messages in serialised characters, converted to tokens at the
  conversation's own rate (tokens the decode retained per character of what it was given and
  generated), estimates what the decode would have to compute.

An estimate only moves a turn between two exact paths (the decode's prefix cache and the
prefill's verified reads both work on token ids); it never changes an answer.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from kvturn_server.router import _json


@dataclass(frozen=True, slots=True)
class History:
    """The messages a conversation's last turn was given.

    Attributes:
        messages: how many.
        chars: their serialised size (compact JSON, as the router re-encodes them).
        digest: a hash over the serialised messages, in order.
    """

    messages: int
    chars: int
    digest: str

    def to_dict(self) -> dict[str, Any]:
        return {"messages": self.messages, "chars": self.chars, "digest": self.digest}

    @classmethod
    def from_dict(cls, raw: Any) -> History | None:
        if not isinstance(raw, dict):
            return None
        messages, chars, digest = raw.get("messages"), raw.get("chars"), raw.get("digest")
        if not (isinstance(messages, int) and isinstance(chars, int)
                and isinstance(digest, str)):
            return None
        return cls(messages, chars, digest)


class Transcript:
    """A chat request's messages, each serialised once, with running digests."""

    __slots__ = ("_digests", "roles", "sizes")

    def __init__(self, messages: list[Any]) -> None:
        h = hashlib.blake2b(digest_size=16)
        self._digests = [h.hexdigest()]
        self.sizes: list[int] = []
        self.roles: list[str | None] = []
        for message in messages:
            blob = _json.dumps(message)
            # The length prefix keeps [a, bc] and [ab, c] apart.
            h.update(len(blob).to_bytes(8, "little"))
            h.update(blob)
            self._digests.append(h.hexdigest())
            self.sizes.append(len(blob))
            role = message.get("role") if isinstance(message, dict) else None
            self.roles.append(role if isinstance(role, str) else None)

    @classmethod
    def of(cls, body: dict[str, Any]) -> Transcript | None:
        """The transcript of a chat request; None for other bodies (``/v1/completions``)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        return cls(messages)

    def history(self) -> History:
        return History(len(self.sizes), sum(self.sizes), self._digests[-1])

    def extends(self, history: History) -> bool:
        """True when this request starts with exactly the messages of ``history``."""
        n = history.messages
        return 0 < n <= len(self.sizes) and self._digests[n] == history.digest


def new_tokens(history: History, transcript: Transcript, *, known_tokens: int) -> int | None:
    """Estimated prompt tokens that ``transcript`` adds to ``history``, or None.

    ``known_tokens`` is what the decode that served the last turn processed of it: its prompt
    and the reply it generated. The first new message, when it is the assistant's, is that
    reply coming back: its tokens are known, and its size calibrates the rate (tokens per
    serialised character of what the decode processed). The rest is new. None when the
    request does not extend the history, or nothing is known to estimate from.

    The decode's trailing partial block (not in its prefix cache) is not counted: at most a
    block, against thresholds of hundreds of tokens; llm-d's and Dynamo's deciders count the
    same way in blocks of 16 on GPUs, and kvturn and the stock baseline estimate alike.
    """
    if known_tokens <= 0:
        return None
    added = added_chars(history, transcript)
    if added is None:
        return None
    reply, rest = added
    known_chars = history.chars + reply
    if known_chars <= 0:
        return None
    return math.ceil(known_tokens / known_chars * rest)


def added_chars(history: History, transcript: Transcript) -> tuple[int, int] | None:
    """What ``transcript`` adds to ``history``, in serialised characters: the reply coming
    back (the first new message when it is the assistant's; 0 otherwise) and the rest. None
    when the request does not extend the history."""
    if not transcript.extends(history):
        return None
    new_sizes = transcript.sizes[history.messages:]
    reply = new_sizes[0] if new_sizes and transcript.roles[history.messages] == "assistant" \
        else 0
    return reply, sum(new_sizes) - reply
