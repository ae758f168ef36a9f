"""The simulator runs kvturn's own retention, reuse and placement code on its own clock: the
policies' outcomes follow from the connector's rules, and the cost profiles reproduce the
figures they were calibrated from."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvturn_server.connector._retention import RetentionTable
from kvturn_server.sim import (
    H200,
    PROFILES,
    QWEN3_32B,
    THIS_MACHINE,
    Conversation,
    Efficiency,
    FleetSpec,
    Policy,
    RouterSpec,
    SimSettings,
    Simulation,
    WorkloadSpec,
    prefill_seconds,
    simulate,
    standard_policies,
    synthetic,
)

REPO = Path(__file__).resolve().parents[3]
SMALL = FleetSpec(prefills=1, decodes=1)


def _run(policy: Policy, conversations: list[Conversation], **kw: Any) -> dict[str, Any]:
    settings = SimSettings(fleet=SMALL, policy=policy, **kw)
    return simulate(settings, conversations).summary()


def _gap_of(seconds: float) -> list[Conversation]:
    return [Conversation("c", 0.0, 3000, (200, 200), (300, 100), (seconds,))]


def test_decodes_run_the_connectors_table_on_the_simulated_clock() -> None:
    sim = Simulation(SimSettings(fleet=SMALL), _gap_of(1.0))
    assert all(isinstance(d.table, RetentionTable) for d in sim.decodes)
    sim.run()
    # The table read the simulator's clock: a day of simulated gap costs no wall time.
    result = _run(standard_policies()["vllm-ttl-480"], _gap_of(86400.0))
    assert result["simulated_s"] > 86400


def test_a_fixed_ttl_lets_go_at_the_gap_the_lease_holds_through() -> None:
    policies = standard_policies()
    for gap, expired in ((10.0, 0), (600.0, 1)):
        ttl = _run(policies["vllm-ttl-480"], _gap_of(gap))
        lease = _run(policies["kvturn-lease"], _gap_of(gap))
        assert ttl["retention_stats"]["expired"] == expired, gap
        assert lease["retention_stats"]["expired"] == 0, gap
        # Turn 2 continues on the decode either way: a lapsed retention's blocks were only
        # freed, and with nothing else on the decode its prefix cache still holds them. The
        # turn reports the decode's coverage of its prompt: "partial", its new message
        # filling blocks of its own.
        for run in (ttl, lease):
            assert run["reasons"] == {"miss": 1, "partial": 1}, gap  # turn 1, then turn 2
            assert run["routes"] == {"prefill": 1, "decode": 1}, gap
            assert run["computed_tokens"] == lease["computed_tokens"], gap
    # The lease renewed every 60 s of the 600 s gap, then was released at the end.
    stats = _run(policies["kvturn-lease"], _gap_of(600.0))["retention_stats"]
    assert stats["renewed"] == 9 and stats["released"] == 1


def test_reuse_reads_what_the_retention_verifies() -> None:
    (c,) = _gap_of(5.0)
    result = _run(standard_policies()["kvturn-lease"], [c],
                  router=RouterSpec(decode_continue_tokens=0))
    bs = SMALL.block_size
    retained = c.prompt_tokens(0) + c.replies[0] - 1
    # Turn 2 computes only what the retention's full blocks do not cover.
    assert result["computed_tokens"] == c.prompt_tokens(0) + c.prompt_tokens(1) \
        - retained // bs * bs
    assert result["reasons"] == {"miss": 1, "partial": 1}
    assert result["routes"] == {"prefill": 2}


def test_short_turns_are_continued_on_the_decode() -> None:
    (c,) = _gap_of(5.0)
    result = _run(standard_policies()["kvturn-lease"], [c])
    assert result["routes"] == {"prefill": 1, "decode": 1}
    # Turn 2 found the whole retention (its usage's coverage is "partial" only because its
    # new message fills blocks of its own): it computed the new part alone.
    bs = SMALL.block_size
    retained = c.prompt_tokens(0) + c.replies[0] - 1
    assert result["computed_tokens"] == c.prompt_tokens(0) + c.prompt_tokens(1) \
        - retained // bs * bs
    assert result["reasons"]["miss"] == 1


def test_stock_pd_holds_nothing_and_recomputes() -> None:
    conversations = synthetic(WorkloadSpec(conversations=40, window_s=20.0, seed=1))
    stock = _run(standard_policies()["stock-pd"], conversations)
    lease = _run(standard_policies()["kvturn-lease"], conversations)
    assert stock["retained_gib"]["max"] == 0.0 and set(stock["routes"]) == {"prefill"}
    assert set(stock["reasons"]) == {"disabled"}
    assert lease["hit_rate"] > 0.5
    assert stock["computed_tokens"] > lease["computed_tokens"]


def test_the_budget_evicts_least_recently_used_first() -> None:
    # A budget that holds one conversation: the other's retention is evicted (LRU).
    block = FleetSpec(prefills=1, decodes=1, decode_blocks=400, block_size=64)
    conversations = [Conversation(f"c{i}", i * 0.5, 6000, (100, 100), (64, 64), (30.0,))
                     for i in range(2)]
    policy = Policy("lru", ttl_s=1e9, max_hold_s=1e9, budget=0.3)
    result = simulate(SimSettings(fleet=block, policy=policy), conversations).summary()
    assert result["retention_stats"]["evicted"] >= 1
    # One turn found its retention; the other's was evicted, but its blocks fell back into the
    # decode's prefix cache, where nothing had taken them yet: both later turns report what the
    # decode's cache supplied (their new messages fill blocks of their own: "partial").
    assert result["reasons"] == {"miss": 2, "partial": 2}
    assert result["later_turns_reused"] == 2


def test_default_profile_times_a_turn_as_its_roofline_says() -> None:
    """A cold 10k-token turn costs a prefill leg (overhead, compute), the pull of its KV and one
    ITL; the warm turn the decode continues costs its overhead, a few tokens and one ITL."""
    profile = PROFILES["qwen3-32b-h200"]
    c = Conversation("c", 0.0, 10000 - 34, (10, 10), (2, 2), (1.0,))
    assert c.prompt_tokens(0) == 10000
    recorder = Simulation(SimSettings(fleet=SMALL, cost=profile), [c]).run()
    cold, warm = recorder.ttfts
    prefill = prefill_seconds(QWEN3_32B, H200, 1, Efficiency(), 10000)
    pull = profile.read_fixed_ms / 1e3 + 10000 * QWEN3_32B.kv_bytes_per_token \
        / (profile.read_gbps * 1e9)
    expected = profile.leg_overhead_ms / 1e3 + prefill + pull + profile.itl_ms / 1e3
    assert abs(cold - expected) < 0.01 * expected
    assert warm < profile.leg_overhead_ms / 1e3 + 0.05 + profile.itl_ms / 1e3


def test_this_machine_profile_fits_bench_reuse() -> None:
    """THIS_MACHINE's compute numbers reproduce kvturn bench reuse's measured prefill steps."""
    data = json.loads((REPO / "docs/bench/reuse.json").read_text())
    sim = Simulation(SimSettings(cost=THIS_MACHINE), _gap_of(1.0))
    for row in data["rows"]:
        if row["generated"]:
            continue
        measured_ms = row["modes"]["recompute"]["steps_ms"]["prefill"]
        predicted_ms = 1e3 * (sim.cost_model.work(row["prompt_tokens"], 0)
                              / THIS_MACHINE.compute_tokens_per_s
                              + THIS_MACHINE.leg_overhead_ms / 2e3)
        assert abs(predicted_ms - measured_ms) < 0.15 * measured_ms, row["tokens"]


def test_policies_compare_on_the_same_trace() -> None:
    conversations = synthetic(WorkloadSpec(conversations=200, window_s=30.0, seed=2))
    base = SimSettings(fleet=FleetSpec(prefills=2, decodes=2))
    results = {name: simulate(replace(base, policy=p), conversations).summary()
               for name, p in standard_policies().items()}
    turns = {r["turns"] for r in results.values()}
    assert turns == {sum(c.turns for c in conversations)}
    # kvturn's lease releases finished conversations: it holds less than keeping everything.
    assert results["kvturn-lease"]["retained_gib"]["mean"] \
        < results["evict-before-starve"]["retained_gib"]["mean"]


def test_every_block_is_free_or_retained_never_both() -> None:
    """Under memory pressure, with shared prefixes, pins, expiry, eviction and release: at the
    end each decode's blocks are exactly its free ones plus its retentions', with no repeats."""
    conversations = synthetic(WorkloadSpec(conversations=300, window_s=20.0, seed=5))
    fleet = FleetSpec(prefills=2, decodes=2, decode_blocks=3000)
    for policy in standard_policies(budget=0.3).values():
        sim = Simulation(SimSettings(fleet=fleet, policy=policy), conversations)
        sim.run()
        for decode in sim.decodes:
            assert decode.live == 0 and not decode.waiting
            free = decode.free_ids()
            held = [b for r in decode.table.retentions() for b in r.block_ids]
            assert len(free) + len(held) == decode.capacity, policy.name
            assert sorted(free + held) == list(range(decode.capacity)), policy.name
