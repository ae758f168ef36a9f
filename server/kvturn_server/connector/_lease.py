"""The values a decode's retention table hands out and keeps: a retention (one conversation's
lease on its KV blocks), a pin on one, the table's counters, and the check of a new
retention's arguments. Why a key has none is ``kvturn.wire.GoneReason``, the control API's word.

Apart from the table (``_retention.py``, every rule about when a retention is kept, pinned or
evicted) because the control API, the connector's scheduler side, the lost log and the
simulator read these values without driving the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvturn.wire import GoneReason
from kvturn_server.connector._hashing import HASH_SIZE


@dataclass(frozen=True, slots=True)
class Retention:
    """One conversation's retained KV on a decode.

    Frozen: the table hands these out, and a caller holding one must not be able to move a lease
    by mutating it. Renewals produce a new object.

    Attributes:
        key: the conversation key (tenant-scoped by the router).
        request_id: the engine-local id of the request whose blocks are kept.
        block_ids: every device block the lease holds, in sequence order. All of them are freed
            together. Empty once the retention is host-only (its device blocks were evicted).
        block_hashes: one chained hash per *full* block, in order, so there may be one fewer
            hash than blocks (a trailing partial block is held but can never be read). They must
            cover only tokens whose KV was computed: vLLM never runs a request's final sampled
            token through the model, so a block ending in it holds no KV for that slot.
        num_tokens: tokens whose KV the blocks hold (prompt plus generated, less that final
            sampled token).
        created_at: clock time the retention was made.
        expires_at: clock time the lease runs out unless renewed; live while ``now < expires_at``.
        hold_until: ``created_at + max_hold``; no keepalive extends the lease past this.
        last_used: clock time of the last read (``touch``) or keepalive; LRU eviction order.
    """

    key: str
    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    created_at: float
    expires_at: float
    hold_until: float
    last_used: float

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def on_device(self) -> bool:
        """Whether the decode still holds its device blocks (else it is host-only)."""
        return bool(self.block_ids)

    @property
    def readable_block_ids(self) -> tuple[int, ...]:
        """The device block ids that have a hash, paired one to one with the first of
        ``block_hashes`` (none once host-only)."""
        return self.block_ids[:len(self.block_hashes)]

    def is_live(self, now: float) -> bool:
        return now < self.expires_at


@dataclass(frozen=True, slots=True)
class Pin:
    """A short hold on one retention's blocks for a read in flight.

    Attributes:
        pin_id: the handle to unpin with.
        key: the conversation key the pin was taken on.
        request_id: identifies the pinned retention (a key's next turn is another retention).
        expires_at: clock time the pin lapses if nobody unpins it.
    """

    pin_id: str
    key: str
    request_id: str
    expires_at: float


@dataclass(slots=True)
class RetentionStats:
    """Counters since the table was built (for the control endpoint and metrics).

    ``replaced``, ``released``, ``expired``, ``evicted`` and ``refused`` count retentions handed
    back for freeing, by cause (with a host tier, ``evicted`` and ``refused`` hand back device
    blocks while the lease goes on host-only); ``created`` counts retentions stored; ``renewed``
    successful keepalives; ``host_evicted`` host-only retentions whose host copy was evicted too;
    ``pinned`` pins given, ``host_pinned`` those of them for a read of the host tier.
    """

    created: int = 0
    renewed: int = 0
    released: int = 0
    expired: int = 0
    evicted: int = 0
    replaced: int = 0
    refused: int = 0
    pinned: int = 0
    pins_expired: int = 0
    host_evicted: int = 0
    host_pinned: int = 0


def check_retain(
    key: str,
    request_id: str,
    block_ids: tuple[int, ...],
    block_hashes: tuple[bytes, ...],
    num_tokens: int,
) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"retention key must be a non-empty str, got {key!r:.60}")
    if not isinstance(request_id, str):
        raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
    if not block_ids:
        raise ValueError(f"retention {key!r:.60} has no blocks to keep")
    for block_id in block_ids:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or block_id < 0:
            raise ValueError(
                f"retention {key!r:.60} block ids must be non-negative ints, got {block_id!r:.60}")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError(f"retention {key!r:.60} lists a block id more than once")
    if len(block_hashes) > len(block_ids):
        raise ValueError(
            f"retention {key!r:.60} has {len(block_hashes)} hashes for {len(block_ids)} blocks")
    for digest in block_hashes:
        if not isinstance(digest, bytes) or len(digest) != HASH_SIZE:
            raise ValueError(
                f"retention {key!r:.60} block hashes must be {HASH_SIZE} bytes, "
                f"got {digest!r:.60}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
        raise ValueError(f"retention {key!r:.60} num_tokens must be a positive int, "
                         f"got {num_tokens!r}")


@dataclass(frozen=True)
class Gone:
    """A control answer for a key with no live retention; ``cached_tokens``: for a describe,
    what its last dropped retention left in the prefix cache (``_freed.py``; None: unknown);
    ``host_tokens``: for a pin, a live retention's tokens the host tier alone holds from its
    start (no device blocks to pin; None: not that case)."""

    key: str
    reason: GoneReason
    cached_tokens: int | None = None
    host_tokens: int | None = None
