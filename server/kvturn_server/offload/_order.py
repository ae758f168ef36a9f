"""Which blocks the decode's host tier evicts first: kvturn's order (no vLLM import).

vLLM's offloading manager keeps computed KV blocks in host memory, a fixed budget
(``cpu_bytes_to_use``), and asks its cache policy which blocks to evict when a store needs room.
vLLM's own policies (LRU, ARC) know nothing of kvturn's leases: the conversation an agent comes
back to after a tool call goes as soon as a burst of one-off requests has passed through.
:class:`HostOrder` decides by who owns each block instead:

1. blocks no conversation owns (one-off requests, and blocks a later turn of their conversation
   no longer contains), least recently used first;
2. blocks of conversations without a live lease (released, expired, never retained), the
   conversation least recently active first;
3. blocks of leased conversations, the lease least recently used first; a conversation whose
   turn is running counts as used now (its lease is about to start or be renewed, and its own
   later blocks must not evict its first ones);
4. never a block of a pinned conversation (a read of its device blocks is in flight), nor a
   block being copied (the manager marks those busy).

Within a conversation its last blocks go first: a load stops at the first missing block, so
the head of a history is worth the most. A block that several conversations share (one system
prompt) is as safe as its safest owner: it goes with that owner, never before.

Ownership comes from the requests: a conversation's request (``kvturn.conversation`` in its
transfer params) claims the blocks it stores or reuses as it goes, and when it finishes its
blocks, in prefix order, replace its previous turn's. Only a decode with kvturn's leases
claims anything; elsewhere every block is unowned and the order is plain LRU, as vLLM's.

Which requests are stored at all is :func:`stores_request`.

Not thread-safe: the policy that wraps it (``_policy.py``) serialises access.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence

from kvturn_server.connector import LeaseView, Standing

Key = bytes
"""A host block's key: vLLM's ``OffloadKey`` (block hash and KV-cache group)."""

NONE, GONE, LEASED = "none", "gone", "leased"
"""Standings of an evicted block's conversation, as the metrics label them."""


def stores_request(conversation: str | None, *, leased: bool, one_offs: bool) -> bool:
    """Whether the host tier stores a request's blocks: a conversation's always; a request of
    no conversation unless this is an engine with kvturn's leases (a decode) told not to store
    one-offs (``store_one_offs: false``).

    A decode behind kvturn's router loads from its host tier only for prompts it computes
    itself: turns the router continues on the decode and decode legs after a failed prefill,
    which always carry their conversation. A request of no conversation reaches it as a P -> D
    leg, whose prompt arrives over NIXL (kvturn's connector, first in the ``MultiConnector``,
    takes the request), so its host copy is never loaded there: a fleet that only kvturn's
    router drives saves those copies. Stored anyway by default, because a stock router on the
    same decodes (conditional disaggregation: a follow-up the decode serves alone) loads
    exactly those blocks, and kvturn's order evicts them first, so they never displace a lease
    (docs/connector.md, "The host tier").
    """
    return conversation is not None or not leased or one_offs


class HostOrder:
    """Residency, ownership and recency of a host tier's blocks, and the eviction order."""

    def __init__(self) -> None:
        self._resident: set[Key] = set()
        self._idle: set[Key] = set()  # resident, no transfer in flight: may be evicted
        self._unowned: OrderedDict[Key, None] = OrderedDict()  # resident, least recent first
        self._owners: dict[Key, set[str]] = {}  # every key some conversation lists
        self._turns: dict[str, list[Key]] = {}  # conversation -> its blocks, prefix order
        self._held: dict[str, int] = {}  # conversation -> its resident blocks (> 0)
        self._active: dict[str, int] = {}  # conversation -> tick of its last request
        self._headless: set[str] = set()  # lost their first block since take_headless
        self._tick = 0

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def conversations(self) -> list[str]:
        """Conversations with a resident block."""
        return list(self._held)

    def owners(self, key: Key) -> frozenset[str]:
        return frozenset(self._owners.get(key, ()))

    def take_headless(self) -> set[str]:
        """Conversations whose first block left since the last call: a load of their history
        finds nothing here any more."""
        headless, self._headless = self._headless, set()
        return headless

    # Residency (the manager's chunk pool).

    def add(self, key: Key, *, idle: bool) -> None:
        """A block is stored (``idle``: readable and not in use)."""
        if key in self._resident:
            raise ValueError(f"block {key.hex()} is already resident")
        self._resident.add(key)
        if idle:
            self._idle.add(key)
        owners = self._owners.get(key)
        if owners:
            for conversation in owners:
                self._held[conversation] = self._held.get(conversation, 0) + 1
        else:
            self._unowned[key] = None

    def remove(self, key: Key) -> None:
        """A block leaves host memory (evicted, discarded, or its store failed)."""
        if key not in self._resident:
            return
        self._resident.discard(key)
        self._idle.discard(key)
        self._unowned.pop(key, None)
        for conversation in list(self._owners.get(key, ())):
            if self._turns[conversation][0] == key:
                self._headless.add(conversation)
            held = self._held[conversation] - 1
            if held:
                self._held[conversation] = held
            else:
                self._forget(conversation)  # nothing of it left to order or to load

    def mark_idle(self, key: Key) -> None:
        if key in self._resident:
            self._idle.add(key)

    def mark_busy(self, key: Key) -> None:
        self._idle.discard(key)

    # Ownership and recency (the requests).

    def claim(self, conversation: str, keys: Iterable[Key]) -> None:
        """A request of ``conversation`` stores or reuses ``keys`` (before they are resident,
        for a store): they are the conversation's from now on."""
        turn = self._turns.setdefault(conversation, [])
        for key in keys:
            # Listed in the turn exactly when the conversation is among the key's owners:
            # O(1) per key however long the history.
            if conversation not in self._owners.get(key, ()):
                turn.append(key)
                self._own(conversation, key)
        self._activate(conversation)

    def finish(self, conversation: str | None, keys: Sequence[Key]) -> None:
        """A request finished having used ``keys`` (prefix order): with a conversation they
        are its blocks now, replacing its previous turn's; every one counts as just used."""
        self.use(keys)
        if conversation is None:
            return
        turn = list(dict.fromkeys(keys))
        new = set(turn)
        for key in self._turns.get(conversation, ()):
            if key not in new:
                self._disown(conversation, key)
        old = set(self._turns.get(conversation, ()))
        self._turns[conversation] = turn
        for key in turn:
            if key not in old:
                self._own(conversation, key)
        self._activate(conversation)
        if not self._held.get(conversation):
            self._forget(conversation)

    def use(self, keys: Sequence[Key]) -> None:
        """``keys`` (prefix order) were used: unowned ones become the most recently used, the
        head of the sequence most of all (as vLLM's LRU: the tail goes first)."""
        for key in reversed(keys):
            if key in self._unowned:
                self._unowned.move_to_end(key)

    def drop(self, conversation: str, live: Collection[str]) -> list[Key]:
        """``conversation``'s lease ended: forget it, and return its resident blocks that no
        conversation in ``live`` owns too (to be freed now). Freed or not, they are evicted
        before any owned block from now on."""
        keys = self._turns.get(conversation, ())
        freed = [key for key in keys if key in self._resident
                 and not any(o in live for o in self._owners[key] if o != conversation)]
        self._forget(conversation)
        return freed

    # Decisions.

    def evict(self, n: int, protected: Collection[Key],
              leases: Mapping[str, LeaseView]) -> list[tuple[Key, str]] | None:
        """Choose and remove exactly ``n`` idle blocks not in ``protected``, in kvturn's order;
        each with its conversation's standing (``none``, ``gone``, ``leased``). None, with
        nothing changed, when fewer than ``n`` can go.

        Cost: the unowned blocks scanned, plus, when those are not enough, a sort of the
        conversations holding blocks and a scan of their lists.
        """
        if n <= 0:
            return []
        chosen: list[tuple[Key, str]] = []
        for key in self._unowned:
            if key in self._idle and key not in protected:
                chosen.append((key, NONE))
                if len(chosen) == n:
                    break
        if len(chosen) < n:
            chosen.extend(self._owned_victims(n - len(chosen), protected, leases))
        if len(chosen) < n:
            return None
        for key, _ in chosen:
            self.remove(key)
        return chosen

    def resident_prefix(self, conversation: str) -> int:
        """How many of the conversation's blocks, from its first, are resident without a gap
        (what a load of its history could take)."""
        return len(self.resident_keys(conversation))

    def resident_keys(self, conversation: str) -> list[Key]:
        """The conversation's blocks from its first that are resident without a gap."""
        keys: list[Key] = []
        for key in self._turns.get(conversation, ()):
            if key not in self._resident:
                break
            keys.append(key)
        return keys

    # Internals.

    def _owned_victims(self, n: int, protected: Collection[Key],
                       leases: Mapping[str, LeaseView]) -> list[tuple[Key, str]]:
        # Rank of each conversation holding blocks: no live lease before leased, each by its
        # own clock (the policy's ticks, the keeper's last use); pinned never (None).
        ranks: dict[str, tuple[int, float, str] | None] = {}
        for conversation in self._held:
            view = leases.get(conversation)
            if view is None:
                ranks[conversation] = (0, self._active.get(conversation, 0), conversation)
            elif view.standing >= Standing.PINNED:
                ranks[conversation] = None
            else:
                ranks[conversation] = (1, view.last_used, conversation)
        chosen: list[tuple[Key, str]] = []
        taken: set[Key] = set()
        order = sorted((rank, c) for c, rank in ranks.items() if rank is not None)
        for rank, conversation in order:
            label = GONE if rank[0] == 0 else LEASED
            for key in reversed(self._turns[conversation]):
                if key not in self._idle or key in protected or key in taken:
                    continue
                # A shared block goes with its safest owner, never before it.
                if any(other != conversation and ((r := ranks.get(other)) is None or r > rank)
                       for other in self._owners[key]):
                    continue
                chosen.append((key, label))
                taken.add(key)
                if len(chosen) == n:
                    return chosen
        return chosen

    def _activate(self, conversation: str) -> None:
        self._tick += 1
        self._active[conversation] = self._tick

    def _own(self, conversation: str, key: Key) -> None:
        owners = self._owners.setdefault(key, set())
        owners.add(conversation)
        if key in self._resident:
            self._held[conversation] = self._held.get(conversation, 0) + 1
            self._unowned.pop(key, None)

    def _disown(self, conversation: str, key: Key) -> None:
        owners = self._owners.get(key)
        if owners is None or conversation not in owners:
            return
        owners.discard(conversation)
        if key in self._resident:
            held = self._held.get(conversation, 0) - 1
            if held > 0:
                self._held[conversation] = held
            else:
                self._held.pop(conversation, None)
            if not owners:
                # An orphan (a later turn dropped it, or its lease ended): first to go.
                self._unowned[key] = None
                self._unowned.move_to_end(key, last=False)
        if not owners:
            del self._owners[key]

    def _forget(self, conversation: str) -> None:
        for key in self._turns.pop(conversation, ()):
            self._disown(conversation, key)
        self._held.pop(conversation, None)
        self._active.pop(conversation, None)
