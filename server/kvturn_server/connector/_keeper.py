"""The decode's retained KV, bound to vLLM's block pool: hold, free, make room, serve control.

:class:`~kvturn_server.connector._retention.RetentionTable` decides; this class carries the
decisions out on the block pool and makes them safe across threads:

- **Holding** a retention takes one extra reference on each of its blocks
  (``BlockPool.touch``), so vLLM can free the finished request as usual while the blocks stay
  allocated (and stay in the prefix cache, so the conversation's next turn on this decode hits
  them locally). **Freeing** drops that reference (``BlockPool.free_blocks``). Nothing else is
  kept alive: the engine has no finished request waiting on the connector, so it idles (no
  busy-stepping) while retentions are held.
- The block pool belongs to the engine thread. Control requests (pin, keepalive, release, ...)
  arrive on the control server's threads: they change only the table, under this class's lock,
  and queue blocks to free; the engine thread frees them in :meth:`service`, which the scheduler
  hooks call every step and the engine waker calls when the engine is idle.
- Live requests come first. :meth:`make_room` (a waiting request needs blocks) and
  :meth:`relieve` (a running request could not get blocks; vLLM asks before preempting) evict
  least recently used unpinned retentions, so retention never causes a preemption.
- With a host tier (``_tiers.py``; bound with the block pool) an evicted retention keeps its
  lease, host-only, and every view says where the retention lives (``where``: ``device``,
  ``host`` or ``both``; ``host_tokens``). The host tier orders its evictions by
  :meth:`standings`, and a lease that ends (release, expiry) frees the conversation's host
  blocks too, on the engine thread (the host tier, like the block pool, belongs to it). The
  keeper never calls the host tier while holding its own lock: the host tier calls
  :meth:`standings` from inside its eviction.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from kvturn.wire import GoneReason, Where
from kvturn_server.connector._freed import FreedBlocks
from kvturn_server.connector._hashing import DEFAULT_SEED, block_hashes
from kvturn_server.connector._lease import Gone, Retention
from kvturn_server.connector._lost import LostLog
from kvturn_server.connector._params import READ_PREFIX, HostRead, ReadCoordinates, read_params
from kvturn_server.connector._retention import RetentionTable
from kvturn_server.connector._tiers import HostTier, LeaseView

RETENTION_EVENTS = ("created", "renewed", "released", "expired", "evicted", "replaced",
                    "refused", "pinned", "host_evicted", "host_pinned")


class BlockPool(Protocol):
    """The slice of vLLM's ``BlockPool`` the keeper uses."""

    num_gpu_blocks: int
    blocks: Sequence[Any]

    def touch(self, blocks: Sequence[Any]) -> None: ...

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None: ...

    def get_num_free_blocks(self) -> int: ...


class RetentionKeeper:
    """One decode's retentions: thread-safe front of a :class:`RetentionTable`."""

    def __init__(self, *, block_bytes: int, budget: float, ttl: float, max_hold: float,
                 max_pin: float, clock: Callable[[], float] = time.perf_counter,
                 hash_seed: bytes = DEFAULT_SEED) -> None:
        self.hash_seed = hash_seed
        self.block_bytes = block_bytes
        self.budget = budget
        self._ttl, self._max_hold, self._max_pin = ttl, max_hold, max_pin
        self._clock = clock
        self._lock = threading.Lock()
        self._pool: BlockPool | None = None
        self._at: ReadCoordinates | None = None
        self._table: RetentionTable | None = None
        self._host: HostTier | None = None
        self._to_free: list[Retention] = []
        # Conversations whose lease ended: their host blocks are freed on the engine thread.
        self._to_discard: list[str] = []
        # Conversations whose first host block went: a host-only lease of theirs ends.
        self._to_check: set[str] = set()
        self._wake: Callable[[], object] = lambda: None
        self._counted = {name: 0 for name in RETENTION_EVENTS}
        self.pending_events: list[str] = []
        # What the table dropped on its own, for routers to follow (control ``GET .../lost``).
        self.lost = LostLog()
        self._freed = FreedBlocks()  # under the lock

    # Set-up (engine thread, at start).

    def bind(self, pool: BlockPool, at: ReadCoordinates, host: HostTier | None = None) -> None:
        """Attach the engine's block pool (the budget is a fraction of its usable blocks), the
        coordinates a prefill reads this decode at (every view of a retention carries the
        params built from them: :func:`~kvturn_server.connector._params.read_params`) and the
        decode's host tier, if it has one (then evicted retentions keep their lease)."""
        usable = max(pool.num_gpu_blocks - 1, 0)  # block 0 is vLLM's null block
        with self._lock:
            self._pool, self._at, self._host = pool, at, host
            self._table = RetentionTable(
                budget_blocks=int(usable * self.budget), ttl=self._ttl,
                max_hold=self._max_hold, max_pin=self._max_pin, clock=self._clock,
                host_tier=host is not None)

    def set_waker(self, wake: Callable[[], object]) -> None:
        """``wake`` makes the engine thread call :meth:`service` soon, even when idle."""
        self._wake = wake

    @property
    def bound(self) -> bool:
        return self._table is not None

    # Engine thread.

    def retain(self, key: str, request_id: str, block_ids: Sequence[int],
               token_ids: Sequence[int], num_computed_tokens: int, *,
               extras: Sequence[bytes | None] | None = None) -> Retention | None:
        """Keep a finished request's full blocks under ``key``; None if nothing was kept.

        Only full blocks are kept: a trailing partial block can never be read (it has no
        hash), and the last sampled token never went through the model, hence
        ``num_computed_tokens`` rather than the sequence length. ``extras`` are the blocks'
        extra hash inputs (``_extra_keys.block_extras``), at least one per kept block.
        """
        table, pool, at = self._table, self._pool, self._at
        if table is None or pool is None or at is None or table.budget_blocks == 0:
            return None
        bs = at.block_size
        # The token ids bound it too: with async scheduling a step in flight has been counted
        # as computed before its input token is known here.
        full = min(num_computed_tokens, len(token_ids)) // bs
        full = min(full, len(block_ids))
        if full == 0:
            return None
        ids = tuple(int(b) for b in block_ids[:full])
        if any(not 0 < b < pool.num_gpu_blocks for b in ids):
            raise ValueError(f"request {request_id}: block ids outside the pool: {ids}")
        hashes = block_hashes(list(token_ids[:full * bs]), bs, self.hash_seed, extras)
        held = Retention(key, request_id, ids, (), 0, 0.0, 0.0, 0.0, 0.0)
        pool.touch([pool.blocks[b] for b in ids])
        try:
            with self._lock:
                before = self._snapshot(table)
                freed = table.retain(key, request_id, ids, hashes, full * bs)
                kept = table.get(key)
                self._count(table, before)
        except BaseException:
            self._free([held])  # undo the hold: the table never saw these blocks
            raise
        self._free(freed)
        self._discard()
        if kept is not None:
            with self._lock:
                self._freed.forget(key)
        return kept if kept is not None and kept.request_id == request_id else None

    def service(self) -> None:
        """Free what control requests and expiries handed back. Cheap when there is nothing."""
        table = self._table
        if table is None:
            return
        self._check_host()
        with self._lock:
            deadline = table.next_deadline()
            if not self._to_free and not self._to_discard \
                    and (deadline is None or deadline > self._clock()):
                return
            before = self._snapshot(table)
            freed = self._to_free + table.expire()
            self._to_free = []
            self._count(table, before)
        self._free(freed)
        self._discard()

    def has_pins(self) -> bool:
        table = self._table
        return table is not None and table.num_pins > 0

    def due(self) -> bool:
        """Whether :meth:`service` has work now (for the idle-engine housekeeper)."""
        with self._lock:
            if self._to_free or self._to_discard or self._to_check:
                return True
            deadline = self._table.next_deadline() if self._table is not None else None
            return deadline is not None and deadline <= self._clock()

    def make_room(self, blocks_needed: int) -> int:
        """Evict retentions until the pool has ``blocks_needed`` free blocks (or nothing
        unpinned is left); return how many retentions went."""
        table, pool = self._table, self._pool
        if table is None or pool is None:
            return 0
        evicted = 0
        # A retention's blocks shared with a live request (its conversation's next turn hit
        # them in the prefix cache) stay allocated when it goes, so check the pool again.
        while len(table) and (short := blocks_needed - pool.get_num_free_blocks()) > 0:
            with self._lock:
                before = self._snapshot(table)
                freed = table.evict_for(short)
                self._count(table, before)
            if not freed:
                break
            self._free(freed)
            evicted += len(freed)
        self._discard()
        return evicted

    def free_blocks(self) -> int:
        """The pool's free blocks (cached ones included), or 0 before it is bound."""
        return self._pool.get_num_free_blocks() if self._pool is not None else 0

    def relieve(self) -> bool:
        """A running request could not get blocks: evict the least recently used unpinned
        retention. True when something was freed (vLLM then retries next step instead of
        preempting a live request)."""
        table = self._table
        if table is None or not len(table):
            return False
        with self._lock:
            before = self._snapshot(table)
            freed = table.evict_for(1)
            self._count(table, before)
        self._free(freed)
        self._discard()
        return bool(freed)

    # Any thread (control server).

    def standings(self) -> dict[str, LeaseView]:
        """Every live lease and how it stands (for the host tier's eviction order)."""
        with self._lock:
            table = self._table
            return table.standings() if table is not None else {}

    def lost_in_host(self, conversations: Iterable[str]) -> None:
        """The host tier evicted these conversations' first blocks. Checked at the next
        :meth:`service`: the host tier calls this from inside a store, where nothing may call
        back into it."""
        with self._lock:
            self._to_check.update(conversations)

    def describe(self, key: str) -> dict[str, Any] | Gone:
        with self._lock:
            table, _ = self._require()
            retention = table.get(key)
            if retention is None:
                return Gone(key, table.gone_reason(key), self._left_cached(table, key))
            view = self._view(retention, retention.expires_at)
        return self._placed(retention, view)

    def pin(self, key: str, ttl: float, *, host_reads: bool = False) -> dict[str, Any] | Gone:
        """Pin the key's retention for a prefill's read; a host-only one too with
        ``host_reads``, when the host tier serves reads (else ``Gone`` with ``host_tokens``)."""
        host_pinned = self._pin_host(key, ttl) if host_reads else None
        if host_pinned is not None:
            return host_pinned
        with self._lock:
            table, _ = self._require()
            before = self._snapshot(table)
            pinned = table.pin(key, ttl)
            self._count(table, before)
            host_only = table.get(key) if pinned is None else None
            if pinned is None and (host_only is None or host_only.on_device):
                return Gone(key, table.gone_reason(key))
        if host_only is not None:
            # Nothing a prefill could read on the device (a pin with host_reads reads the host
            # tier: _pin_host), but this decode can still load it for a turn it continues
            # itself (the router's choice: plan_host_route).
            placed = self._placed(host_only, {})
            if isinstance(placed, Gone):
                return placed
            if placed["host_tokens"] <= 0:
                # Not host-only any more (a newer turn retained the key meanwhile): what the
                # table says now, as a pin that came a moment later would hear.
                with self._lock:
                    return Gone(key, self._require()[0].gone_reason(key))
            return Gone(key, GoneReason.EVICTED, host_tokens=placed["host_tokens"])
        assert pinned is not None
        with self._lock:
            retention, pin = pinned
            # The prefill declines a read close to this deadline (vLLM's expiry guard), and the
            # pin is what keeps the blocks, so the pin's end is the deadline it must see.
            view = self._view(retention, pin.expires_at)
        view.update(pin_id=pin.pin_id, pin_expires_in=round(pin.expires_at - self._clock(), 3))
        self._wake()  # the pin's expiry is a new deadline for service()
        placed = self._placed(retention, view)
        assert isinstance(placed, dict)  # pinned: on the device
        return placed

    def _pin_host(self, key: str, ttl: float) -> dict[str, Any] | None:
        """Pin a host-only retention for a read of the host tier; None (nothing pinned) when it
        is not host-only or the host tier cannot serve it: :meth:`pin` answers as without."""
        host = self._host
        with self._lock:
            table, _ = self._require()
            current = table.get(key)
            if host is None or current is None or current.on_device:
                return None
            before = self._snapshot(table)
            pinned = table.pin(key, ttl, host=True)
            self._count(table, before)
        if pinned is None:
            return None
        retention, pin = pinned
        # Asked with the pin held: from now on the host tier evicts none of these blocks.
        read = host.host_read(key, retention.request_id)
        rows = read.rows[:len(retention.block_hashes)] if read is not None else ()
        if read is None or not rows:
            self.unpin(pin.pin_id)
            return None
        with self._lock:
            view = self._view(retention, pin.expires_at, dataclasses.replace(read, rows=rows))
        view.update(pin_id=pin.pin_id, pin_expires_in=round(pin.expires_at - self._clock(), 3),
                    where=Where.HOST, host_tokens=min(len(rows) * self._require()[1].block_size,
                                                      retention.num_tokens))
        self._wake()  # the pin's expiry is a new deadline for service()
        return view

    def unpin(self, pin_id: str) -> bool:
        with self._lock:
            existed, freed = self._require()[0].unpin(pin_id)
            self._to_free.extend(freed)
        if freed:
            self._wake()
        return existed

    def keepalive(self, key: str) -> dict[str, Any] | Gone:
        with self._lock:
            table, _ = self._require()
            current = table.get(key)
        # A host-only lease whose host copy is gone promises nothing: not renewed, dropped.
        if current is not None and not current.on_device \
                and isinstance(lost := self._placed(current, {}), Gone):
            return lost
        with self._lock:
            table, _ = self._require()
            before = self._snapshot(table)
            retention = table.keepalive(key)
            self._count(table, before)
            if retention is None:
                return Gone(key, table.gone_reason(key))
            view = self._view(retention, retention.expires_at)
        return self._placed(retention, view)

    def release(self, key: str) -> bool | Gone:
        with self._lock:
            table, _ = self._require()
            before = self._snapshot(table)
            existed, freed = table.release(key)
            self._count(table, before)
            if not existed:
                return Gone(key, table.gone_reason(key))
            self._to_free.extend(freed)
        if freed or self._host is not None:
            self._wake()  # frees, and host blocks to discard
        return True

    def stats(self) -> dict[str, Any]:
        with self._lock:
            table, at = self._require()
            stats: dict[str, Any] = {
                "engine_id": at.engine_id,
                "retentions": len(table),
                "retained_blocks": table.retained_blocks,
                "held_blocks": table.held_blocks,
                "held_bytes": table.held_blocks * self.block_bytes,
                "budget_blocks": table.budget_blocks,
                "pins": table.num_pins,
                "host_only": table.host_only,
                "events": dict(self._counted),
            }
            host = self._host
        if host is not None:
            stats["host"] = host.usage()
        return stats

    def gauges(self) -> tuple[int, int, int, int]:
        """(retentions, held blocks, held bytes, host-only retentions), for metrics."""
        with self._lock:
            table = self._table
            if table is None:
                return 0, 0, 0, 0
            return (len(table), table.held_blocks, table.held_blocks * self.block_bytes,
                    table.host_only)

    def take_events(self) -> list[str]:
        with self._lock:
            events, self.pending_events = self.pending_events, []
        return events

    # Internals.

    def _require(self) -> tuple[RetentionTable, ReadCoordinates]:
        if self._table is None or self._at is None:
            raise RuntimeError("the retention keeper is not bound to a block pool yet")
        return self._table, self._at

    def _placed(self, retention: Retention, view: dict[str, Any]) -> dict[str, Any] | Gone:
        """``view`` with where the retention lives (``where``, ``host_tokens``); Gone when it
        is host-only and the host tier holds none of it any more (then it is dropped).

        Called without the lock: the host tier takes its own, and calls :meth:`standings`
        with it held.
        """
        host = self._host
        host_tokens = min(host.resident_tokens(retention.key), retention.num_tokens) \
            if host is not None else 0
        if not retention.on_device and host_tokens == 0:
            with self._lock:
                table, _ = self._require()
                before = self._snapshot(table)
                lost = table.drop_lost(retention.key, retention.request_id)
                self._count(table, before)
            if lost:
                self._wake()  # its host blocks (if any are left in flight) go too
                return Gone(retention.key, GoneReason.EVICTED)
        view.update(where=(Where.BOTH if host_tokens else Where.DEVICE) if retention.on_device
                    else Where.HOST, host_tokens=host_tokens)
        return view

    def _view(self, retention: Retention, deadline: float,
              host: HostRead | None = None) -> dict[str, Any]:
        now = self._clock()
        _, at = self._require()
        return {
            "key": retention.key,
            "engine_id": at.engine_id,
            "params": read_params(at, retention, deadline, host),
            "num_tokens": retention.num_tokens,
            "num_blocks": retention.num_blocks,
            "expires_in": round(retention.expires_at - now, 3),
            "hold_remaining": round(retention.hold_until - now, 3),
            "created_ago": round(now - retention.created_at, 3),
        }

    def _left_cached(self, table: RetentionTable, key: str) -> int | None:
        """What ``key``'s dropped retention left in the prefix cache (the caller holds the
        lock): all of it while a lapsed lease still holds its blocks."""
        lapsed = table.lapsed(key)
        if lapsed is not None and lapsed.on_device:
            return lapsed.num_tokens
        pool, at = self._pool, self._at
        if pool is None or at is None:
            return None
        return self._freed.cached_tokens(key, pool.blocks, at.block_size)

    def _free(self, retentions: Iterable[Retention]) -> None:
        pool = self._pool
        if pool is None:
            return
        for retention in retentions:
            if not retention.block_ids:
                continue  # host-only: nothing on the device
            blocks = [pool.blocks[b] for b in retention.block_ids]
            if retention.num_tokens:  # (not a hold undone before the table saw it)
                with self._lock:
                    self._freed.note(retention.key, retention.block_ids, blocks,
                                     retention.num_tokens)
            # Tail blocks first: they are the least likely to be shared with another sequence,
            # and the prefix cache gives them out first, so the history's start stays longest.
            pool.free_blocks(blocks[::-1])

    def _check_host(self) -> None:
        """End the host-only leases whose host copy went (engine thread; outside the lock).
        Routers following the lost log learn of them there."""
        with self._lock:
            if not self._to_check or self._table is None:
                return
            check, self._to_check = self._to_check, set()
            held = [r for key in check if (r := self._table.get(key)) is not None
                    and not r.on_device]
        for retention in held:
            self._placed(retention, {})

    def _discard(self) -> None:
        """Free the host blocks of ended leases (engine thread; outside the lock)."""
        with self._lock:
            ended, self._to_discard = self._to_discard, []
        if ended and self._host is not None:
            self._host.discard(ended)

    @staticmethod
    def _snapshot(table: RetentionTable) -> tuple[int, ...]:
        s = table.stats
        return (s.created, s.renewed, s.released, s.expired, s.evicted, s.replaced, s.refused,
                s.pinned, s.host_evicted, s.host_pinned)

    def _count(self, table: RetentionTable, before: tuple[int, ...]) -> None:
        # Events are derived from the table's counters so that no code path can forget one;
        # so are the leases that ended (the caller holds the lock).
        for name, old, new in zip(RETENTION_EVENTS, before, self._snapshot(table), strict=True):
            if new > old:
                self._counted[name] += new - old
                self.pending_events.extend([name] * (new - old))
        self._to_discard.extend(table.take_ended())
        lost = table.take_lost()
        if lost:
            self.lost.add((r.key, reason.value, READ_PREFIX + r.request_id) for r, reason in lost)
