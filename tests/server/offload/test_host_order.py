"""kvturn's eviction order for the decode's host tier (``offload/_order.py``): pure, no vLLM.

Blocks of no conversation go first (LRU), then those of conversations without a live lease,
then leased ones least recently used, never a pinned conversation's or a busy block; within a
conversation the tail goes first; a shared block goes with its safest owner.
"""

from __future__ import annotations

import random

import pytest

from kvturn_server.connector._tiers import LeaseView, Standing
from kvturn_server.offload._order import GONE, LEASED, NONE, HostOrder, stores_request


def k(name: str) -> bytes:
    return name.encode()


def ks(*names: str) -> list[bytes]:
    return [k(n) for n in names]


def stored(order: HostOrder, *names: str, conversation: str | None = None) -> None:
    """A request stores ``names`` (claimed first when it has a conversation, as vLLM's manager
    calls on_store_miss before insert) and finishes with them; the copies complete."""
    keys = ks(*names)
    fresh = [key for key in keys if key not in order]  # the rest are reused
    if conversation is not None:
        order.claim(conversation, keys)
    for key in fresh:
        order.add(key, idle=False)
    for key in fresh:
        order.mark_idle(key)
    order.finish(conversation, keys)


def leased(*names: str, at: float = 0.0) -> dict[str, LeaseView]:
    return {n: LeaseView(Standing.LEASED, at + i) for i, n in enumerate(names)}


def victims(order: HostOrder, n: int, leases: dict[str, LeaseView] | None = None,
            protected: tuple[str, ...] = ()) -> list[tuple[str, str]] | None:
    chosen = order.evict(n, set(ks(*protected)), leases or {})
    return None if chosen is None else [(key.decode(), label) for key, label in chosen]


def test_one_offs_go_first_least_recently_used_and_the_tail_of_each_first() -> None:
    order = HostOrder()
    stored(order, "a0", "a1", conversation="A")
    stored(order, "x0", "x1")
    stored(order, "y0")
    assert victims(order, 3, leased("A")) == [("x1", NONE), ("x0", NONE), ("y0", NONE)]
    assert victims(order, 1, leased("A")) == [("a1", LEASED)]


def test_conversations_without_a_live_lease_go_before_leased_ones() -> None:
    order = HostOrder()
    stored(order, "a0", conversation="A")
    stored(order, "b0", conversation="B")  # released or expired: not among the leases
    stored(order, "c0", conversation="C")
    assert victims(order, 2, leased("A", "C")) == [("b0", GONE), ("a0", LEASED)]


def test_leases_go_least_recently_used_first_by_the_keepers_clock() -> None:
    order = HostOrder()
    stored(order, "a0", "a1", conversation="A")
    stored(order, "b0", "b1", conversation="B")
    # B was used last by the host tier, but A's lease was touched more recently (a keepalive).
    leases = {"A": LeaseView(Standing.LEASED, 50.0), "B": LeaseView(Standing.LEASED, 10.0)}
    assert victims(order, 3, leases) == [("b1", LEASED), ("b0", LEASED), ("a1", LEASED)]


def test_a_pinned_conversations_blocks_and_busy_blocks_are_never_chosen() -> None:
    order = HostOrder()
    stored(order, "a0", "a1", conversation="A")
    stored(order, "x0")
    order.mark_busy(k("x0"))  # a load of it is in flight
    leases = {"A": LeaseView(Standing.PINNED, 0.0)}
    assert victims(order, 1, leases) is None
    order.mark_idle(k("x0"))
    assert victims(order, 1, leases) == [("x0", NONE)]
    assert victims(order, 1, leases) is None


def test_a_failed_choice_changes_nothing() -> None:
    order = HostOrder()
    stored(order, "x0", "x1")
    stored(order, "a0", conversation="A")
    assert victims(order, 4, leased("A")) is None
    assert len(order) == 3 and victims(order, 3, leased("A")) is not None
    assert len(order) == 0


def test_protected_blocks_stay() -> None:
    order = HostOrder()
    stored(order, "x0", "x1", "x2")
    assert victims(order, 2, protected=("x2",)) == [("x1", NONE), ("x0", NONE)]


def test_a_shared_prefix_goes_with_its_safest_owner() -> None:
    order = HostOrder()
    stored(order, "sys", "a1", conversation="A")
    stored(order, "sys", "b1", conversation="B")
    assert order.owners(k("sys")) == {"A", "B"}
    # A is gone, B leased: A's own block goes, the shared one stays with B.
    assert victims(order, 2, leased("B")) == [("a1", GONE), ("b1", LEASED)]
    assert victims(order, 1, leased("B")) == [("sys", LEASED)]
    order = HostOrder()
    stored(order, "sys", "a1", conversation="A")
    stored(order, "sys", "b1", conversation="B")
    # B pinned: the shared block never goes.
    assert victims(order, 3, {"B": LeaseView(Standing.PINNED, 0.0)}) is None
    assert victims(order, 1, {"B": LeaseView(Standing.PINNED, 0.0)}) == [("a1", GONE)]


def test_a_turn_owns_its_blocks_while_it_runs_before_it_finishes() -> None:
    order = HostOrder()
    stored(order, "x0")
    order.claim("A", ks("a0"))
    order.add(k("a0"), idle=True)
    assert order.owners(k("a0")) == {"A"}
    assert victims(order, 1, leased("A")) == [("x0", NONE)]


def test_a_later_turn_replaces_the_blocks_a_conversation_owns() -> None:
    order = HostOrder()
    stored(order, "p0", "p1", "p2", conversation="A")
    stored(order, "x0")
    # The next turn edited its history after p0 (a compaction): p1 and p2 are orphans, first
    # to go, before even an older one-off.
    stored(order, "p0", "q1", conversation="A")
    assert order.owners(k("p1")) == frozenset()
    assert victims(order, 2, leased("A")) == [("p2", NONE), ("p1", NONE)]
    assert order.resident_prefix("A") == 2


def test_resident_prefix_stops_at_the_first_gap() -> None:
    order = HostOrder()
    stored(order, "a0", "a1", "a2", "a3", conversation="A")
    assert order.resident_prefix("A") == 4
    order.remove(k("a1"))
    assert order.resident_prefix("A") == 1 and order.take_headless() == set()
    order.remove(k("a0"))  # the head: nothing of A loads from here now
    assert order.resident_prefix("A") == 0 and order.take_headless() == {"A"}
    assert order.take_headless() == set()
    assert order.resident_prefix("nobody") == 0


def test_a_conversation_with_nothing_left_is_forgotten() -> None:
    order = HostOrder()
    stored(order, "a0", "a1", conversation="A")
    assert order.conversations() == ["A"]
    assert victims(order, 2, {}) == [("a1", GONE), ("a0", GONE)]
    assert order.conversations() == [] and order.resident_prefix("A") == 0
    # A turn whose stores all failed leaves nothing behind either.
    order.claim("B", ks("b0"))
    order.finish("B", ks("b0"))
    assert order.conversations() == [] and order.owners(k("b0")) == frozenset()


def test_dropping_an_ended_lease_frees_what_no_live_lease_shares() -> None:
    order = HostOrder()
    stored(order, "sys", "a1", "a2", conversation="A")
    stored(order, "sys", "b1", conversation="B")
    order.mark_busy(k("a2"))
    freed = order.drop("A", live={"B"})
    assert sorted(freed) == ks("a1", "a2")  # the caller frees a2 once its copy is done
    assert order.owners(k("sys")) == {"B"} and order.conversations() == ["B"]
    # What could not be freed at once goes first from now on.
    order.remove(k("a1"))
    order.mark_idle(k("a2"))
    assert victims(order, 1, leased("B")) == [("a2", NONE)]
    # Nobody live: everything of the conversation is freed.
    assert sorted(order.drop("B", live=set())) == ks("b1", "sys")


def test_without_conversations_the_order_is_vllms_lru() -> None:
    order = HostOrder()
    stored(order, "a0", "a1")
    stored(order, "b0")
    order.finish(None, ks("a0", "a1"))  # a0, a1 used again: b0 is least recent
    assert victims(order, 1) == [("b0", NONE)]
    # Within one use the head is the most recent: the tail goes first.
    assert victims(order, 1) == [("a1", NONE)]


def test_one_offs_are_skipped_only_on_a_decode_told_to_skip_them() -> None:
    assert not stores_request(None, leased=True, one_offs=False)
    for leased, one_offs in ((True, True), (False, False), (False, True)):
        assert stores_request(None, leased=leased, one_offs=one_offs)
        assert stores_request("A", leased=leased, one_offs=one_offs)


def test_residency_is_checked() -> None:
    order = HostOrder()
    order.add(k("x"), idle=True)
    with pytest.raises(ValueError, match="already resident"):
        order.add(k("x"), idle=True)
    order.remove(k("nothing"))  # not resident: nothing to do
    assert k("x") in order and len(order) == 1


@pytest.mark.parametrize("seed", range(5))
def test_a_flood_keeps_the_order_and_every_invariant(seed: int) -> None:
    """Random conversations, one-offs, releases and evictions: whatever goes, nothing of a
    more protected class goes while a less protected one is evictable."""
    rng = random.Random(seed)
    order = HostOrder()
    leases: dict[str, LeaseView] = {}
    now = 0.0
    for step in range(400):
        now += 1
        action = rng.random()
        if action < 0.5:
            conversation = rng.choice([None, *[f"c{i}" for i in range(12)]])
            keys = [k(f"{conversation}-{j}") for j in range(rng.randint(1, 6))]
            fresh = [key for key in keys if key not in order]
            if conversation is not None:
                order.claim(conversation, keys)
            for key in fresh:
                order.add(key, idle=True)
            order.finish(conversation, keys)
            if conversation is not None and rng.random() < 0.8:
                standing = Standing.PINNED if rng.random() < 0.1 else Standing.LEASED
                leases[conversation] = LeaseView(standing, now)
        elif action < 0.6 and leases:
            ended = rng.choice(sorted(leases))
            del leases[ended]
            for key in order.drop(ended, live=set(leases)):
                order.remove(key)
        else:
            n = rng.randint(1, 4)
            classes = _classes(order, leases)
            chosen = order.evict(n, set(), leases)
            if chosen is None:
                assert sum(len(v) for c, v in classes.items() if c != "pinned") < n
                continue
            worst = max(_rank(label) for _, label in chosen)
            for label, keys in classes.items():
                if _rank(label) < worst:
                    assert all(key in (c for c, _ in chosen) for key in keys), (step, label)
            assert all(key not in classes["pinned"] for key, _ in chosen)


def _rank(label: str) -> int:
    return {NONE: 0, GONE: 1, LEASED: 2, "pinned": 3}[label]


def _classes(order: HostOrder, leases: dict[str, LeaseView]) -> dict[str, set[bytes]]:
    """Every idle resident block by the standing of its safest owner."""
    out: dict[str, set[bytes]] = {NONE: set(), GONE: set(), LEASED: set(), "pinned": set()}
    for key in list(order._idle):
        owners = order.owners(key)
        if not owners:
            out[NONE].add(key)
            continue
        views = [leases.get(o) for o in owners]
        if any(v is not None and v.standing is Standing.PINNED for v in views):
            out["pinned"].add(key)
        elif any(v is not None for v in views):
            out[LEASED].add(key)
        else:
            out[GONE].add(key)
    return out
