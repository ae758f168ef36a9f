"""The words a replay sends: from the trace's hash ids, so that equal ids give equal text.

Word ``j`` of a prompt (its position at scale) stands for the trace's token ``j x divisor``;
that token's block has a hash id, and the word is a function of the run's salt, that id and
``j``. Two prompts whose ids agree up to a block therefore agree word for word up to it (at the
same positions), and prompts whose ids differ share nothing. Tokens past the last full block
(a prompt's partial tail, which the trace gives no id) get words of their own request. The salt
holds the seed, the mode, the repeat and the file (hash ids are comparable within a file only),
so no KV cached in one run can serve another.

Each word of the local tokenizer's vocabulary (``kvturn_server.local.WORDS``) is one
token with its leading space, so a message of N words is N tokens.
"""

from __future__ import annotations

import hashlib

from kvturn_server.bench._fleet_plan import AgentPlan
from kvturn_server.bench.agent._workload import AgentScript, Message
from kvturn_server.bench.trace._scale import ReplayConversation, ReplayPlan
from kvturn_server.local import WORDS
from kvturn_server.traces import TraceRequest


def _word(salt: str, key: str, position: int) -> str:
    digest = hashlib.blake2b(f"{salt}|{key}|{position}".encode(), digest_size=8).digest()
    return WORDS[int.from_bytes(digest, "big") % len(WORDS)]


def words(salt: str, request: TraceRequest, cid: str, start: int, count: int,
          divisor: float) -> str:
    """``count`` words from position ``start`` (at scale) of ``request``'s prompt."""
    out = []
    for j in range(start, start + count):
        block = int(j * divisor) // request.block_size
        key = (f"h{request.hash_ids[block]}" if block < len(request.hash_ids)
               else f"t{cid}/{request.index}")
        out.append(_word(salt, key, j))
    return " ".join(out)


def script(conversation: ReplayConversation, agent: int, mode: str, repeat: int, seed: int,
           divisor: float) -> AgentPlan:
    """What ``conversation`` sends as agent ``agent`` in ``mode`` of ``repeat``."""
    trace = conversation.trace
    salt = f"kvturn-bench-trace/{seed}/{mode}/{repeat}/{trace.scope}"
    first = conversation.requests[0].trace
    messages: list[Message] = [
        {"role": "user", "content": words(salt, r.trace, trace.cid, r.new_start, r.new_words,
                                          divisor)}
        for r in conversation.requests]
    requests = conversation.requests
    return AgentPlan(
        AgentScript(agent=agent, mode=mode, start_s=conversation.start_s,
                    system=words(salt, first, trace.cid, 0, conversation.system_words, divisor),
                    messages=tuple(messages), gaps_s=tuple(r.gap_s for r in requests[1:]),
                    system_words=conversation.system_words,
                    message_words=tuple(r.new_words for r in requests),
                    reply_tokens=tuple(r.reply_tokens for r in requests), repeat=repeat,
                    cuts=tuple(r.cut for r in requests)),
        tuple(r.reply_tokens for r in requests))


def scripts(plan: ReplayPlan, mode: str, repeat: int, seed: int) -> list[AgentPlan]:
    """Every conversation of ``plan`` as ``mode`` sends it in ``repeat`` (agent = its index)."""
    return [script(c, agent, mode, repeat, seed, plan.scaling.token_divisor)
            for agent, c in enumerate(plan.conversations)]

