"""The router's conversation records in the simulation: what its store keeps of each
conversation, as the router keeps it.

A record is forgotten ``remember_expired`` after its lease (or stock record) ran out, as the
store forgets it; a retention its decode evicted or let expire is marked lost, as the router
following the decode's lost log marks it (``router/_lost.py``: within milliseconds, so at once
here; by the router's own rule, ``marked_lost``: a simulated retention's read id is its request
id); a keepalive renews the lease, or finds the retention gone and keeps or forgets the record
by the router's own rule (``lost_record``).
"""

from __future__ import annotations

from dataclasses import replace

from kvturn.wire import GoneReason
from kvturn_server.router import Placement, lost_record, marked_lost
from kvturn_server.sim._config import RouterSpec
from kvturn_server.sim._instances import SimDecode


class Records:
    """The records by conversation id, over the simulated decodes' retention tables."""

    def __init__(self, router: RouterSpec, decodes: dict[str, SimDecode]) -> None:
        self.router = router
        self._decodes = decodes
        self.placements: dict[str, Placement] = {}
        # Each decode's lost log as the router has read it (``_lost_log``).
        self._lost: dict[str, dict[str, tuple[str, GoneReason]]] = {}

    def find(self, key: str, now: float) -> Placement | None:
        """The router's record of the conversation when a turn arrives at ``now``."""
        placement = self.placements.get(key)
        if placement is not None and now >= placement.expires_at + self.router.remember_expired_s:
            del self.placements[key]
            return None
        if placement is not None and placement.retained and self.router.follow_evictions:
            # With a host tier an evicted retention lives on there, host-only: the decode logs
            # it lost only once the host tier drops it too (``SimDecode.host_lost``).
            lost = self._lost_log(placement.decode).get(key)
            marked = None if lost is None else marked_lost(
                placement, decode=placement.decode, read_id=lost[0], reason=lost[1])
            if marked is not None:
                placement = self.placements[key] = marked
        return placement

    def keepalive(self, key: str) -> None:
        """A client's keepalive during a tool gap (``router/_conversations.py``)."""
        placement = self.placements.get(key)
        if placement is None or not placement.retained:
            return  # the router answers at once: nothing to renew
        table = self._decodes[placement.decode].table
        retention = table.keepalive(key)
        if retention is not None:
            self.placements[key] = replace(placement, expires_at=retention.expires_at)
            return
        kept = lost_record(placement, table.gone_reason(key))
        if kept is not None:
            self.placements[key] = kept
        else:
            del self.placements[key]

    def _lost_log(self, decode: str) -> dict[str, tuple[str, GoneReason]]:
        """What the decode's lost log said so far (connector ``take_lost``): key -> (the
        retention's read id, why), the latest per key."""
        log = self._lost.setdefault(decode, {})
        for retention, reason in self._decodes[decode].table.take_lost():
            log[retention.key] = (retention.request_id, reason)
        return log
