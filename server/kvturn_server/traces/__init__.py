"""Agent traces: recorded agent sessions read into typed, frozen conversations, for replay
(``kvturn bench trace``) and simulation (``kvturn simulate --trace``).

A leaf package: it imports nothing else of ``kvturn_server``.

API (stable; everything else is private):

- ``read_traces(paths) -> tuple[TraceConversation, ...]``: every conversation in the given files
  and directories (a directory: its ``.json`` and ``.jsonl`` files, sorted by name), in file
  order, a session before its subagents. Raises ``TraceFormatError`` (a ``ValueError``) naming
  the file, the request and what is wrong.
- ``TraceConversation``: ``cid`` (unique over what was read together), ``source`` (the file),
  ``scope`` (conversations of one scope may share hash ids: a file), ``parent`` (a subagent's
  session, else None), ``agent_type``, ``system_tokens``, ``tool_tokens`` (where recorded),
  ``requests``, ``start_s``, ``is_subagent``.
- ``TraceRequest``: ``index``, ``arrival_s`` (seconds since the trace's start; a subagent's
  requests on its parent's clock: the parent's time of the subagent plus its own), ``gap_s``
  (the client's time before the request: tool or user; 0 for the first), ``prompt_tokens``,
  ``reply_tokens``, ``hash_ids`` (one per full block), ``block_size``, ``shared_blocks`` /
  ``shared_tokens`` (the prefix shared with the previous request of the same conversation),
  ``extends`` (it starts with every full block of the previous prompt: a plain follow-up),
  ``shrank`` (shorter than the previous prompt: compaction), ``new_tokens`` (beyond the
  previous prompt and its reply; None for the first), ``kind``, ``api_time_s``.
- ``summarize(conversations) -> TraceSummary``: the samples (prompts, replies, new tokens per
  follow-up, gaps) and counts (requests, follow-ups, shrinks, divergences), the shares of
  follow-ups adding at most N tokens, the gaps longer than S seconds, and ``describe(quantile)``,
  the dict a report prints (quantiles taken with the caller's one definition,
  ``kvturn_server.bench.quantile``).

Subagents are conversations of their own (``<session>/<agent id>``), their first request at
their parent's time. A follow-up that does not extend the previous prompt (``extends`` False)
had its history compacted or edited before its end: a replay sends the part the hash ids
share and new text after it.

Formats:

**The shared agent-trace JSON** (``.json``; the Claude Code traces in the project's shared
``traces/`` folder, from ``callanjfox/kv-cache-tester``): one session object per file with
``block_size`` (tokens per hash id), ``system_tokens``, ``tool_tokens`` and ``requests[]``, each
with ``t`` (seconds since the session's first call), ``type`` (``subagent``: a nested session
with its own ``requests[]``, ``agent_id`` and ``subagent_type``, its ``t`` on the parent's
clock and its requests' ``t`` on its own; any other type: a call of the session), ``in``,
``out``, ``hash_ids``, ``think_time`` and ``api_time``. Hash ids are comparable within a file.

**kvturn's request JSONL** (``.jsonl``; bring your own traces): one request per line, lines
blank or starting with ``#`` skipped, a conversation's requests in order::

    {"conversation": "s1", "t": 0.0, "prompt_tokens": 18000, "reply_tokens": 250}
    {"conversation": "s1", "t": 21.5, "prompt_tokens": 18600, "reply_tokens": 120, "gap_s": 12}
    {"conversation": "s1/a", "parent": "s1", "t": 30.0, "prompt_tokens": 9000, "reply_tokens": 90}
    {"conversation": "s1", "t": 900.0, "prompt_tokens": 4000, "reply_tokens": 300,
     "shared_tokens": 2048}

(one line each). Required: ``conversation`` (a string), ``t`` (seconds since the trace's start,
never decreasing within a conversation), ``prompt_tokens`` (>= 1), ``reply_tokens`` (>= 0).
Optional: ``gap_s`` (the client's time before the request; default ``t`` minus the previous
request's ``t``), ``parent`` (the conversation that started this one), ``block_size`` (default
64, one per file) and either ``hash_ids`` (one id per full block; comparable across the file's
conversations, so a shared system prompt can be stated) or ``shared_tokens`` (tokens shared from
the start with the previous request of the conversation, counted in whole blocks; default:
every full block of the previous prompt, a plain follow-up). A conversation's cid is the file's
stem, ``/``, its ``conversation``.
"""

from kvturn_server.traces._model import TraceConversation, TraceFormatError, TraceRequest
from kvturn_server.traces._read import read_traces
from kvturn_server.traces._summary import TraceSummary, summarize

__all__ = ["TraceConversation", "TraceFormatError", "TraceRequest", "TraceSummary",
           "read_traces", "summarize"]
