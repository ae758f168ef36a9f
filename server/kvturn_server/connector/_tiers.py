"""Where kvturn's leases meet the decode's host tier, inside vLLM's engine process.

On a decode with a host tier, vLLM's ``MultiConnector`` builds two scheduler-side connectors
in the EngineCore process, each unaware of the other: kvturn's (the lease table, in
:class:`~kvturn_server.connector._keeper.RetentionKeeper`) and the host tier's (vLLM's CPU
offloading manager with kvturn's eviction order, ``kvturn_server.offload``). Both register
here under the engine id they share (vLLM gives every child of a ``MultiConnector`` the outer
config's engine id) and find the other when they need it, so neither depends on the order in
which vLLM builds them:

- the host tier asks the leases how each conversation stands (:meth:`Leases.standings`) to
  decide what it evicts, and
- the keeper asks the host tier what it holds of a conversation (:meth:`HostTier.
  resident_tokens`), tells it which conversations' leases ended (:meth:`HostTier.discard`),
  and reads what a decode leg loaded from it (:meth:`HostTier.take_loaded`).

No vLLM import: the protocols are what each side may call, and on which thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

from kvturn_server.connector._params import HostRead


class Standing(IntEnum):
    """How a conversation with a live lease stands; a higher value is evicted later.

    A conversation with no live lease (released, expired, never retained) is absent from
    :meth:`Leases.standings`: the host tier evicts its blocks before any leased one's.
    """

    LEASED = 1
    PINNED = 2
    """A read of its device blocks is in flight: its host blocks are never evicted either."""


@dataclass(frozen=True, slots=True)
class LeaseView:
    """One live lease as the host tier orders it: its standing and its last use (the keeper's
    clock; only compared with other leases' ``last_used``)."""

    standing: Standing
    last_used: float


class Leases(Protocol):
    """kvturn's lease table, as the host tier sees it."""

    def standings(self) -> Mapping[str, LeaseView]:
        """Every conversation with a live lease (any thread; a snapshot)."""
        ...

    def lost_in_host(self, conversations: Iterable[str]) -> None:
        """The host tier evicted the first block of these conversations: a lease held there
        alone promises nothing now (engine thread, from inside a store: must not call back)."""
        ...


@dataclass(frozen=True, slots=True)
class HostLoad:
    """What one request loaded from the host tier: ``tokens`` of its prompt, or nothing when
    the copy failed (``failed``: vLLM recomputed them)."""

    tokens: int
    failed: bool = False


@dataclass
class HostCounters:
    """What the host tier did since the last :meth:`HostTier.take_counters` (for metrics).

    ``evicted`` counts blocks evicted to make room, by the standing of their conversation
    (``none``: no conversation; ``gone``: no live lease; ``leased``); ``discarded`` blocks freed
    because their conversation's lease ended or their copy failed; ``load_failures`` loads
    whose copy failed (recomputed).
    """

    evicted: dict[str, int] = field(default_factory=dict)
    discarded: int = 0
    load_failures: int = 0

    def is_empty(self) -> bool:
        return not self.evicted and not self.discarded and not self.load_failures


class HostTier(Protocol):
    """The decode's host tier, as kvturn's keeper and decode side use it."""

    tokens_per_block: int
    """Tokens of one host block (a chunk of the offloading connector)."""

    def resident_tokens(self, conversation: str) -> int:
        """Tokens of the conversation's latest turn, from its first, that the host tier holds
        without a gap (any thread)."""
        ...

    def discard(self, conversations: Iterable[str]) -> int:
        """Free the host blocks of conversations whose lease ended, unless another live lease
        shares them; the number of blocks freed (engine thread)."""
        ...

    def take_loaded(self, request_id: str) -> HostLoad | None:
        """What the request loaded from the host tier, once (engine thread)."""
        ...

    def take_counters(self) -> HostCounters:
        """Counters since the last call (engine thread)."""
        ...

    def usage(self) -> dict[str, Any]:
        """Size and use, for the control endpoint's stats (any thread)."""
        ...

    def host_read(self, conversation: str, request_id: str) -> HostRead | None:
        """Where a prefill reads the resident blocks of the conversation's turn
        ``request_id`` over NIXL, or None when it cannot: none of them resident (or the
        host tier lists another turn's), or it serves no reads (any thread)."""
        ...


@dataclass
class TierLink:
    """The two halves of one engine: either may be None until its connector is built."""

    leases: Leases | None = None
    host: HostTier | None = None


_links: dict[str, TierLink] = {}
_links_lock = threading.Lock()


def tier_link(engine_id: str) -> TierLink:
    """The link of engine ``engine_id`` in this process (made on first use)."""
    with _links_lock:
        link = _links.get(engine_id)
        if link is None:
            link = _links[engine_id] = TierLink()
        return link
