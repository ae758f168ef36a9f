"""The discrete-event simulation: agents, the router, prefills and decodes on one clock.

The decisions are kvturn's own code, imported: the router's placement
(:mod:`kvturn_server.router._placement`, :mod:`~kvturn_server.router._history`), the
prefill's verified reuse and read-or-compute choice (:func:`decide_reuse` with the connector's
:class:`CostModel`), and the decode's retention table (:class:`RetentionTable`, with the
simulator's clock). The stock baselines run the router's own stock decision
(:func:`conditional_decode`, :func:`served_tokens`). This file only moves time: it
decides nothing those modules decide.

A turn, as the router runs it (``router/_turn.py``):

1. The router looks up the conversation's record (none without a conversation id, or once the
   router forgot it). Under kvturn, if the decode holding it can continue the turn
   (:func:`continuation`), the decode computes the part it lacks itself; under stock
   conditional disaggregation the same when :func:`conditional_decode` says so, whatever the
   decode's prefix cache still holds.
2. Otherwise a prefill is chosen (:func:`choose_prefill`); the retention is pinned when it
   holds more than that prefill does (:func:`read_gain`, :func:`read_floor`). The prefill
   takes its own prefix-cache hit, reads the verified range the cost model prefers to read,
   computes the rest (FIFO behind the prefill's other work), then unpins.
3. A decode is chosen (:func:`choose_decode`); it allocates the request's blocks (evicting
   retentions rather than starving), pulls the prompt's KV it lacks, and decodes the reply.
4. The finished turn is retained (or left in the decode's prefix cache, by policy), the
   placement recorded, an older retention on another decode released; the agent's tool gap
   follows, with keepalives and a final release as the policy's clients send them.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO

from kvturn_server import router as routing
from kvturn_server.connector import CostModel, CostSettings, decide_reuse
from kvturn_server.router import Backend, Placement, Pool, Transcript, coverage, gone_reason
from kvturn_server.sim._config import GIB, SimSettings
from kvturn_server.sim._instances import (
    SHARED_SYSTEM,
    SimDecode,
    SimPrefill,
    conversation_hash,
)
from kvturn_server.sim._metrics import Recorder
from kvturn_server.sim._turn import (
    Turn,
    messages,
    prompt_block_hashes,
    retained_block_hashes,
    retained_record,
    stock_record,
    system_blocks,
)
from kvturn_server.sim._workload import Conversation


class Simulation:
    """One run of one policy over one list of conversations."""

    def __init__(self, settings: SimSettings, conversations: list[Conversation], *,
                 progress: TextIO | None = None, progress_every_s: float = 5.0) -> None:
        self.s = settings
        self.conversations = conversations
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        fleet, policy = settings.fleet, settings.policy
        self.block_size = fleet.block_size
        host_blocks = math.floor(policy.host_gib * GIB / fleet.block_bytes)
        self.prefills = [SimPrefill(f"p{i}", fleet.prefill_capacity, host_blocks)
                         for i in range(fleet.prefills)]
        # Each decode's lost log as the router has read it (``_lost_log``).
        self._lost: dict[str, dict[str, tuple[str, str]]] = {}
        self.decodes = [SimDecode(f"d{i}", fleet.decode_capacity, policy,
                                  max_num_seqs=fleet.max_num_seqs, clock=self.clock,
                                  host_blocks=host_blocks)
                        for i in range(fleet.decodes)]
        self.prefill_pool = Pool("prefill", [Backend("prefill", p.name) for p in self.prefills],
                                 eject_after=3, readmit_after=2)
        self.decode_pool = Pool("decode", [Backend("decode", d.name) for d in self.decodes],
                                eject_after=3, readmit_after=2)
        self._prefill_of = {p.name: p for p in self.prefills}
        self._decode_of = {d.name: d for d in self.decodes}
        cost = settings.cost
        if policy.host_gib and cost.host_read_gbps is None:
            raise ValueError(f"policy {policy.name} has a host tier; profile {cost.name} states "
                             "no host-to-device bandwidth")
        # The connector's own cost model, configured (not calibrated): the prefill's decision
        # and the simulated read time both come from it.
        self.cost_model = CostModel(
            CostSettings(read_fixed_ms=cost.read_fixed_ms, read_gbps=cost.read_gbps,
                         compute_tokens_per_s=cost.compute_tokens_per_s,
                         compute_attention_tokens=cost.attention_tokens),
            bytes_per_token=fleet.kv_bytes_per_token)
        # The prefill connector's decision may be configured apart from what steps cost.
        self.decision_model = self.cost_model if settings.connector_compute_tokens_per_s is None \
            else CostModel(CostSettings(
                read_fixed_ms=cost.read_fixed_ms, read_gbps=cost.read_gbps,
                compute_tokens_per_s=settings.connector_compute_tokens_per_s,
                compute_attention_tokens=cost.attention_tokens),
                bytes_per_token=fleet.kv_bytes_per_token)
        self.placements: dict[str, Placement] = {}
        self.recorder = Recorder(settings, self.decodes, self.prefills)
        self._progress = progress
        self._progress_every = progress_every_s
        self._request_ids = itertools.count()
        self.active = 0

    def clock(self) -> float:
        return self.now

    # The event loop.

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (when, next(self._seq), fn, args))

    def run(self) -> Recorder:
        for conv in self.conversations:
            self.at(conv.start_s, self._start, conv)
        horizon = max((c.start_s for c in self.conversations), default=0.0)
        self.at(0.0, self._sample)
        wall0 = last = time.monotonic()
        events = self._events
        while events:
            when, _, fn, args = heapq.heappop(events)
            self.now = when
            fn(*args)
            if self._progress is not None and not self.recorder.turns % 2000:
                wall = time.monotonic()
                if wall - last >= self._progress_every:
                    last = wall
                    self._say(wall - wall0, horizon)
            if self.active == 0 and all(f is self._sample for _, _, f, _ in events):
                break
        self.recorder.finish(self.now)
        return self.recorder

    def _say(self, wall: float, horizon: float) -> None:
        assert self._progress is not None
        print(f"[simulate {self.s.policy.name}] t={self.now:,.0f} s "
              f"(arrivals end {horizon:,.0f} s), {self.recorder.turns:,} turns, "
              f"{self.active:,} conversations active, {wall:.0f} s wall",
              file=self._progress, flush=True)

    def _sample(self) -> None:
        for decode in self.decodes:
            decode.give_back(decode.table.expire())
            self._drain(decode)
        self.recorder.sample(self.now)
        if self.active or any(f is not self._sample for _, _, f, _ in self._events):
            self.at(self.now + self.s.sample_interval_s, self._sample)

    # The agents.

    def _start(self, conv: Conversation) -> None:
        self.active += 1
        self._turn(conv, 0)

    def _turn(self, conv: Conversation, index: int) -> None:
        prompt = conv.prompt_tokens(index)
        first = conversation_hash(conv.cid)
        turn = Turn(conv, index, self.now, prompt, first,
                    prompt_block_hashes(conv, index, first, prompt, self.block_size))
        self._route(turn)

    def _after(self, turn: Turn) -> None:
        """The reply is complete: the agent's tool gap, then the next turn, or the end."""
        conv, policy = turn.conv, self.s.policy
        if turn.index + 1 >= conv.turns:
            if policy.release:
                placement = self.placements.pop(conv.cid, None)
                if placement is not None:
                    decode = self._decode_of[placement.decode]
                    decode.give_back(decode.table.release(conv.cid)[1])
            else:
                self.placements.pop(conv.cid, None)
            self.active -= 1
            return
        gap = conv.gaps_s[turn.index]
        if policy.keepalive_s is not None and policy.retain:
            k = policy.keepalive_s
            for n in range(1, int(gap / k) + 1):
                if n * k < gap:
                    self.at(self.now + n * k, self._keepalive, conv.cid)
        self.at(self.now + gap, self._turn, conv, turn.index + 1)

    def _keepalive(self, key: str) -> None:
        placement = self.placements.get(key)
        if placement is None:
            return
        if not placement.retained:
            return  # the router answers at once: nothing to renew
        retention = self._decode_of[placement.decode].table.keepalive(key)
        if retention is not None:
            self.placements[key] = replace(placement, expires_at=retention.expires_at)
        else:  # gone: the router keeps the record for affinity, lost (router/_conversations.py)
            self.placements[key] = replace(placement, retained=False,
                                           lost=str(self._decode_of[placement.decode]
                                                    .table.gone_reason(key)))

    # The router.

    def _record(self, key: str) -> Placement | None:
        """The router's record of the conversation; the store forgets it ``remember_expired``
        after its lease (or stock record) ran out. A retention its decode evicted or let
        expire is marked lost, as the router following the decode's lost log marks it
        (``router/_lost.py``: within milliseconds, so at once here)."""
        placement = self.placements.get(key)
        if placement is not None \
                and self.now >= placement.expires_at + self.s.router.remember_expired_s:
            del self.placements[key]
            return None
        if placement is not None and placement.retained and placement.lost is None \
                and self.s.router.follow_evictions:
            lost = self._lost_log(placement.decode).get(key)
            host = self._decode_of[placement.decode].host
            if lost is not None and lost[0] == placement.turn \
                    and not (host is not None and host.holds(key)):
                # With a host tier an evicted retention stays there (the connector logs it
                # only once the host tier drops it too), and the decode loads it back.
                placement = self.placements[key] = replace(placement, retained=False,
                                                           lost=lost[1])
        return placement

    def _lost_log(self, decode: str) -> dict[str, tuple[str, str]]:
        """What the decode's lost log said so far (connector ``take_lost``): key -> (the
        retention's request id, why), the latest per key."""
        log = self._lost.setdefault(decode, {})
        for retention, reason in self._decode_of[decode].table.take_lost():
            log[retention.key] = (retention.request_id, reason.value)
        return log

    def _route(self, turn: Turn) -> None:
        s, policy = self.s, self.s.policy
        key = turn.conv.cid
        placement = self._record(key) if policy.conversation_ids else None
        if placement is not None:
            turn.placement = placement
            turn.holder = self.decode_pool.by_url(placement.decode)
        if policy.conversation_ids and (policy.conditional_disagg or (
                policy.retain and s.router.decode_continue_tokens > 0)):
            turn.transcript = Transcript(messages(turn))
        if not policy.retain:
            turn.reason = "disabled"
        if placement is not None and turn.holder is not None:
            if policy.conditional_disagg:
                _, why = routing.conditional_decode(
                    placement=placement, holder=turn.holder, transcript=turn.transcript,
                    max_tokens=policy.conditional_disagg)
                if not why:
                    self._continue(turn, 0)
                    return
            elif policy.retain:
                estimate, why = routing.continuation(
                    placement=placement, holder=turn.holder, transcript=turn.transcript,
                    now=self.now, max_tokens=s.router.decode_continue_tokens,
                    budget=s.router.decode_continue_budget)
                if not why:
                    self._continue(turn, estimate)
                    return
        prefill, _ = routing.choose_prefill(self.prefill_pool, s.router.prefill_policy,
                                            placement, slack=s.router.prefill_affinity_slack)
        assert prefill is not None
        turn.prefill = prefill
        prefill.in_flight += 1
        self._prefill(turn)

    def _continue(self, turn: Turn, estimate: int) -> None:
        """The decode that served the conversation runs the turn alone."""
        assert turn.holder is not None
        turn.route, turn.continued = "decode", estimate
        turn.holder.continuing += estimate
        turn.decode = turn.holder
        turn.decode.in_flight += 1
        turn.ready_at = self.now + self.s.cost.leg_overhead_ms / 1e3
        self._admit(turn)

    # The prefill leg.

    def _host_load_s(self, blocks: int) -> float:
        """Reading ``blocks`` back from a host tier (PCIe), one more engine step included."""
        cost = self.s.cost
        assert cost.host_read_gbps is not None
        return cost.read_fixed_ms / 1e3 + blocks * self.s.fleet.block_bytes \
            / (cost.host_read_gbps * 1e9)

    def _prefill(self, turn: Turn) -> None:
        s, bs = self.s, self.block_size
        prefill = turn.prefill
        assert prefill is not None
        sim = self._prefill_of[prefill.url]
        key, hashes = turn.conv.cid, turn.hashes
        full = len(hashes)
        own = sim.cached_blocks(key, hashes)
        load_s = 0.0
        if sim.host is not None:
            held = sim.host.lookup(key, hashes)
            if held > own:
                load_s, own = self._host_load_s(held - own), held
        system = system_blocks(turn.conv, self.block_size)
        shared = min(sim.held_blocks(SHARED_SYSTEM), system, full) if system else 0
        local = max(own, shared) * bs
        pin = None
        decode = None
        pin_skipped = False
        placement = turn.placement
        if s.policy.retain and placement is not None and turn.holder is not None \
                and placement.retained:
            # The router's _worth_pinning, then its pin (the control call is the table's pin).
            gain = routing.read_gain(placement, prefill)
            floor = routing.read_floor(prefill, self.now)
            if gain >= max(1, s.router.min_read_tokens) and gain > floor:
                decode = self._decode_of[placement.decode]
                pin = decode.table.pin(turn.conv.cid, s.router.pin_ttl_s)
                if pin is None:
                    turn.reason = gone_reason(str(decode.table.gone_reason(turn.conv.cid)))
                    self.placements.pop(turn.conv.cid, None)
            else:
                pin_skipped = gain == 0
                turn.reason = "below-threshold"
        elif s.policy.retain and placement is not None and placement.lost is not None:
            turn.reason = gone_reason(placement.lost)  # the router's _worth_pinning
        read_tokens = 0
        read_s = 0.0
        if pin is not None:
            retention = pin[0]
            decision = decide_reuse(
                prompt_hashes=hashes, local_hit_tokens=local,
                retained_hashes=retention.block_hashes,
                retained_block_ids=retention.readable_block_ids, block_size=bs,
                threshold=s.router.recompute_threshold, expired=False, engine_known=True,
                enabled=True, cost=self.decision_model.estimate)
            turn.reason = decision.reason.value
            read_tokens = decision.num_tokens
            if decision.reused:
                read_s = self.cost_model.estimate(read_tokens, local).read_ms / 1e3
            declined = decision.cost.tokens if decision.cheaper_to_compute and decision.cost \
                else 0
            routing.learn_read_floor(prefill, declined=declined, reused=read_tokens, now=self.now)
        elif pin_skipped:
            # The prefill held all the retention offered: the router reports its own cache's
            # coverage (router/_turn.py, _local_coverage).
            turn.reason = "miss" if local <= 0 else "hit" if local >= (
                turn.prompt - 1) // bs * bs else "partial"
        covered = local + read_tokens
        computed = max(1, turn.prompt - covered)
        turn.computed = computed
        turn.reused = turn.prompt - computed
        turn.local_hit = local
        compute_s = self.cost_model.work(computed, covered) / s.cost.compute_tokens_per_s
        ready = self.now + s.cost.leg_overhead_ms / 2e3 + read_s + load_s
        start = max(ready, sim.busy_until)
        sim.busy_until = start + compute_s
        sim.busy_s += compute_s
        self.at(sim.busy_until, self._prefill_done, turn, pin, decode, sim)

    def _prefill_done(self, turn: Turn, pin: Any, decode: SimDecode | None,
                      sim: SimPrefill) -> None:
        if pin is not None and decode is not None:
            decode.give_back(decode.table.unpin(pin[1].pin_id)[1])
            self._drain(decode)
        sim.remember(turn.conv.cid, turn.hashes)
        if sim.host is not None:
            sim.host.store(turn.conv.cid, turn.hashes)
        system = system_blocks(turn.conv, self.block_size)
        if system:
            sim.remember(SHARED_SYSTEM, turn.hashes[:system])
        assert turn.prefill is not None
        turn.prefill.in_flight -= 1
        target = routing.choose_decode(self.decode_pool, turn.holder,
                                       slack=self.s.router.decode_affinity_slack)
        assert target is not None
        turn.decode = target
        target.in_flight += 1
        turn.ready_at = self.now + self.s.cost.leg_overhead_ms / 2e3
        self._admit(turn)

    # The decode leg.

    def _admit(self, turn: Turn) -> None:
        assert turn.decode is not None
        decode = self._decode_of[turn.decode.url]
        if decode.waiting:
            decode.waiting.append(turn)
            return
        if not self._try_start(turn, decode):
            decode.waiting.append(turn)

    def _try_start(self, turn: Turn, decode: SimDecode) -> bool:
        s, bs = self.s, self.block_size
        blocks = math.ceil((turn.prompt + turn.conv.replies[turn.index]) / bs)
        # The decode's own prefix: the conversation's retention when it holds one (a use: most
        # recently used now, its verified blocks shared), else its prefix cache's.
        admission = decode.admit(turn.conv.cid, turn.hashes, blocks)
        if admission is None:
            return False
        turn.blocks = admission.block_ids
        verified = admission.verified
        load_s = 0.0
        if decode.host is not None:
            held = decode.host.lookup(turn.conv.cid, turn.hashes)
            if held > verified:
                load_s, verified = self._host_load_s(held - verified), held
        start = max(self.now, turn.ready_at) + load_s
        hit = max(system_blocks(turn.conv, bs), verified) * bs  # the system prompt is hot
        if turn.route == "decode":
            computed = max(1, turn.prompt - hit)
            turn.computed, turn.reused = computed, turn.prompt - computed
            if s.policy.retain:
                # What the decode's usage reports: its cache's coverage of the prompt (the
                # router's TurnReport.settle), the retention's or the plain prefix cache's.
                turn.reason = coverage(turn.prompt - computed, turn.prompt, bs)
            compute_s = self.cost_model.work(computed, turn.prompt - computed) \
                / s.cost.compute_tokens_per_s
            begin = max(start, decode.busy_until)
            decode.busy_until = begin + compute_s
            decode.busy_s += compute_s
            first = decode.busy_until + s.cost.itl_ms / 1e3
        else:
            pull = max(0, turn.prompt - hit)
            pull_s = self.cost_model.estimate(pull, 0).read_ms / 1e3 if pull else 0.0
            first = start + pull_s + s.cost.itl_ms / 1e3
        reply = turn.conv.replies[turn.index]
        self.at(first, self._first_token, turn)
        self.at(first + (reply - 1) * s.cost.itl_ms / 1e3, self._decode_done, turn, decode)
        return True

    def _first_token(self, turn: Turn) -> None:
        if turn.continued and turn.holder is not None:
            turn.holder.continuing = max(0, turn.holder.continuing - turn.continued)
            turn.continued = 0
        self.recorder.turn(turn.conv, turn.index, ttft=self.now - turn.arrived,
                           prompt=turn.prompt, computed=turn.computed, reused=turn.reused,
                           reason=turn.reason, route=turn.route, when=self.now)

    def _decode_done(self, turn: Turn, decode: SimDecode) -> None:
        s, bs = self.s, self.block_size
        key = turn.conv.cid
        decode.live -= 1
        assert turn.decode is not None
        turn.decode.in_flight -= 1
        tokens = turn.prompt + turn.conv.replies[turn.index] - 1
        hashes = retained_block_hashes(turn, tokens, bs)
        if decode.host is not None:
            decode.host.store(key, hashes)
        if s.policy.retain:
            freed = decode.table.retain(key, f"r{next(self._request_ids)}", turn.blocks,
                                        hashes, tokens)
            decode.give_back(freed)
            retention = decode.table.get(key)
            old = self.placements.get(key)
            if retention is not None:
                self.placements[key] = retained_record(turn, decode.name, retention, tokens,
                                                       bs, old)
            else:
                # Not retained (refused over the budget): the router still records the
                # decode and the messages (router/_capture.py, _record_unretained).
                self._record_stock(turn, decode)
            if old is not None and old.decode != decode.name:
                moved = self._decode_of[old.decode]
                moved.give_back(moved.table.release(key)[1])
        else:
            decode.finish(key, turn.blocks, hashes)
            if s.policy.conversation_ids:
                self._record_stock(turn, decode)
        turn.blocks = ()
        self._drain(decode)
        self._after(turn)

    def _record_stock(self, turn: Turn, decode: SimDecode) -> None:
        key = turn.conv.cid
        self.placements[key] = stock_record(
            turn, decode.name, self.placements.get(key),
            expires_at=self.now + self.s.router.record_ttl_s,
            turn_id=f"r{next(self._request_ids)}")

    def _drain(self, decode: SimDecode) -> None:
        while decode.waiting:
            if not self._try_start(decode.waiting[0], decode):
                return
            decode.waiting.popleft()


def simulate(settings: SimSettings, conversations: list[Conversation], *,
             progress: TextIO | None = None) -> Recorder:
    """Run ``conversations`` through a fleet under ``settings``; the recorder has the results."""
    if not conversations:
        raise ValueError("nothing to simulate: no conversations")
    return Simulation(settings, conversations, progress=progress).run()
