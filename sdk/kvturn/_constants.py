"""The SDK's own names and defaults; the words it shares with the router are in ``kvturn.wire``."""

from __future__ import annotations

# The endpoints that carry a conversation's turns, relative to the OpenAI base URL.
CHAT_PATH = "/chat/completions"
COMPLETIONS_PATH = "/completions"
RESPONSES_PATH = "/responses"

# Key used in the statistics for a response without X-KVTurn-Reuse (e.g. a plain vLLM server).
UNREPORTED = "unreported"

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
