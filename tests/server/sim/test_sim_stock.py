"""The stock baselines in the simulator: stock P/D, conditional disaggregation (the router's
own decision, over the decodes' plain LRU prefix caches) and the same with a host tier."""

from __future__ import annotations

from typing import Any

import pytest

from kvturn_server.router import RoutePlan, TurnPath, TurnPolicy
from kvturn_server.sim import (
    Conversation,
    FleetSpec,
    Policy,
    SimSettings,
    Simulation,
    simulate,
    standard_policies,
)
from kvturn_server.sim._instances import PrefixCache, unique_hashes

SMALL = FleetSpec(prefills=1, decodes=1)


def _run(policy: str | Policy, conversations: list[Conversation], fleet: FleetSpec = SMALL,
         **kw: Any) -> dict[str, Any]:
    p = standard_policies(**kw)[policy] if isinstance(policy, str) else policy
    return simulate(SimSettings(fleet=fleet, policy=p), conversations).summary()


def _chat(message: int, gap: float = 5.0, cid: str = "c", start: float = 0.0) -> Conversation:
    return Conversation(cid, start, 3000, (200, message), (300, 100), (gap,))


def test_every_stock_policy_states_its_peer() -> None:
    for name, policy in standard_policies().items():
        assert policy.peer, name
        if name.startswith("stock"):
            assert not policy.retain
    assert "prefix_based_pd_decider" in standard_policies()["stock-cond"].peer
    assert "2048" in standard_policies()["stock-cond-2k"].peer


def test_stock_pd_runs_every_turn_through_a_prefill() -> None:
    result = _run("stock-pd", [_chat(100)])
    assert result["routes"] == {"prefill": 2} and result["reasons"] == {"disabled": 2}


@pytest.mark.parametrize(("policy", "message", "routes"), [
    ("stock-cond", 100, {"prefill": 1, "decode": 1}),
    ("stock-cond", 1000, {"prefill": 2}),
    ("stock-cond-2k", 1000, {"prefill": 1, "decode": 1}),
    ("stock-cond-2k", 3000, {"prefill": 2}),
])
def test_conditional_disaggregation_runs_short_follow_ups_on_the_decode(
        policy: str, message: int, routes: dict[str, int]) -> None:
    result = _run(policy, [_chat(message)])
    assert result["routes"] == routes
    # The decode's prefix cache held the first turn: only the new part was computed again.
    assert result["hit_rate"] == 1.0


def test_the_simulator_runs_the_routers_own_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def never(policy: TurnPolicy, **kw: Any) -> RoutePlan:
        calls.append(policy.conditional_disagg)
        return RoutePlan(TurnPath.PREFILL, not_continued="too_long", reason="disabled")

    # The simulator calls the router's turn planner through the router's face.
    monkeypatch.setattr("kvturn_server.router.plan_route", never)
    result = _run("stock-cond", [_chat(100)])
    assert calls == [512, 512] and result["routes"] == {"prefill": 2}


def _crowd(n: int, *, gap: float) -> list[Conversation]:
    """``n`` conversations of 20k-token prompts, all started before the first returns."""
    return [Conversation(f"c{i}", i * 0.01, 20000, (100, 100), (64, 64), (gap,))
            for i in range(n)]


def test_the_router_knows_only_what_it_sent() -> None:
    """Six 20k-token conversations on a decode with room for two: the decode-only follow-ups
    of the conversations its LRU cache dropped recompute their whole history there."""
    fleet = FleetSpec(prefills=1, decodes=1, decode_blocks=700)
    result = _run("stock-cond", _crowd(6, gap=30.0), fleet)
    assert result["routes"] == {"prefill": 6, "decode": 6}
    assert result["hit_rate"] < 0.5
    assert result["retention_stats"]["prefix_cache_evicted_blocks"] > 0
    assert result["recomputed_tokens"] > 3 * 20000


def test_a_host_tier_keeps_what_the_decode_dropped() -> None:
    fleet = FleetSpec(prefills=1, decodes=1, decode_blocks=700)
    plain = _run("stock-cond", _crowd(6, gap=30.0), fleet)
    offload = _run("stock-cond-offload", _crowd(6, gap=30.0), fleet, host_gib=64.0)
    assert offload["hit_rate"] == 1.0 and offload["host_gib"]["max"] > 0
    assert offload["computed_tokens"] < plain["computed_tokens"]
    assert offload["ttft_later_s"]["p90"] < plain["ttft_later_s"]["p90"]
    # A host tier too small for one conversation keeps none.
    tiny = _run("stock-cond-offload", _crowd(6, gap=30.0), fleet, host_gib=0.1)
    assert tiny["computed_tokens"] == plain["computed_tokens"]


def test_the_router_forgets_a_stock_record() -> None:
    # retention_ttl 480 s + remember_expired 600 s: after that, no affinity, no decode turn.
    assert _run("stock-cond", [_chat(100, gap=1000.0)])["routes"] == {"prefill": 1, "decode": 1}
    assert _run("stock-cond", [_chat(100, gap=1100.0)])["routes"] == {"prefill": 2}


def test_prefix_cache_evicts_the_least_recently_used_tail_first() -> None:
    cache = PrefixCache()
    a, b = unique_hashes("a", 0, 4), unique_hashes("b", 0, 4)
    cache.put("a", [0, 1, 2, 3], a)
    cache.put("b", [4, 5, 6, 7], b)
    assert cache.evict(3) == [1, 2, 3] and cache.blocks == 5
    # What is left of a's prefix still hits, and taking it leaves the cache.
    assert cache.take("a", a) == ([0], [])
    assert cache.peek("b", b[:2] + unique_hashes("x", 2, 4)) == 2
    assert cache.put("b", [8], b) == [4, 5, 6, 7]


def test_stock_memory_is_free_or_cached_never_lost() -> None:
    fleet = FleetSpec(prefills=2, decodes=2, decode_blocks=900)
    for name in ("stock-pd", "stock-cond", "stock-cond-offload", "stock-cond-2k-offload"):
        sim = Simulation(SimSettings(fleet=fleet, policy=standard_policies()[name]),
                         _crowd(8, gap=3.0))
        sim.run()
        for decode in sim.decodes:
            assert decode.live == 0 and not decode.waiting and len(decode.table) == 0
            assert sorted(decode.free_ids()) == list(range(decode.capacity)), name


def test_kvturn_s_host_tier_keeps_an_evicted_retention_and_loads_it_back() -> None:
    """kvturn-host: a retention live requests evicted from the decode stays in host memory, so
    the router does not mark it lost (the connector logs it only once the host tier drops it)
    and the next turn continues on the decode, loading it back; device-only, the lost record's
    turn takes a prefill."""
    block = FleetSpec(prefills=1, decodes=1, decode_blocks=120, block_size=64)
    conversations = [Conversation(f"c{i}", i * 0.5, 6000, (100, 100), (64, 64), (30.0,))
                     for i in range(2)]
    policies = standard_policies(host_gib=4.0)  # 256 blocks of 16 MiB
    host = simulate(SimSettings(fleet=block, policy=policies["kvturn-host"]),
                    conversations).summary()
    device = simulate(SimSettings(fleet=block, policy=policies["kvturn-lease"]),
                      conversations).summary()
    assert device["retention_stats"]["evicted"] >= 1
    assert device["routes"]["prefill"] > host["routes"]["prefill"]
    assert host["routes"] == {"prefill": 2, "decode": 2}
