"""Wire names and defaults of the router API (docs/http-api.md, section A)."""

from __future__ import annotations

# Request: the conversation id travels in the body of a JSON request (the router's first
# source), else in the header (GETs carry no body); see ConversationState.prepare.
BODY_CONVERSATION_ID = "conversation_id"
HEADER_CONVERSATION_ID = "X-Conversation-ID"
HEADER_NO_REUSE = "X-KVTurn-No-Reuse"

# Response: the router's report of what this turn reused.
HEADER_REUSE = "X-KVTurn-Reuse"
HEADER_REUSED_TOKENS = "X-KVTurn-Reused-Tokens"
# With X-KVTurn-Reuse: pending (a stream the decode continued alone): the block size that tells
# hit from partial once the stream's usage says how many prompt tokens the decode had cached.
HEADER_BLOCK_SIZE = "X-KVTurn-Block-Size"
HEADER_CONVERSATION_ECHO = "X-KVTurn-Conversation"
HEADER_REQUEST_ID = "x-request-id"

# openai's own header for the attempt number; kvturn owns retries, so it sets it itself.
HEADER_RETRY_COUNT = "x-stainless-retry-count"

CONVERSATIONS_PATH = "kvturn/v1/conversations/"

# The two endpoints that carry a conversation's turns.
CHAT_PATH = "/chat/completions"
COMPLETIONS_PATH = "/completions"
RESPONSES_PATH = "/responses"

# Every value the router documents for X-KVTurn-Reuse; the SDK passes unknown values through.
REUSE_OUTCOMES = ("hit", "partial", "miss", "expired", "stale", "below-threshold",
                  "unverified", "disabled", "pending")
# Not known when the headers were sent: a stream the decode continued alone. The SDK settles it
# from the stream's usage event (prompt_tokens_details.cached_tokens) when the caller asked for
# one (stream_options.include_usage).
PENDING = "pending"
REUSED_OUTCOMES = frozenset({"hit", "partial"})
# Key used in the statistics for a response without X-KVTurn-Reuse (e.g. a plain vLLM server).
UNREPORTED = "unreported"

# The `code` of a keepalive's 404: the router knows no retention, or the decode's reason it has
# none (its Gone codes), or `stale` (the holding decode restarted or left the configuration).
NO_RETENTION_CODE = "no_retention"
GONE_CODES = (NO_RETENTION_CODE, "expired", "released", "evicted", "replaced", "stale")

ID_MAX_LENGTH = 256
GENERATED_ID_PREFIX = "kvt-"

# The default lease: the server's RETENTION_TTL (kvturn_server._defaults: the connector's
# decoder_kv_blocks_ttl, the router's retention_ttl), copied because the SDK imports nothing of
# the server; tests/sdk/test_wire_vocabulary.py holds the two equal.
DEFAULT_RETENTION_TTL = 480.0
DEFAULT_LEASE_TTL = DEFAULT_RETENTION_TTL  # its former name
# Renewing every 60 s leaves several chances to get through a slow router before the lease
# runs out.
DEFAULT_KEEPALIVE_INTERVAL = DEFAULT_RETENTION_TTL / 8
# Keepalive and release are best effort (a missed one only lets a lease expire), so they get a
# short timeout and no retries of their own: the next heartbeat is the retry.
CONTROL_TIMEOUT = 10.0
