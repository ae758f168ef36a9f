"""kvturn with a host tier in the simulator (``kvturn-host``): a retention live requests evict
from a decode keeps its lease there, host-only, as the connector's table with ``host_tier``
keeps it; a longer turn whose pin finds it so continues on that decode (the router's
``plan_host_route``), or else a prefill reads it from that host tier instead of recomputing it;
the host tier dropping the copy ends it."""

from __future__ import annotations

from kvturn.wire import ReuseReason, Route
from kvturn_server.router import TurnPath
from kvturn_server.sim import (
    Conversation,
    FleetSpec,
    RouterSpec,
    SimSettings,
    Simulation,
    standard_policies,
)
from kvturn_server.sim._instances import SimDecode, unique_hashes
from kvturn_server.sim._turn import Turn

BS = 64
# One decode short of memory for both conversations, one prefill whose cache keeps only the
# latest of them: once "b" has run, "a"'s history is on no device. (The prefill's host tier,
# every instance has one under kvturn-host, keeps "a"'s first prompt, not its reply.)
FLEET = FleetSpec(prefills=1, decodes=1, decode_blocks=150, prefill_blocks=120, block_size=BS)
# "a" comes back after its tool gap with 2,000 new tokens: past the 512 a decode continues
# from the device, within the 4,096 it continues from host memory.
A = Conversation("a", 0.0, 3000, (200, 2000), (1000, 50), (30.0,))
B = Conversation("b", 1.0, 6000, (100,), (64,), ())
BLOCK_GIB = FLEET.block_bytes / 1024 ** 3


class _Watched(Simulation):
    """The simulation, keeping each turn as it gets its first token, and what the decode's
    table said of "a" when "b" finished."""

    def __init__(self, host_gib: float, host_tokens: int = 4096) -> None:
        policy = standard_policies(host_gib=host_gib)["kvturn-host"]
        super().__init__(SimSettings(fleet=FLEET, policy=policy, router=RouterSpec(
            decode_continue_tokens=512, decode_continue_budget=1024,
            decode_continue_host_tokens=host_tokens)), [A, B])
        self.turns: dict[str, Turn] = {}
        self.a_after_b: tuple[bool, int, int] | None = None

    def _first_token(self, turn: Turn) -> None:
        self.turns[f"{turn.conv.cid}{turn.index}"] = turn
        super()._first_token(turn)

    def _after(self, turn: Turn) -> None:
        if turn.conv.cid == "b":
            decode = self.decodes[0]
            retention = decode.table.get("a")
            self.a_after_b = (retention is not None and not retention.on_device,
                              decode.table.retained_blocks, decode.table.stats.host_evicted)
        super()._after(turn)


def _history(conv: Conversation) -> int:
    """Tokens of turn 1's prompt and reply in full blocks: what the retention holds."""
    return (conv.prompt_tokens(0) + conv.replies[0] - 1) // BS * BS


def test_a_host_only_retention_s_long_turn_continues_on_its_decode() -> None:
    sim = _Watched(host_gib=256 * BLOCK_GIB)
    summary = sim.run().summary()
    # "b" evicted "a"'s retention from the device: its lease goes on in host memory, holding
    # no device block (the table counts "b"'s alone), and nothing was logged lost.
    b_blocks = -(-(B.prompt_tokens(0) + B.replies[0]) // BS)
    assert sim.a_after_b == (True, b_blocks, 0)
    turn = sim.turns["a1"]
    # The pin found no device blocks; the router moved the turn to the decode, which loaded
    # the history from its host tier and computed only the rest.
    assert (turn.where, turn.route, turn.pinned, turn.prefill) == \
        (TurnPath.CONTINUE, Route.DECODE, False, None)
    assert turn.computed == A.prompt_tokens(1) - _history(A)
    assert turn.reason is ReuseReason.PARTIAL
    assert summary["routes"] == {"prefill": 2, "decode": 1}
    assert summary["computed_tokens"] == A.prompt_tokens(0) + B.prompt_tokens(0) \
        + turn.computed
    # The prefill's leg was undone: nothing counts in flight at the end.
    assert [b.in_flight for b in sim.prefill_pool.members] == [0]
    assert [b.continuing for b in sim.decode_pool.members] == [0]


def test_without_host_continuation_the_prefill_reads_it_from_the_decode_s_host_tier() -> None:
    sim = _Watched(host_gib=256 * BLOCK_GIB, host_tokens=0)
    summary = sim.run().summary()
    turn = sim.turns["a1"]
    # Not continued on the decode: the router pins the host-only retention again with
    # host_reads, and the prefill reads from the decode's host tier what its own caches lack
    # (its host tier kept the first prompt, not the reply), then computes the new tokens.
    assert (turn.where, turn.route, turn.pinned) == (TurnPath.PREFILL, Route.PREFILL, True)
    assert turn.local_hit == A.prompt_tokens(0) // BS * BS
    assert turn.prefill_report is not None
    assert turn.prefill_report.reused_tokens == _history(A) - turn.local_hit > 0
    assert turn.computed == A.prompt_tokens(1) - _history(A)
    assert turn.reason is ReuseReason.PARTIAL
    assert summary["routes"] == {"prefill": 3}
    # The router kept the record (the lease went on): the turn went back to "a"'s decode.
    assert turn.decode is not None and turn.decode.url == "d0"


def test_the_host_tier_dropping_the_copy_ends_the_lease() -> None:
    # Room in host memory for "b"'s copy only: storing it evicts "a"'s, so "a"'s host-only
    # retention promises nothing: dropped and logged lost (the keeper's drop_lost).
    sim = _Watched(host_gib=102 * BLOCK_GIB)
    summary = sim.run().summary()
    assert sim.a_after_b is not None and sim.a_after_b[0] is False
    assert summary["retention_stats"]["host_evicted"] == 1
    turn = sim.turns["a1"]
    # The router read the lost log: no pin, the prefill path, the whole prompt computed.
    assert (turn.where, turn.pinned, turn.computed) == \
        (TurnPath.PREFILL, False, A.prompt_tokens(1))
    assert turn.reason is ReuseReason.STALE


def _host_only(decode: SimDecode, key: str, blocks: int) -> list[bytes]:
    """``key`` retained on ``decode`` and copied to its host tier, then evicted from the device
    for live requests; its hashes."""
    hashes = unique_hashes(key, 0, blocks)
    admitted = decode.admit(key, hashes, blocks)
    assert admitted is not None
    decode.live -= 1
    decode.keep_in_host(key, hashes)
    decode.give_back(decode.table.retain(key, f"r-{key}", admitted.block_ids, hashes,
                                         blocks * BS))
    decode.give_back(decode.table.evict_for(decode.capacity))
    return hashes


def test_a_host_only_retention_holds_no_device_block_and_shares_none() -> None:
    policy = standard_policies()["kvturn-host"]
    decode = SimDecode("d0", 100, policy, max_num_seqs=8, clock=lambda: 0.0, host_blocks=200)
    hashes = _host_only(decode, "a", 40)
    # The lease goes on, host-only: no device block is held, and the evicted ones fell back
    # into the prefix cache, where they still hit until other work takes them.
    retention = decode.table.get("a")
    assert retention is not None and not retention.on_device
    assert decode.table.retained_blocks == 0 and decode.free_blocks == 100
    assert decode.peek("a", hashes) == 40 and decode.host_tokens("a", BS) == 40 * BS
    # Its lease ending gives nothing back: the prefix cache keeps what it had.
    decode.give_back(decode.table.release("a")[1])
    assert decode.peek("a", hashes) == 40 and len(decode.free_ids()) == 100

    hashes = _host_only(decode, "c", 40)
    other = decode.admit("b", unique_hashes("b", 0, 100), 100)  # takes every cached block
    assert other is not None
    decode.live -= 1
    decode.free(other.block_ids)
    # The next turn's admission shares nothing of the host-only retention: only the host
    # tier can supply its history (the engine loads it: ``Simulation._try_start``).
    later = decode.admit("c", hashes, 45)
    assert later is not None and (later.verified, later.retained) == (0, False)
    # Its next retention replaces it; the host-only one hands back nothing.
    decode.live -= 1
    decode.give_back(decode.table.retain("c", "r2", later.block_ids, hashes, 45 * BS))
    assert decode.table.retained_blocks == 45 and len(decode.free_ids()) == 55
