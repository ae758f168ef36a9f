"""The simulator decides a turn as the router does (issue 27): one conversation's turns, run
through the simulator and through the router over fake backends, get the same decisions turn by
turn: where the turn ran (the decode alone, or a prefill leg), whether the retention was pinned
for it, and the reuse value it reports (``X-KVTurn-Reuse``).

Each fake backend answers as the simulated instance did (the turn's prompt and reply tokens,
what the decode retained, the prefill connector's reuse report, the tokens the decode's cache
supplied), and the router is sent the simulated turn's messages: the backends' facts are the
same on both sides, so only the decisions are compared. Both sides take them from the router's
planner (``kvturn_server.router``, ``_plan.py``); a copy of a decision in the simulator that
drifted from the router's would show here.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvturn_server.router import TurnPath
from kvturn_server.sim import (
    Conversation,
    FleetSpec,
    RouterSpec,
    SimSettings,
    Simulation,
    standard_policies,
)
from kvturn_server.sim._turn import Turn, messages
from tests.fakes.backends import Cluster
from tests.fakes.router_harness import MakeHarness

# Short follow-ups the decode continues, long ones through the prefill with a pin, one the
# pin's gain is under ``min_read_tokens`` for (below-threshold), and one after a one-token reply,
# where the prefill holds all the retention offers (no pin: its own cache's coverage).
CONVERSATION = Conversation(
    "c", 0.0, 1000, messages=(100, 40, 900, 600, 30, 700, 800, 20),
    replies=(200, 90, 1, 60, 64, 100, 20, 5), gaps_s=(2.0,) * 7)
# The script's turns are sized for a continuation threshold of 512 (the default until session 16).
ROUTER = RouterSpec(min_read_tokens=100, decode_continue_tokens=512, decode_continue_budget=1024)
FLEET = FleetSpec(prefills=1, decodes=1)


@dataclass(frozen=True)
class Decided:
    route: str
    pinned: bool
    reuse: str


class _Watched(Simulation):
    """The simulation, keeping each turn as it gets its first token."""

    def __init__(self, settings: SimSettings) -> None:
        super().__init__(settings, [CONVERSATION])
        self.turns: list[Turn] = []

    def _first_token(self, turn: Turn) -> None:
        self.turns.append(turn)
        super()._first_token(turn)


def _simulated(policy: str) -> list[Turn]:
    sim = _Watched(SimSettings(fleet=FLEET, policy=standard_policies()[policy], router=ROUTER))
    sim.run()
    assert [t.index for t in sim.turns] == list(range(CONVERSATION.turns))
    return sim.turns


async def _routed(make_harness: MakeHarness, policy: str, turns: list[Turn]) -> list[Decided]:
    p = standard_policies()[policy]
    cluster = Cluster(prefills=1, decodes=1)
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    decode.block_size = FLEET.block_size
    h = await make_harness(cluster, kv_reuse=p.retain, conditional_disagg=p.conditional_disagg,
                           decode_continue_tokens=ROUTER.decode_continue_tokens,
                           decode_continue_budget=ROUTER.decode_continue_budget,
                           min_read_tokens=ROUTER.min_read_tokens,
                           prefill_policy=ROUTER.prefill_policy)
    decided = []
    for turn in turns:
        reply = CONVERSATION.replies[turn.index]
        prefill.prompt_tokens = turn.prompt
        report = turn.prefill_report
        prefill.report = None if report is None else {
            "reason": report.reason, "reused_tokens": report.reused_tokens,
            "local_tokens": report.local_tokens}
        decode.usage_prompt_tokens = turn.prompt
        decode.completion_tokens = reply
        decode.cached_tokens = 0 if turn.usage is None else turn.usage.cached_tokens or 0
        decode.retention_tokens = turn.prompt + reply - 1  # as the simulated decode retains
        pins = sum(e.path.endswith("/pin") for e in cluster.log)
        resp = await h.chat("c" if p.conversation_ids else None, messages=messages(turn))
        assert resp.status_code == 200, resp.text
        decided.append(Decided(resp.headers["X-KVTurn-Route"],
                               sum(e.path.endswith("/pin") for e in cluster.log) > pins,
                               resp.headers["X-KVTurn-Reuse"]))
        if turn.index < len(CONVERSATION.gaps_s):
            h.clock.advance(CONVERSATION.gaps_s[turn.index])
    return decided


@pytest.mark.parametrize("policy", ["kvturn-lease", "stock-cond", "stock-pd"])
async def test_the_router_and_the_simulator_decide_every_turn_alike(
        make_harness: MakeHarness, policy: str) -> None:
    turns = _simulated(policy)
    simulated = [Decided(t.route, t.pinned, t.reason) for t in turns]
    assert await _routed(make_harness, policy, turns) == simulated


def test_the_script_takes_every_path_of_the_planner() -> None:
    """The conversation reaches what the comparison is for: under kvturn a continued turn (a
    hit and a partial), a pinned read, a pin below the threshold and a skipped one; under stock
    conditional disaggregation a decode-only turn."""
    kvturn = _simulated("kvturn-lease")
    wheres = [t.where for t in kvturn]
    assert TurnPath.CONTINUE in wheres and any(t.pinned for t in kvturn)
    reasons = {t.reason for t in kvturn}
    assert {"miss", "hit", "partial", "below-threshold"} <= reasons
    # The pin skipped for the one-token reply: the turn reports its prefill's own coverage.
    skipped = kvturn[3]
    assert skipped.where is TurnPath.PREFILL and not skipped.pinned
    assert skipped.reason in ("hit", "partial")
    assert TurnPath.DECODE_ONLY in [t.where for t in _simulated("stock-cond")]
