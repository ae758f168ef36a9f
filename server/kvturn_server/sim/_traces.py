"""Recorded agent traces as simulated conversations, at full scale.

:func:`kvturn_server.traces.read_traces` reads the files (the shared Claude Code JSON, kvturn's
request JSONL); this turns each of its conversations (a session, or a subagent: a conversation
of its own) into a :class:`Conversation` with nothing scaled: every prompt's size and blocks as
recorded (the trace's hash ids, so that shared prefixes, compaction and edits are exactly the
trace's), every reply's size, and every gap before a request (the tool or the user), replayed
after the previous reply as the client waited then.

A handful of sessions is a light load for a fleet; ``copies`` replays ``K`` copies of them, copy
``k`` starting ``k x shift_s`` later, each its own users (its own cids and hash scope: no copy
shares a block with another).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvturn_server.sim._workload import Conversation
from kvturn_server.traces import TraceConversation, TraceRequest


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


def from_traces(traces: Sequence[TraceConversation], *, block_size: int, copies: int = 1,
                shift_s: float = 60.0) -> list[Conversation]:
    """The traces' conversations, ``copies`` times (copy ``k`` shifted by ``k x shift_s``),
    sorted by start. ``block_size`` is the simulated fleet's: it must be the traces' (their
    hash ids name blocks of that size)."""
    if copies < 1 or shift_s < 0:
        raise ValueError(f"need copies >= 1 and a shift >= 0, got {copies} and {shift_s}")
    sizes = {r.block_size for t in traces for r in t.requests}
    if sizes - {block_size}:
        raise ValueError(f"the traces' blocks are {sorted(sizes)} tokens, the fleet's "
                         f"{block_size}: run with --block-size {min(sizes)}")
    scopes: dict[tuple[str, int], int] = {}
    out = []
    for k in range(copies):
        for trace in traces:
            scope = scopes.setdefault((trace.scope, k), len(scopes) + 1)
            cid = trace.cid if copies == 1 else f"{trace.cid}#{k}"
            out.append(_conversation(trace, cid, k * shift_s, scope))
    out.sort(key=lambda c: c.start_s)
    return out
