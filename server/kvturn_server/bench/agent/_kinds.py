"""The agent benchmarks' client kinds and the vLLM flag their instances start with.

Apart from the agent loop (``_loop.py``) so that the mode table (``_modes.py``), which names
the kinds, and the workload's settings, which check the mode table, need not import the loop.
"""

from __future__ import annotations

PLAIN, IDS, KVTURN = "plain", "ids", "kvturn"
CLIENT_KINDS = (PLAIN, IDS, KVTURN)
# What the benchmarks start vLLM with so that each streamed reply's usage says how many prompt
# tokens the serving instance's cache supplied (prompt_tokens_details.cached_tokens).
PROMPT_DETAILS_ARGS = ("--enable-prompt-tokens-details",)
