"""The discrete-event simulation: agents, the router, prefills and decodes on one clock.

Every decision is kvturn's own code, imported through the package faces: the router's turn
planner (``router/_plan.py``: :func:`plan_route`, :func:`plan_pin`, :func:`pin_gone`,
:func:`plan_host_route`, :func:`settle_prefill`, :func:`settle_continued`, :func:`moved_from`,
the same calls its ``Turn`` makes) and backend choices (:func:`choose_prefill`,
:func:`choose_decode`); the prefill's verified reuse and read-or-compute choice
(:func:`decide_reuse` with the connector's :class:`CostModel`); the decode's retention table
(:class:`RetentionTable`, on the simulator's clock). This file moves time and stands in for the
calls: a pin is the table's pin, a prefill leg's reuse report is what ``decide_reuse`` decided.

A turn runs the router's steps (``router/_turn.py``): the record looked up, the route planned
(the decode alone, or a prefill chosen and the retention pinned for it or not; a pin that finds
the retention in the decode's host tier alone may move the turn to that decode:
:func:`plan_host_route`; if not, the prefill reads it from that host tier), the prefill's hit,
read and compute (FIFO behind its other work), a
decode chosen, its blocks allocated (evicting retentions rather than starving) and the missing
KV pulled, the reply decoded, the turn retained (or left in the decode's prefix cache) and
recorded, an older retention on another decode released; then the agent's tool gap, with its
clients' keepalives and release.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from typing import Any, TextIO

from kvturn.wire import GoneReason, ReuseReason, Route
from kvturn_server import router as routing
from kvturn_server.connector import CostModel, CostSettings, decide_reuse
from kvturn_server.router import (
    Backend,
    DecodeUsage,
    Pool,
    ReuseReport,
    Transcript,
    TurnPath,
    TurnPolicy,
)
from kvturn_server.sim._config import GIB, SimSettings
from kvturn_server.sim._instances import (
    SHARED_SYSTEM,
    SimDecode,
    SimPrefill,
    conversation_hash,
)
from kvturn_server.sim._metrics import Recorder
from kvturn_server.sim._records import Records
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
        self.decodes = [SimDecode(f"d{i}", fleet.decode_capacity, policy,
                                  max_num_seqs=fleet.max_num_seqs, clock=self.clock,
                                  host_blocks=host_blocks)
                        for i in range(fleet.decodes)]
        self.prefill_pool = Pool("prefill", [Backend("prefill", p.name) for p in self.prefills],
                                 eject_after=3, readmit_after=2)
        # Control endpoints that always answer for their engine: the router's pin checks pass.
        self.decode_pool = Pool("decode", [Backend("decode", d.name, control_url=d.name)
                                           for d in self.decodes],
                                eject_after=3, readmit_after=2)
        # The router's settings that decide a turn, as the simulated router is configured.
        self.plan = TurnPolicy(
            reuse=policy.retain, retain=policy.retain,
            conditional_disagg=policy.conditional_disagg,
            decode_continue_tokens=settings.router.decode_continue_tokens,
            decode_continue_budget=settings.router.decode_continue_budget,
            decode_continue_host_tokens=settings.router.decode_continue_host_tokens,
            min_read_tokens=settings.router.min_read_tokens)
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
        self.records = Records(settings.router, self._decode_of)
        self.placements = self.records.placements
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
                    self.at(self.now + n * k, self.records.keepalive, conv.cid)
        self.at(self.now + gap, self._turn, conv, turn.index + 1)

    # The router.

    def _route(self, turn: Turn) -> None:
        s = self.s
        key = turn.conv.cid
        placement = self.records.find(key, self.now) if s.policy.conversation_ids else None
        if placement is not None:
            turn.placement = placement
            turn.holder = self.decode_pool.by_url(placement.decode)
        if s.policy.conversation_ids and self.plan.reads_transcript:
            turn.transcript = Transcript(messages(turn))
        held = None
        if routing.plan_probe(self.plan, placement=placement, holder=turn.holder,
                              transcript=turn.transcript, now=self.now):
            # The router asks the decode what it still holds of the conversation.
            assert turn.holder is not None
            decode = self._decode_of[turn.holder.url]
            held = decode.peek(key, turn.hashes) * self.block_size
        route = routing.plan_route(self.plan, placement=placement, holder=turn.holder,
                                   transcript=turn.transcript, now=self.now, held=held)
        turn.where = route.where
        if route.reason is not None:
            turn.reason = route.reason
        if route.where is not TurnPath.PREFILL:
            self._continue(turn, route.estimate)
            return
        prefill, _ = routing.choose_prefill(self.prefill_pool, s.router.prefill_policy,
                                            placement, slack=s.router.prefill_affinity_slack)
        assert prefill is not None
        turn.prefill = prefill
        self.prefill_pool.leg_started(prefill)
        self._prefill(turn)

    def _continue(self, turn: Turn, estimate: int) -> None:
        """The decode that served the conversation runs the turn alone."""
        assert turn.holder is not None
        turn.route, turn.continued = turn.where.route, estimate
        self.decode_pool.continuation_started(turn.holder, estimate)
        turn.decode = turn.holder
        self.decode_pool.leg_started(turn.decode)
        turn.ready_at = self.now + self.s.cost.leg_overhead_ms / 1e3
        self._admit(turn)

    def _host_continue(self, turn: Turn, host_tokens: int) -> bool:
        """The pin found the retention in the holder's host tier alone (``host_tokens`` of it):
        the turn continues there when ``plan_host_route`` allows it, the prefill leg undone
        (chosen and counted in flight; nothing was sent or computed). False: the prefill
        path, which recomputes the history."""
        assert turn.placement is not None and turn.holder is not None \
            and turn.prefill is not None
        route = routing.plan_host_route(self.plan, placement=turn.placement,
                                        holder=turn.holder, transcript=turn.transcript,
                                        host_tokens=host_tokens)
        if route is None:
            return False
        self.prefill_pool.leg_ended(turn.prefill)
        turn.prefill = None
        turn.where = route.where
        self._continue(turn, route.estimate)
        return True

    # The prefill leg.

    def _prefill(self, turn: Turn) -> None:
        s, bs = self.s, self.block_size
        prefill = turn.prefill
        assert prefill is not None
        sim = self._prefill_of[prefill.url]
        key, hashes = turn.conv.cid, turn.hashes
        pin = None
        decode = None
        host_hashes: tuple[bytes, ...] = ()
        placement = turn.placement
        # The router's pin decision, then its pin (the control call is the table's pin).
        plan = routing.plan_pin(self.plan, placement=placement, holder=turn.holder,
                                prefill=prefill, now=self.now)
        if plan.reason is not None:
            turn.reason = plan.reason
        if plan.pin:
            assert placement is not None and turn.holder is not None
            refused = routing.refuse_pin(placement, turn.holder)
            if refused is None:
                decode = self._decode_of[placement.decode]
                pin = decode.table.pin(key, s.router.pin_ttl_s)
                host_tokens = 0 if pin is not None else decode.host_tokens(key, bs)
                if host_tokens:
                    # The pin's 404 says the decode keeps the retention in its host tier
                    # alone: the record stays (its lease goes on), and the turn may run on
                    # that decode instead (router/_turn.py, _take_pin and _host_continue).
                    turn.reason = routing.gone_reuse(GoneReason.EVICTED)
                    if self._host_continue(turn, host_tokens):
                        return
                    # Not continued: the router pins it again with host_reads, and the
                    # prefill reads the history from the decode's host tier over NIXL.
                    host_hashes = decode.host_readable(key, bs)
                elif pin is None:
                    refused = routing.pin_gone(decode.table.gone_reason(key))
            if refused is not None:
                turn.reason = refused.reason
                if refused.drop is not None:
                    self.placements.pop(key, None)
        full = len(hashes)
        own = sim.cached_blocks(key, hashes)
        load_s = 0.0
        if sim.host is not None:
            held = sim.host.lookup(key, hashes)
            if held > own:
                load_s, own = self.s.host_load_s(held - own), held
        system = system_blocks(turn.conv, self.block_size)
        shared = min(sim.held_blocks(SHARED_SYSTEM), system, full) if system else 0
        local = max(own, shared) * bs
        offered = pin is not None or bool(host_hashes)
        turn.pinned = offered
        read_tokens = 0
        read_s = 0.0
        # What the prefill's connector reports (``kvturn.reuse``): its own hit, and what it read.
        report = ReuseReport(ReuseReason.MISS, 0, local)
        if offered:
            # A device pin's blocks, or a host-only retention's rows (ids: any distinct ones).
            retained = (pin[0].block_hashes, pin[0].readable_block_ids) if pin is not None \
                else (host_hashes, tuple(range(len(host_hashes))))
            decision = decide_reuse(
                prompt_hashes=hashes, local_hit_tokens=local,
                retained_hashes=retained[0],
                retained_block_ids=retained[1], block_size=bs,
                threshold=s.router.recompute_threshold, expired=False, engine_known=True,
                enabled=True, cost=self.decision_model.estimate)
            read_tokens = decision.num_tokens
            if decision.reused:
                read_s = self.cost_model.estimate(read_tokens, local).read_ms / 1e3
            declined = decision.cost.tokens if decision.cheaper_to_compute and decision.cost \
                else 0
            report = ReuseReport(decision.reason, read_tokens, local, declined)
        turn.prefill_report = report
        settled = routing.settle_prefill(
            report, read_offered=offered, pin_skipped=plan.skipped,
            prompt_tokens=turn.prompt, block_size=placement.block_size if placement else 0)
        if settled is not None:
            turn.reason = settled.reason
            if settled.learn is not None:
                self.prefill_pool.read_reported(
                    prefill, declined=settled.learn.declined_tokens,
                    reused=settled.learn.reused_tokens, now=self.now)
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
        self.prefill_pool.leg_ended(turn.prefill)
        target = routing.choose_decode(self.decode_pool, turn.holder,
                                       slack=self.s.router.decode_affinity_slack)
        assert target is not None
        turn.decode = target
        self.decode_pool.leg_started(target)
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
                load_s, verified = self.s.host_load_s(held - verified), held
        start = max(self.now, turn.ready_at) + load_s
        hit = max(system_blocks(turn.conv, bs), verified) * bs  # the system prompt is hot
        if turn.route is Route.DECODE:
            computed = max(1, turn.prompt - hit)
            turn.computed, turn.reused = computed, turn.prompt - computed
            turn.usage = DecodeUsage(turn.prompt, turn.conv.replies[turn.index],
                                     cached_tokens=turn.prompt - computed)
            if turn.where is TurnPath.CONTINUE:
                # What the decode's usage reports: its cache's coverage of the prompt, the
                # retention's or the plain prefix cache's (the router's TurnReport.settle).
                found = routing.settle_continued(
                    turn.usage, None,
                    turn.placement.block_size if turn.placement is not None else 0)
                if found is not None:
                    turn.reason = found.reason
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
            self.decode_pool.continuation_ended(turn.holder, turn.continued)
            turn.continued = 0
        self.recorder.turn(turn.conv, turn.index, ttft=self.now - turn.arrived,
                           prompt=turn.prompt, computed=turn.computed, reused=turn.reused,
                           reason=turn.reason, route=turn.route, when=self.now)

    def _decode_done(self, turn: Turn, decode: SimDecode) -> None:
        s, bs = self.s, self.block_size
        key = turn.conv.cid
        decode.live -= 1
        assert turn.decode is not None
        self.decode_pool.leg_ended(turn.decode)
        tokens = turn.prompt + turn.conv.replies[turn.index] - 1
        hashes = retained_block_hashes(turn, tokens, bs)
        lost_in_host = decode.keep_in_host(key, hashes)
        if self.plan.retain:
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
            moved_from = routing.moved_from(old, decode.name)
            if moved_from is not None:
                moved = self._decode_of[moved_from]
                moved.give_back(moved.table.release(key)[1])
            # The host tier's room for this copy may have cost other conversations theirs
            # (and this one its own, when too large to keep).
            decode.host_lost([*lost_in_host, key])
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
