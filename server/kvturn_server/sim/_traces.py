"""Trace files as simulated conversations (``kvturn simulate --trace``), at full scale.

Agent traces (:func:`kvturn_server.traces.read_traces`: the shared Claude Code JSON, kvturn's
request JSONL, or a directory of them) become one :class:`Conversation` per session and per
subagent (a conversation of its own), nothing scaled: every prompt's size and blocks as
recorded (the trace's hash ids, so that shared prefixes, compaction and edits are exactly the
trace's), every reply's size, and every gap before a request (the tool or the user), replayed
after the previous reply as the client waited then. The simulator's own formats (kvturn's
conversation JSONL, vLLM ``multi_turn`` / ShareGPT JSON) are read by
:func:`~kvturn_server.sim._workload.load_trace`; :func:`load_conversations` tells them apart by
content.

A handful of sessions is a light load for a fleet; :func:`replicate` replays ``K`` copies of
them, copy ``k`` starting ``k x shift_s`` later, each its own users (its own cids and hash
scope: no copy shares a block with another).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvturn_server.bench.agent import GapDistribution
from kvturn_server.sim._workload import Conversation, load_trace
from kvturn_server.traces import TraceConversation, TraceRequest, read_traces


def _history(previous: TraceRequest, request: TraceRequest) -> int:
    """Tokens of ``request``'s prompt that the previous prompt and reply held: all of them for a
    plain follow-up (the previous prompt where the client dropped part of the reply), else the
    prefix the hash ids share."""
    if request.extends:
        new = request.new_tokens or 0
        return previous.prompt_tokens + (previous.reply_tokens if new >= 0 else 0)
    return request.shared_tokens


def _conversation(trace: TraceConversation, cid: str, offset_s: float, scope: int
                  ) -> Conversation:
    requests = trace.requests
    versions: list[int] = []
    added: list[int] = []
    history: list[int] = [0]
    version = 0
    for previous, request in zip((None, *requests), requests, strict=False):
        if previous is None:
            added.append(request.prompt_tokens)
        elif request.extends:
            added.append(request.new_tokens or 0)
            history.append(_history(previous, request))
        else:
            version += 1
            added.append(request.prompt_tokens - request.shared_tokens)
            history.append(_history(previous, request))
        versions.append(version)
    return Conversation(
        cid=cid, start_s=trace.start_s + offset_s, system_tokens=0, messages=tuple(added),
        replies=tuple(r.reply_tokens for r in requests),
        gaps_s=tuple(r.gap_s for r in requests[1:]),
        prompts=tuple(r.prompt_tokens for r in requests),
        hash_ids=tuple(r.hash_ids for r in requests), history=tuple(history),
        versions=tuple(versions), scope=scope)


def from_traces(traces: Sequence[TraceConversation], *, block_size: int) -> list[Conversation]:
    """The traces' conversations, sorted by start. ``block_size`` is the simulated fleet's: it
    must be the traces' (their hash ids name blocks of that size)."""
    sizes = {r.block_size for t in traces for r in t.requests}
    if sizes - {block_size}:
        raise ValueError(f"the traces' blocks are {sorted(sizes)} tokens, the fleet's "
                         f"{block_size}: run with --block-size {min(sizes)}")
    scopes: dict[str, int] = {}
    out = [_conversation(trace, trace.cid, 0.0, scopes.setdefault(trace.scope, len(scopes) + 1))
           for trace in traces]
    out.sort(key=lambda c: c.start_s)
    return out


def replicate(conversations: Sequence[Conversation], copies: int, shift_s: float
              ) -> list[Conversation]:
    """``copies`` copies of ``conversations``, copy ``k`` shifted by ``k x shift_s``, each with
    its own cids (``cid#k``) and hash scopes; sorted by start. One copy is the input."""
    if copies < 1 or not shift_s >= 0:
        raise ValueError(f"need copies >= 1 and a shift >= 0, got {copies} and {shift_s}")
    if copies == 1:
        return sorted(conversations, key=lambda c: c.start_s)
    stride = max((c.scope for c in conversations), default=0) + 1
    out = [replace(c, cid=f"{c.cid}#{k}", start_s=c.start_s + k * shift_s,
                   scope=c.scope + k * stride)
           for k in range(copies) for c in conversations]
    out.sort(key=lambda c: c.start_s)
    return out


def is_agent_trace(path: Path) -> bool:
    """A directory, the shared agent-trace JSON (one session object with ``requests``), or
    kvturn's request JSONL (lines naming a ``conversation``); else one of the simulator's own
    formats."""
    if path.is_dir():
        return True
    with path.open(encoding="utf-8") as f:
        if path.suffix == ".jsonl":
            for line in f:
                if line.strip() and not line.lstrip().startswith("#"):
                    return '"turns"' not in line and '"conversation"' in line
            return False
        head = f.read(4096).lstrip()
    if not head.startswith("{"):
        return False
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("requests"), list)


def load_conversations(paths: Sequence[Path], *, block_size: int, window_s: float = 3600.0,
                       gaps: GapDistribution | None = None, seed: int = 0
                       ) -> list[Conversation]:
    """Every conversation of ``paths`` (files or directories, any supported format), sorted by
    start."""
    agent = [p for p in paths if is_agent_trace(p)]
    out = from_traces(read_traces(agent), block_size=block_size) if agent else []
    for path in paths:
        if path not in agent:
            out.extend(load_trace(path, window_s=window_s, gaps=gaps, seed=seed))
    if not out:
        raise ValueError("no conversation in " + ", ".join(str(p) for p in paths))
    out.sort(key=lambda c: c.start_s)
    return out
