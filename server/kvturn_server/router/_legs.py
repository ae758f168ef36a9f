"""Request bodies of the two legs of a disaggregated turn (pure functions, no I/O)."""

from __future__ import annotations

from typing import Any

# Fields only the router may set: a client must not steer the KV connectors.
ROUTER_ONLY_FIELDS = ("kv_transfer_params", "kvturn")


def client_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request with the router-only fields removed."""
    return {k: v for k, v in body.items() if k not in ROUTER_ONLY_FIELDS}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: compute the prompt's KV and stop after one token, non-streaming.

    ``do_remote_decode`` tells the prefill's connector to keep the blocks for the decode to read
    and to answer with their coordinates in ``kv_transfer_params``.
    """
    leg = dict(body)
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    # One completion is enough to produce the prompt's KV.
    leg["n"] = 1
    leg["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return leg


def decode_body(body: dict[str, Any], transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg: the client's request plus the prefill's transfer params, if any.

    Without params (the prefill failed or timed out) the decode computes the prompt itself:
    slower, same output.
    """
    leg = dict(body)
    if transfer_params:
        leg["kv_transfer_params"] = transfer_params
    return leg
