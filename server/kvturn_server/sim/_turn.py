"""One turn of a simulated conversation: what it carries through its legs, and what it is made
of as kvturn's own code reads it: its messages (the router's transcript measures them), its
blocks' hashes (prefix caches, retentions and reads match them) and the record the router keeps
of it once served (``Placement``).

Apart from the engine (``_engine.py``), which only moves time: these are the turn's facts, the
same whatever the clock says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvturn.wire import ReuseReason, Route
from kvturn_server.bench.agent import FRAMING_TOKENS
from kvturn_server.connector import Retention
from kvturn_server.router import (
    Backend,
    DecodeUsage,
    Placement,
    ReuseReport,
    Transcript,
    TurnPath,
    recorded_prefill,
    served_tokens,
)
from kvturn_server.sim._instances import prompt_hashes, trace_hashes, unique_hashes
from kvturn_server.sim._workload import Conversation

_PADS: dict[tuple[int, int], str] = {}


def pad(tokens: int, version: int) -> str:
    # The router measures messages in serialised characters: one per token keeps its rate
    # estimate exact; the character names the history's version, so that a compacted history
    # no longer extends the old one; shared strings keep memory flat.
    key = (tokens, version)
    text = _PADS.get(key)
    if text is None:
        text = _PADS[key] = chr(ord("a") + version % 26) * tokens
    return text


@dataclass(slots=True)
class Turn:
    """A turn in flight: its conversation and prompt, then what the router's planner decided
    (where it runs, whether it pinned, the reuse value it reports) and the legs did (tokens
    computed and reused, the decode's blocks held)."""

    conv: Conversation
    index: int
    arrived: float
    prompt: int
    first: bytes
    hashes: list[bytes]
    placement: Placement | None = None
    holder: Backend | None = None
    transcript: Transcript | None = None
    prefill: Backend | None = None
    decode: Backend | None = None
    where: TurnPath = TurnPath.PREFILL
    route: Route = Route.PREFILL
    reason: ReuseReason = ReuseReason.MISS
    pinned: bool = False
    prefill_report: ReuseReport | None = None
    """What its prefill's connector reported (``kvturn.reuse``); None: no prefill leg."""
    usage: DecodeUsage | None = None
    """What its decode's usage said, of a turn the decode ran alone; None: not known."""
    computed: int = 0
    reused: int = 0
    local_hit: int = 0
    continued: int = 0
    ready_at: float = 0.0
    blocks: tuple[int, ...] = field(default_factory=tuple)


def messages(turn: Turn) -> list[dict[str, Any]]:
    """The turn's chat as the router reads it (``pad``: one character per token)."""
    return [{"role": role, "content": pad(size, version)}
            for role, size, version in turn.conv.chat(turn.index)]


def prompt_block_hashes(conv: Conversation, index: int, first: bytes, tokens: int,
                        block_size: int) -> list[bytes]:
    """One hash per full block of the prompt: the trace's ids where it has them."""
    full = tokens // block_size
    if conv.hash_ids is None:
        return prompt_hashes(first, full)
    ids = conv.hash_ids[index][:full]
    hashes = trace_hashes(conv.scope, ids)
    if len(hashes) < full:
        hashes += unique_hashes(f"{conv.cid}/{index}/prompt", len(hashes), full)
    return hashes

def retained_block_hashes(turn: Turn, tokens: int, block_size: int) -> list[bytes]:
    """One hash per full block of the prompt and the reply the decode holds. A replayed
    reply's blocks are the next prompt's where that prompt extends this one (the client
    sent the reply back), else blocks no prompt has."""
    conv, full = turn.conv, tokens // block_size
    if conv.hash_ids is None:
        return prompt_hashes(turn.first, full)
    hashes = turn.hashes[:full]
    nxt = turn.index + 1
    if nxt < conv.turns and conv.versions is not None \
            and conv.versions[nxt] == conv.versions[turn.index]:
        hashes += trace_hashes(conv.scope, conv.hash_ids[nxt][len(hashes):full])
    if len(hashes) < full:
        hashes += unique_hashes(f"{conv.cid}/{turn.index}/reply", len(hashes), full)
    return hashes


def system_blocks(conv: Conversation, block_size: int) -> int:
    """Full blocks of the shared system prompt (0 when the conversation has its own)."""
    if not conv.shared_system:
        return 0
    return (conv.system_tokens + FRAMING_TOKENS) // block_size


def retained_record(turn: Turn, decode: str, retention: Retention, tokens: int, block_size: int,
                    old: Placement | None) -> Placement:
    """What the router records of a turn its decode retained (``router/_capture.py``): the
    retention's lease and readable tokens, the prefill that served it (a turn the decode
    continued keeps the previous prefill's: ``recorded_prefill``) and its messages."""
    prefill, prefill_tokens = recorded_prefill(old, *_served_by(turn))
    return Placement(
        decode=decode, engine_id=None, num_tokens=tokens,
        expires_at=retention.expires_at, turn=retention.request_id,
        read_id=retention.request_id,
        readable_tokens=tokens // block_size * block_size, block_size=block_size,
        prefill=prefill, prefill_tokens=prefill_tokens,
        history=None if turn.transcript is None else turn.transcript.history())


def stock_record(turn: Turn, decode: str, old: Placement | None, *, expires_at: float,
                 turn_id: str) -> Placement:
    """What the router records of a turn nothing retained (``router/_capture.py``,
    ``remember_affinity`` and ``_record_unretained``): the decode and prefill that served
    it, the tokens its usage counted (prompt and reply: ``served_tokens``) and its
    messages."""
    served, tokens = _served_by(turn)
    prefill, prefill_tokens = recorded_prefill(old, served, tokens)
    usage = DecodeUsage(turn.prompt, turn.conv.replies[turn.index])
    return Placement(
        decode=decode, engine_id=None, num_tokens=served_tokens(usage, tokens),
        expires_at=expires_at, turn=turn_id, prefill=prefill, prefill_tokens=prefill_tokens,
        history=None if turn.transcript is None else turn.transcript.history(),
        retained=False)


def _served_by(turn: Turn) -> tuple[str | None, int]:
    """The prefill that computed the turn's prompt and its prompt tokens (None, 0: none)."""
    if turn.prefill is None:
        return None, 0
    return turn.prefill.url, turn.prompt
