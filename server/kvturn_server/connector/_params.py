"""kvturn's part of vLLM's ``kv_transfer_params``: what a decode publishes, what a prefill reads.

A decode answers a retained turn (and the control endpoint answers describe, pin and
keepalive) with the params a prefill leg needs to read the retention: vLLM's NIXL fields built
from the decode's :class:`ReadCoordinates`, plus the ``kvturn`` field with the blocks' content
hashes (:func:`read_params`). The prefill parses that field back before it reads anything
(:func:`parse_retained`). Both directions live here so that the format has one home.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvturn_server.connector._lease import Retention

KVTURN_FIELD = "kvturn"
FORMAT = 1
HOST_ENGINE_SUFFIX = "-host"
"""A decode's host tier answers NIXL handshakes as engine ``<engine id>-host``
(``kvturn_server.offload._reads``)."""
READ_PREFIX = "kvturn-read/"
"""``remote_request_id`` of a retention: the prefill's read-done notification carries it back,
and the decode's worker recognises (and drops) it instead of freeing a vLLM request."""


@dataclass(frozen=True)
class ReadCoordinates:
    """Where and how a prefill reads this decode's retained blocks; fixed once the engine runs.

    Attributes:
        engine_id: this decode's engine id (vLLM's NIXL handshake checks it).
        block_size: tokens per KV block, and per hashed block.
        host: the NIXL side channel's host (``VLLM_NIXL_SIDE_CHANNEL_HOST``).
        port: its port (with data parallelism, this rank's).
        tp_size: the tensor-parallel size transfers are laid out for.
        dcp_size: the decode context-parallel size.
        pp_size: the pipeline-parallel size.
        transfer_mode: vLLM's NIXL transfer mode (``pull``).
        control_url: this decode's control endpoint (pin, keepalive, release), if it serves one.
    """

    engine_id: str
    block_size: int
    host: str
    port: int
    tp_size: int
    dcp_size: int
    pp_size: int
    transfer_mode: str
    control_url: str | None


@dataclass(frozen=True)
class HostRead:
    """Where a prefill reads a retention from the decode's host tier: the host tier's NIXL
    side channel (``host``, ``port``) and the host rows holding the retention's blocks from its
    first, in order (they stand in for device block ids)."""

    host: str
    port: int
    rows: tuple[int, ...]


def read_params(at: ReadCoordinates, retention: Retention, deadline: float,
                host: HostRead | None = None) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill leg needs to read ``retention`` from ``at``, or,
    with ``host``, from the decode's host tier (as many of its hashed blocks as rows).

    ``deadline`` is on the decode's ``perf_counter``: the prefill rebases it with the NIXL
    handshake's clock offset and declines a read that would end too close to it.
    """
    blocks = retention.readable_block_ids if host is None \
        else host.rows[:len(retention.block_hashes)]
    return {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        # The readable (full, hashed) blocks, one KV-cache group.
        "remote_block_ids": [list(blocks)],
        "remote_engine_id": at.engine_id if host is None else at.engine_id + HOST_ENGINE_SUFFIX,
        "remote_request_id": READ_PREFIX + retention.request_id,
        "remote_host": at.host if host is None else host.host,
        "remote_port": at.port if host is None else host.port,
        "tp_size": at.tp_size,
        "dcp_size": at.dcp_size,
        "pp_size": at.pp_size,
        "remote_num_tokens": retention.num_tokens,
        "remote_blocks_expiry_time": deadline,
        "transfer_mode": at.transfer_mode,
        KVTURN_FIELD: {
            # format: bumps when the fields below change meaning
            "format": FORMAT,
            # block_size: tokens per hashed block; the prefill must use the same
            "block_size": at.block_size,
            # block_hashes: hex chained hashes of each readable block, in order
            "block_hashes": [h.hex() for h in retention.block_hashes[:len(blocks)]],
            # conversation: the (tenant-scoped) key this retention is kept under
            "conversation": retention.key,
            # control: this decode's control endpoint (pin, keepalive, release)
            "control": at.control_url,
        },
    }


def parse_retained(info: dict[str, Any], block_size: int,
                   params: dict[str, Any]) -> tuple[list[int], list[bytes]] | None:
    """The decode's original block ids and hashes, or None if the field is missing or not in
    the shape a kvturn decode writes (single KV-cache group, hex hashes).

    The router is the only writer of these params, but they cross the network: anything that is
    not what a kvturn decode produces disables the read instead of steering it.
    ``decide_reuse`` checks the rest (lengths, duplicates, hash sizes).
    """
    if info.get("format") != FORMAT:
        return None
    if info.get("block_size") != block_size:
        return None
    original = info.setdefault("retained_block_ids", params.get("remote_block_ids"))
    if (not isinstance(original, list) or len(original) != 1
            or not isinstance(original[0], list)):
        return None
    raw = info.get("block_hashes")
    if not isinstance(raw, list):
        return None
    try:
        hashes = [bytes.fromhex(h) for h in raw]
    except (TypeError, ValueError):
        return None
    return list(original[0]), hashes


def conversation_key(params: dict[str, Any]) -> str | None:
    """The conversation a request's params name (``kvturn.conversation``), if any."""
    info = params.get(KVTURN_FIELD)
    key = info.get("conversation") if isinstance(info, dict) else None
    return key if isinstance(key, str) and key else None


def not_retained(out: dict[str, Any] | None, key: str, engine_id: str) -> dict[str, Any]:
    """vLLM's ``out`` plus the answer for a conversation turn this instance did not retain.

    Every answer names this engine: the router ties the control endpoint (which names it too)
    to the engine behind this HTTP endpoint, and distrusts it when they differ.
    """
    result = dict(out or {})
    result[KVTURN_FIELD] = {"conversation": key, "retained": False, "engine_id": engine_id}
    return result
