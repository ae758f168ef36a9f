"""Defaults that several parts of kvturn state: each written once, here, and referenced.

The retention lease is one setting seen from several places: the connector's
``decoder_kv_blocks_ttl`` (vLLM's key, which holds a decode's finished KV for a fixed 480 s by
default; kvturn keeps vLLM's number and makes it a renewable lease), the router's
``retention_ttl``, ``kvturn up --retention-ttl``, ``kvturn simulate --retention-ttl`` and the
benchmarks' deployed lease. The SDK imports nothing of the server and keeps its own copy
(``kvturn._constants.DEFAULT_RETENTION_TTL``), held to this one by
``tests/sdk/test_wire_vocabulary.py``.

No imports: the connector (in vLLM's engine process), the router and the tools all read it.
"""

from __future__ import annotations

VLLM_DECODER_KV_BLOCKS_TTL = 480.0
"""vLLM's own default for ``decoder_kv_blocks_ttl`` (its NIXL connector's base scheduler): a
decode holds a finished request's blocks this long, not renewable."""

VLLM_CPU_BLOCK_SIZE = 128
"""vLLM's KV block size in tokens on CPU platforms when none is given (vllm/platforms/cpu.py);
the benchmarks size the CPU build's KV with it and read each instance's real one back from
``vllm:cache_config_info``."""

RETENTION_TTL = VLLM_DECODER_KV_BLOCKS_TTL
"""Seconds a decode keeps a finished turn's KV unless the lease is renewed (vLLM's number)."""

RETENTION_MAX_HOLD = 3600.0
"""Seconds past a retention's creation that no keepalive extends it."""

RETENTION_BUDGET = 1.0
"""Fraction of a decode's KV blocks retentions may hold (live requests evict them whatever the
budget; docs/simulate.md, "Choosing the defaults", measured 1.0 against 0.5)."""

KEEPALIVES_PER_TTL = 8
"""The SDK renews a paused conversation's lease this many times per lease (60 s of 480 s)."""
