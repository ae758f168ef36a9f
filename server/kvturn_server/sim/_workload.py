"""The conversations a simulation serves: drawn from the trace distributions, or read from a file.

A conversation is its start time, its system prompt's size, and per turn the new message's
tokens, the reply's tokens and the tool gap after it. Prompts grow as in a chat: turn ``k``
sends the system prompt, every earlier message and reply, and its own message, each framed by
the chat template (``FRAMING_TOKENS``, as ``kvturn bench agent`` counts them).

Trace files (``load_trace``):

- **kvturn JSONL**: one conversation per line,
  ``{"id": "c1", "start_s": 0.0, "system_tokens": 2500,
  "turns": [{"input_tokens": 200, "output_tokens": 64, "gap_s": 3.1}, ...]}``
  (``gap_s`` is the pause after that turn; the last turn's is ignored; ``start_s`` defaults to
  0, ``system_tokens`` to 0).
- **vLLM ``benchmarks/multi_turn`` conversations JSON**: a list (or ``{"conversations": [...]}``)
  of ``{"id": ..., "messages": [{"role": "user", "content": "..."},
  {"role": "assistant", "content": "..."}, ...]}``; ShareGPT's ``"conversations"`` with
  ``"from"``/``"value"`` is read too. A system message sets the system prompt, each user (or
  tool) message starts a turn and the assistant message after it is its reply. Tokens are
  estimated as characters / 4. These files carry no timing: starts are spread uniformly over
  the arrival window and gaps drawn from the gap distribution, both seeded.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvturn_server.bench.agent import (
    FRAMING_TOKENS,
    AgentBenchSettings,
    GapDistribution,
    agent_shape,
)

CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class Conversation:
    """One agent's conversation: when it starts and what each turn sends and gets.

    Drawn conversations grow as a chat does (each prompt is the last one, its reply and a new
    message). Replayed traces state more (``sim/_traces.py``): each turn's prompt size as
    recorded (``prompts``), its blocks as the trace's hash ids (``hash_ids``, comparable within
    ``scope``), what it shares with the previous prompt and reply (``history``), and where the
    client compacted or edited the history (``versions`` changes).
    """

    cid: str
    start_s: float
    system_tokens: int
    messages: tuple[int, ...]
    """Per turn, the tokens it adds (drawn: the new message; traces: beyond its history)."""
    replies: tuple[int, ...]
    gaps_s: tuple[float, ...]
    shared_system: bool = False
    """The system prompt is the same in every conversation that says so (one agent product):
    prefix caches hold it once for all of them."""
    prompts: tuple[int, ...] | None = None
    hash_ids: tuple[tuple[int, ...], ...] | None = None
    history: tuple[int, ...] | None = None
    versions: tuple[int, ...] | None = None
    scope: int = 0

    def __post_init__(self) -> None:
        if not self.messages or len(self.replies) != len(self.messages):
            raise ValueError(f"conversation {self.cid}: needs one reply per message")
        if len(self.gaps_s) < len(self.messages) - 1:
            raise ValueError(f"conversation {self.cid}: needs a gap after every turn but the last")
        for name in ("prompts", "hash_ids", "history", "versions"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.messages):
                raise ValueError(f"conversation {self.cid}: needs one of {name} per turn")

    @property
    def turns(self) -> int:
        return len(self.messages)

    def prompt_tokens(self, turn: int) -> int:
        """Tokens of turn ``turn``'s prompt (0-based), generation prompt included."""
        if self.prompts is not None:
            return self.prompts[turn]
        history = sum(m + r + 2 * FRAMING_TOKENS for m, r in zip(
            self.messages[:turn], self.replies[:turn], strict=True))
        return self.system_tokens + FRAMING_TOKENS + history + self.messages[turn] \
            + FRAMING_TOKENS

    def history_tokens(self, turn: int) -> int:
        """Tokens of turn ``turn``'s prompt that the previous prompt and its reply already held:
        what a cache could supply (0 for the first turn)."""
        if turn == 0:
            return 0
        if self.history is not None:
            return self.history[turn]
        return self.prompt_tokens(turn - 1) + self.replies[turn - 1]

    def chat(self, turn: int) -> list[tuple[str, int, int]]:
        """The messages turn ``turn`` sends, as ``(role, characters, version)`` (one character a
        token, as the router measures them): every earlier message and reply of the same
        history version, and the new one. A new version (compaction) starts with one message
        holding the whole prompt."""
        if self.versions is None:
            out = [("system", self.system_tokens, 0)]
            for i in range(turn):
                out += [("user", self.messages[i], 0), ("assistant", self.replies[i], 0)]
            out.append(("user", self.messages[turn], 0))
            return out
        version = self.versions[turn]
        first = turn
        while first > 0 and self.versions[first - 1] == version:
            first -= 1
        out = [("user", self.prompt_tokens(first), version)]
        for i in range(first + 1, turn + 1):
            added = self.messages[i]
            out += [("assistant", max(1, self.replies[i - 1] + min(0, added)), version),
                    ("user", max(1, added), version)]
        return out


@dataclass(frozen=True)
class WorkloadSpec:
    """Synthetic agents: arrivals uniform over ``window_s``, turns, sizes and gaps drawn."""

    conversations: int = 1000
    window_s: float = 3600.0
    turns: tuple[int, int] = (2, 10)
    system_tokens: int = 2500
    shared_system: bool = True
    message_tokens: tuple[int, int] = (50, 500)
    reply_tokens: tuple[int, int] = (32, 256)
    gap_p50_s: float = 2.0
    gap_p90_s: float = 24.0
    gap_cap_s: float = 660.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.conversations < 1 or not self.window_s >= 0:
            raise ValueError("need at least one conversation and a window >= 0")
        for name in ("turns", "message_tokens", "reply_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} needs 1 <= min <= max, got {(low, high)}")
        _ = self.gaps

    @property
    def gaps(self) -> GapDistribution:
        """The bench's log-normal fit to the trace's p50/p90, capped at the p99 (unscaled)."""
        return GapDistribution(self.gap_p50_s, self.gap_p90_s, 1.0, self.gap_cap_s)


def synthetic(spec: WorkloadSpec) -> list[Conversation]:
    """The spec's conversations, sorted by start; a function of the seed alone."""
    rng = random.Random(f"kvturn-sim/{spec.seed}")
    gaps = spec.gaps
    out = []
    for i in range(spec.conversations):
        turns = rng.randint(*spec.turns)
        out.append(Conversation(
            cid=f"c{i}", start_s=rng.uniform(0.0, spec.window_s),
            system_tokens=spec.system_tokens,
            messages=tuple(rng.randint(*spec.message_tokens) for _ in range(turns)),
            replies=tuple(rng.randint(*spec.reply_tokens) for _ in range(turns)),
            gaps_s=tuple(gaps.draw(rng) for _ in range(turns - 1)),
            shared_system=spec.shared_system))
    out.sort(key=lambda c: c.start_s)
    return out


def from_agent_bench(settings: AgentBenchSettings) -> list[Conversation]:
    """The conversations ``kvturn bench agent`` (and its agent loop) sends with ``settings``:
    the same message sizes, reply lengths, gaps and starts, from the same seed."""
    out = []
    for agent in range(settings.agents):
        sizes, gaps, replies = agent_shape(settings, agent)
        out.append(Conversation(cid=f"agent-{agent}", start_s=agent * settings.stagger_s,
                                system_tokens=settings.system_tokens, messages=sizes,
                                replies=replies, gaps_s=gaps))
    return out


def load_trace(path: Path, *, window_s: float = 3600.0, gaps: GapDistribution | None = None,
               seed: int = 0) -> list[Conversation]:
    """Conversations from a trace file (format by content: JSONL of kvturn conversations, or
    vLLM multi_turn / ShareGPT JSON; see the module docstring)."""
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("[") or (stripped.startswith("{") and '"turns"' not in
                                    stripped.split("\n", 1)[0]):
        data = json.loads(text)
        items = data.get("conversations", data) if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a list of conversations")
        rng = random.Random(f"kvturn-sim-trace/{seed}")
        dist = gaps or GapDistribution(2.0, 24.0, 1.0, 660.0)
        read = [_from_messages(item, index, rng, window_s, dist)
                for index, item in enumerate(items)]
    else:
        read = [_from_jsonl(line, n, path)
                for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    out = [c for c in read if c is not None]
    if not out:
        raise ValueError(f"{path}: no conversation with at least one turn")
    out.sort(key=lambda c: c.start_s)
    return out


def _tokens(content: Any) -> int:
    if isinstance(content, list):  # OpenAI content parts
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return max(1, math.ceil(len(str(content or "")) / CHARS_PER_TOKEN))


def _from_messages(item: Any, index: int, rng: random.Random, window_s: float,
                   gaps: GapDistribution) -> Conversation | None:
    if not isinstance(item, dict):
        raise ValueError(f"conversation {index}: expected an object, got {type(item).__name__}")
    raw = item.get("messages", item.get("conversations"))
    if not isinstance(raw, list):
        raise ValueError(f"conversation {index}: no 'messages' list")
    system = 0
    messages: list[int] = []
    replies: list[int] = []
    for message in _normalise(raw):
        role, tokens = message
        if role == "system" and not messages:
            system += tokens
        elif role == "assistant":
            if messages and len(replies) < len(messages):
                replies.append(tokens)
        else:
            if len(replies) < len(messages):  # two inputs in a row: one turn
                messages[-1] += tokens + FRAMING_TOKENS
            else:
                messages.append(tokens)
    if len(replies) < len(messages):
        messages.pop()  # a final message with no reply is not a turn
    if not messages:
        return None
    return Conversation(cid=str(item.get("id", item.get("conversation_id", f"t{index}"))),
                        start_s=rng.uniform(0.0, window_s), system_tokens=system,
                        messages=tuple(messages), replies=tuple(replies),
                        gaps_s=tuple(gaps.draw(rng) for _ in range(len(messages) - 1)))


def _normalise(raw: Iterable[Any]) -> Iterable[tuple[str, int]]:
    for message in raw:
        if not isinstance(message, dict):
            continue
        role = message.get("role", message.get("from"))
        content = message.get("content", message.get("value"))
        role = {"human": "user", "gpt": "assistant"}.get(str(role), str(role))
        yield role, _tokens(content)


def _from_jsonl(line: str, number: int, path: Path) -> Conversation | None:
    try:
        item = json.loads(line)
        turns = item["turns"]
        if not turns:
            return None
        return Conversation(
            cid=str(item.get("id", f"line{number}")), start_s=float(item.get("start_s", 0.0)),
            system_tokens=int(item.get("system_tokens", 0)),
            messages=tuple(int(t["input_tokens"]) for t in turns),
            replies=tuple(int(t["output_tokens"]) for t in turns),
            gaps_s=tuple(float(t.get("gap_s", 0.0)) for t in turns[:-1]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}:{number}: not a kvturn trace line ({exc})") from exc
