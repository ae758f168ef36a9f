"""Decode-side retention leases: which finished conversations keep their KV blocks, and until when.

When a request with a conversation key finishes on a decode, its blocks (prompt and generated)
are kept under that key so the conversation's next prefill can read them back instead of
recomputing. This module owns every rule about those kept blocks; the connector adapter only
calls it and frees whatever it hands back. A reader asking "when is a retention evicted?" finds
the whole answer here:

- **Replaced**: the key's next turn is retained (one retention per conversation).
- **Released**: explicitly, by the client or router.
- **Expired**: its lease ran out (TTL from creation or the last keepalive, never past the
  maximum hold).
- **Evicted**: least recently used first, when the retention budget is exceeded or live requests
  need blocks. Retention is an optimisation; it must never starve live decoding.

**With a host tier** (``host_tier``: the decode copies every computed block to host memory,
``kvturn_server.offload``) eviction takes a retention's *device* blocks only: its lease goes
on, held in host memory alone ("host-only"), so keepalive, release and expiry still apply and a
turn the decode continues loads it back from there. A retention larger than the whole budget
is kept host-only from the start instead of refused. The host tier orders its own evictions by
these leases (:meth:`RetentionTable.standings`) and frees a conversation's host blocks when
its lease ends (:meth:`RetentionTable.take_ended`). A host-only retention whose host copy is
gone too is dropped by :meth:`RetentionTable.drop_lost`.

**Pins** protect reads in flight. A prefill reads a retention's blocks over NIXL without the
decode taking part, so the decode cannot tell when a read starts. The router therefore pins the
retention (a short lease of its own) before it sends the prefill leg, and unpins it after. While
a retention is pinned its blocks are never handed back, whatever happens to the retention:
released, replaced, expired or evicted, it leaves the table at once (nobody can pin it again) but
its blocks stay held ("draining") until the last pin goes, by unpin or by the pin's own expiry.
Eviction prefers unpinned retentions.

The table never frees blocks itself: every method that drops a retention returns it, and the
caller returns its ``block_ids`` to the allocator inside the scheduler step, where vLLM allows it.
The table is not thread-safe; its owner serialises access.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvturn.wire import GoneReason
from kvturn_server._defaults import RETENTION_MAX_HOLD, RETENTION_TTL
from kvturn_server.connector._expiry import ExpiryQueue
from kvturn_server.connector._lease import Pin, Retention, RetentionStats, check_retain
from kvturn_server.connector._tiers import LeaseView, Standing


class RetentionTable:
    """Retentions of one decode, keyed by conversation, bounded by a block budget.

    Costs: ``get``/``touch``/``release`` are O(1); ``retain``, ``keepalive``, ``expire`` and
    ``evict_for`` are O(log n) per retention created, renewed or dropped (an expiry heap with lazy
    deletion sits beside the LRU-ordered dict).

    Budget accounting counts each retention's blocks, so two retentions sharing a prefix-cached
    block count it twice. That over-estimates what is held, which errs on the side of live
    decoding.

    Expired retentions keep their blocks until :meth:`expire` (or an eviction) hands them back:
    the table cannot free anything by itself, so the caller should call ``expire`` once per
    scheduler step. They are invisible to ``get``, ``touch`` and ``keepalive`` meanwhile.
    """

    def __init__(
        self,
        *,
        budget_blocks: int,
        ttl: float = RETENTION_TTL,
        max_hold: float = RETENTION_MAX_HOLD,
        max_pin: float = 300.0,
        remember: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        host_tier: bool = False,
    ) -> None:
        if isinstance(budget_blocks, bool) or not isinstance(budget_blocks, int) \
                or budget_blocks < 0:
            raise ValueError(f"budget_blocks must be a non-negative int, got {budget_blocks!r}")
        for name, value in (("ttl", ttl), ("max_hold", max_hold), ("max_pin", max_pin)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if isinstance(remember, bool) or not isinstance(remember, int) or remember < 0:
            raise ValueError(f"remember must be a non-negative int, got {remember!r}")
        self.budget_blocks = budget_blocks
        self.ttl = float(ttl)
        self.max_hold = float(max_hold)
        self.max_pin = float(max_pin)
        self.remember = remember
        self.host_tier = host_tier
        self.stats = RetentionStats()
        self._clock = clock
        # Insertion order is recency order: first is least recently used.
        self._entries: OrderedDict[str, Retention] = OrderedDict()
        self._retained_blocks = 0
        # Every stored retention's deadline, soonest first: exactly the keys of _entries.
        self._expiry = ExpiryQueue()
        self._pins: dict[str, Pin] = {}
        # (key, request_id) -> live pin count, for retentions in the table and draining ones.
        self._pin_counts: dict[tuple[str, str], int] = {}
        # Retentions dropped from the table while pinned: blocks still held.
        self._draining: dict[tuple[str, str], Retention] = {}
        self._draining_blocks = 0
        self._pin_ids = itertools.count(1)
        # Recently dropped keys and why, so that "no retention" can say "expired" or "evicted".
        self._gone: OrderedDict[str, GoneReason] = OrderedDict()
        # Keys whose lease ended (released, expired, lost) since take_ended: with a host tier
        # their host blocks go too. Not kept without one (nobody would take them).
        self._ended: list[str] = []
        # Retentions the table dropped on its own (evicted, expired) since the last take_lost.
        self._lost: list[tuple[Retention, GoneReason]] = []

    def __len__(self) -> int:
        """Retentions held, including expired ones not yet handed back by :meth:`expire`."""
        return len(self._entries)

    @property
    def retained_blocks(self) -> int:
        """Blocks held by all retentions (expired ones included until handed back)."""
        return self._retained_blocks

    @property
    def held_blocks(self) -> int:
        """Every block the table keeps from the allocator: retained plus draining."""
        return self._retained_blocks + self._draining_blocks

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    @property
    def host_only(self) -> int:
        """Retentions whose device blocks were evicted, held in the host tier alone."""
        return sum(1 for r in self._entries.values() if not r.on_device)

    def retentions(self) -> list[Retention]:
        """The retentions in the table, least recently used first (expired ones included)."""
        return list(self._entries.values())

    def gone_reason(self, key: str) -> GoneReason:
        """Why ``key`` has no live retention (meaningful when :meth:`get` returns None)."""
        retention = self._entries.get(key)
        if retention is not None and not retention.is_live(self._clock()):
            return GoneReason.EXPIRED
        if retention is not None and not retention.on_device:
            return GoneReason.EVICTED  # from the device: there is nothing to pin
        return self._gone.get(key, GoneReason.NO_RETENTION)

    def retain(
        self,
        key: str,
        request_id: str,
        block_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        num_tokens: int,
    ) -> list[Retention]:
        """Keep a finished request's blocks under ``key``; return every retention to free now.

        The returned list holds, in this order: the key's previous retention (replaced: a
        conversation keeps only its latest turn), then any retentions dropped to fit the budget
        (expired ones first, then least recently used). The new retention is never evicted to
        make room for others.

        A retention larger than the whole budget is refused: it is not stored and comes back as
        the last item of the returned list, so its blocks are freed like any other. Nothing else
        is evicted for it, but the previous retention is still replaced, so after ``retain`` the
        key holds exactly the new retention or nothing (never an older turn the router no longer
        tracks). With a host tier its blocks come back the same way but its lease is stored,
        host-only.

        Raises:
            ValueError: malformed arguments (empty key, no blocks, negative or repeated block
                ids, more hashes than blocks, hashes of the wrong size, non-positive token count).
        """
        block_ids = tuple(block_ids)
        block_hashes = tuple(block_hashes)
        check_retain(key, request_id, block_ids, block_hashes, num_tokens)
        now = self._clock()
        freed: list[Retention] = []
        previous = self._drop(key)
        if previous is not None:
            self.stats.replaced += 1
            freed.extend(self._hand_back(previous))
        retention = Retention(
            key=key,
            request_id=request_id,
            block_ids=block_ids,
            block_hashes=block_hashes,
            num_tokens=num_tokens,
            created_at=now,
            expires_at=min(now + self.ttl, now + self.max_hold),
            hold_until=now + self.max_hold,
            last_used=now,
        )
        if retention.num_blocks > self.budget_blocks:
            self.stats.refused += 1
            freed.append(retention)
            if not self.host_tier:
                self._remember(key, GoneReason.EVICTED)
                return freed
            retention = replace(retention, block_ids=())
        freed.extend(self._free_blocks(
            self.held_blocks + retention.num_blocks - self.budget_blocks, now))
        self._store(retention)
        self._gone.pop(key, None)
        self.stats.created += 1
        return freed

    def get(self, key: str) -> Retention | None:
        """The key's live retention, or None (absent or expired). Does not count as a use."""
        retention = self._entries.get(key)
        if retention is None or not retention.is_live(self._clock()):
            return None
        return retention

    def lapsed(self, key: str) -> Retention | None:
        """The key's retention whose lease ran out but that is not handed back yet (its blocks
        are still held until :meth:`expire`), or None."""
        retention = self._entries.get(key)
        if retention is None or retention.is_live(self._clock()):
            return None
        return retention

    def touch(self, key: str) -> Retention | None:
        """Mark the key's live retention as used now (most recently used); return it or None.

        Use does not consume a retention: it stays readable until released, replaced, expired
        or evicted, so a retried turn can read it again. Use does not extend the lease either;
        only :meth:`keepalive` does, so a lease's lifetime has one explicit source.
        """
        now = self._clock()
        retention = self._entries.get(key)
        if retention is None or not retention.is_live(now):
            return None
        retention = replace(retention, last_used=now)
        self._entries[key] = retention
        self._entries.move_to_end(key)
        return retention

    def keepalive(self, key: str) -> Retention | None:
        """Extend the key's live lease to ``min(now + ttl, hold_until)``; return it or None.

        An expired lease is not revived: its blocks may already be promised to the allocator
        and the router has been told it is gone. A keepalive also counts as use for LRU order:
        a client keeping its lease alive (a tool is running) is about to need it, unlike an idle
        conversation.
        """
        now = self._clock()
        retention = self._entries.get(key)
        if retention is None or not retention.is_live(now):
            return None
        expires_at = max(retention.expires_at, min(now + self.ttl, retention.hold_until))
        retention = replace(retention, expires_at=expires_at, last_used=now)
        self._entries[key] = retention
        self._entries.move_to_end(key)
        self._schedule_expiry(retention)
        self.stats.renewed += 1
        return retention

    def release(self, key: str) -> tuple[bool, list[Retention]]:
        """Drop the key's retention: (whether there was one, retentions to free now).

        An expired retention not yet handed back still counts as "there was one": its blocks
        are held until someone frees them. A pinned one is released but drains, so the list
        is empty until its last pin goes.
        """
        retention = self._drop(key)
        if retention is None:
            return False, []
        self.stats.released += 1
        self._remember(key, GoneReason.RELEASED)
        self._end(key)
        return True, self._hand_back(retention)

    def expire(self) -> list[Retention]:
        """Drop every retention whose lease has run out and every pin that lapsed; return
        what is now free (expired unpinned retentions, soonest first, then draining retentions
        whose last pin lapsed)."""
        now = self._clock()
        freed: list[Retention] = []
        while (retention := self._pop_expired(now)) is not None:
            freed.extend(self._hand_back(retention))
        for pin in [p for p in self._pins.values() if p.expires_at <= now]:
            self.stats.pins_expired += 1
            freed.extend(self._unpin(pin))
        return freed

    def pin(self, key: str, ttl: float, *, host: bool = False) -> tuple[Retention, Pin] | None:
        """Pin the key's live retention for ``ttl`` seconds (capped at ``max_pin``); None if
        there is none on the device (with ``host``: none at all, the host tier holding a
        host-only one). A pin does not extend the lease and is not a use."""
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
            raise ValueError(f"pin ttl must be a positive number of seconds, got {ttl!r}")
        now = self._clock()
        retention = self._entries.get(key)
        if retention is None or not retention.is_live(now) \
                or not (retention.on_device or (host and self.host_tier)):
            return None
        pin = Pin(f"pin-{next(self._pin_ids)}", key, retention.request_id,
                  now + min(float(ttl), self.max_pin))
        self._pins[pin.pin_id] = pin
        ident = (key, retention.request_id)
        self._pin_counts[ident] = self._pin_counts.get(ident, 0) + 1
        self.stats.pinned += 1
        if not retention.on_device:
            self.stats.host_pinned += 1
        return retention, pin

    def unpin(self, pin_id: str) -> tuple[bool, list[Retention]]:
        """Drop a pin: (whether it existed, retentions whose blocks are now free)."""
        pin = self._pins.get(pin_id)
        if pin is None:
            return False, []
        return True, self._unpin(pin)

    def standings(self) -> dict[str, LeaseView]:
        """Every live lease, pinned or not, with its last use: the host tier's eviction order;
        one that left the table pinned stays pinned until its last pin goes (a host read)."""
        now = self._clock()
        draining = {key: r for (key, _), r in self._draining.items()}
        out = {key: LeaseView(Standing.PINNED, r.last_used) for key, r in draining.items()}
        # A newer turn's lease does not lower a read in flight of the older one's blocks.
        out.update({key: LeaseView(Standing.PINNED if (key, r.request_id) in self._pin_counts
                                   or key in draining else Standing.LEASED, r.last_used)
                    for key, r in self._entries.items() if r.is_live(now)})
        return out

    def take_ended(self) -> list[str]:
        """Keys whose lease ended since the last call (released, expired, lost), oldest first;
        always empty without a host tier. A key may have a new retention by now."""
        ended, self._ended = self._ended, []
        return ended

    def drop_lost(self, key: str, request_id: str) -> bool:
        """Drop the key's host-only retention of ``request_id``: the host tier no longer holds
        any of it, so the lease promises nothing. False when the key holds something else (a
        newer turn, or blocks on the device again)."""
        retention = self._entries.get(key)
        if retention is None or retention.on_device or retention.request_id != request_id:
            return False
        self._drop(key)
        self.stats.host_evicted += 1
        self._remember(key, GoneReason.EVICTED)
        self._end(key)
        self._log_lost(retention, GoneReason.EVICTED)
        return True

    def next_deadline(self) -> float | None:
        """The soonest clock time at which :meth:`expire` would have something to do."""
        times = [p.expires_at for p in self._pins.values()]
        soonest = self._expiry.first()
        if soonest is not None:
            times.append(soonest[0])
        return min(times) if times else None

    def evict_for(self, blocks_needed: int) -> list[Retention]:
        """Free retentions until at least ``blocks_needed`` blocks are freed or none are left.

        For when live requests need blocks the allocator does not have. Expired retentions go
        first (they are dead anyway), then the least recently used unpinned ones; pinned
        retentions are never chosen. It may free more than asked, since retentions are freed
        whole, and less when only pinned retentions are left. With a host tier an evicted
        retention's lease stays, host-only: what comes back is its device blocks.

        Raises:
            ValueError: ``blocks_needed`` is not a non-negative int.
        """
        if isinstance(blocks_needed, bool) or not isinstance(blocks_needed, int) \
                or blocks_needed < 0:
            raise ValueError(f"blocks_needed must be a non-negative int, got {blocks_needed!r}")
        return self._free_blocks(blocks_needed, self._clock(), for_live=True)

    # Internals. _entries, _retained_blocks and _expiry's keys change only in _store and _drop.

    def _free_blocks(self, needed: int, now: float, *, for_live: bool = False) -> list[Retention]:
        """Drop retentions until ``needed`` blocks are free or nothing unpinned is left.

        Expired retentions go first, then the least recently used unpinned ones on the device.
        A pinned retention frees nothing now (its blocks drain), so it is never chosen for room.
        Evictions ``for_live`` requests are logged lost (their blocks are taken at once); one
        over the budget leaves its blocks in the prefix cache until something needs them. With
        a host tier an evicted retention stays in the table, host-only, where it was in the LRU
        order, and is not lost: a turn the decode continues loads it from host memory.
        """
        freed: list[Retention] = []
        while needed > 0:
            retention = self._pop_expired(now, unpinned_only=True)
            if retention is None:
                # O(retentions) when the LRU end is pinned or host-only; a decode holds at
                # most a few hundred conversations.
                victim = next((k for k, r in self._entries.items() if r.on_device
                               and (k, r.request_id) not in self._pin_counts), None)
                if victim is None:
                    break
                self.stats.evicted += 1
                if self.host_tier:
                    retention = self._entries[victim]
                    self._retained_blocks -= retention.num_blocks
                    self._entries[victim] = replace(retention, block_ids=())
                else:
                    retention = self._drop(victim)
                    assert retention is not None
                    self._remember(victim, GoneReason.EVICTED)
                    if for_live:
                        self._log_lost(retention, GoneReason.EVICTED)
            freed.append(retention)
            needed -= retention.num_blocks
        return freed

    def _pop_expired(self, now: float, *, unpinned_only: bool = False) -> Retention | None:
        """Drop and return the soonest-expiring retention if it has expired, else None.

        With ``unpinned_only`` a pinned expired retention at the top of the heap stops the
        search (it would free nothing now); it is dropped by the next plain :meth:`expire`.
        """
        soonest = self._expiry.first()
        if soonest is None or now < soonest[0]:
            return None
        key = soonest[1]
        if unpinned_only and (key, self._entries[key].request_id) in self._pin_counts:
            return None
        self._expiry.pop_first()
        retention = self._drop(key)
        assert retention is not None
        self.stats.expired += 1
        self._remember(key, GoneReason.EXPIRED)
        self._end(key)
        self._log_lost(retention, GoneReason.EXPIRED)
        return retention

    def _hand_back(self, retention: Retention) -> list[Retention]:
        """A retention just dropped from the table: free it now, or let it drain if pinned."""
        ident = (retention.key, retention.request_id)
        if ident in self._pin_counts:
            self._draining[ident] = retention
            self._draining_blocks += retention.num_blocks
            return []
        return [retention]

    def _unpin(self, pin: Pin) -> list[Retention]:
        del self._pins[pin.pin_id]
        ident = (pin.key, pin.request_id)
        left = self._pin_counts[ident] - 1
        if left:
            self._pin_counts[ident] = left
            return []
        del self._pin_counts[ident]
        retention = self._draining.pop(ident, None)
        if retention is None:
            return []  # still in the table, unpinned now
        self._draining_blocks -= retention.num_blocks
        # Its lease ended while pinned; the host tier kept its blocks for the pin: now they go.
        self._end(pin.key)
        return [retention]

    def take_lost(self) -> list[tuple[Retention, GoneReason]]:
        """The retentions the table dropped on its own since the last call, oldest first:
        evicted for live requests (:meth:`evict_for`: the blocks are taken at once; with a
        host tier only once its host copy is gone too, :meth:`drop_lost`) or expired. Not
        evicted over the budget (the blocks stay in the prefix cache until something needs
        them), released, replaced or refused: whoever asked for those knows. At most
        ``remember`` are kept between calls (the oldest go first)."""
        lost, self._lost = self._lost, []
        return lost

    def _log_lost(self, retention: Retention, reason: GoneReason) -> None:
        self._lost.append((retention, reason))
        if len(self._lost) > max(self.remember, 1):
            del self._lost[:len(self._lost) - max(self.remember, 1)]

    def _end(self, key: str) -> None:
        if self.host_tier:
            self._ended.append(key)

    def _remember(self, key: str, reason: GoneReason) -> None:
        if not self.remember:
            return
        self._gone[key] = reason
        self._gone.move_to_end(key)
        while len(self._gone) > self.remember:
            self._gone.popitem(last=False)

    def _store(self, retention: Retention) -> None:
        self._entries[retention.key] = retention
        self._retained_blocks += retention.num_blocks
        self._schedule_expiry(retention)

    def _drop(self, key: str) -> Retention | None:
        retention = self._entries.pop(key, None)
        if retention is not None:
            self._retained_blocks -= retention.num_blocks
            self._expiry.discard(key)
        return retention

    def _schedule_expiry(self, retention: Retention) -> None:
        self._expiry.schedule(retention.key, retention.expires_at)

