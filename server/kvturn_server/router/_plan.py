"""A turn's decisions, apart from their effects: pure functions of what the router knows.

Each function takes typed facts (the conversation's record, the backends' counters, the
transcript, a prefill's reuse report, the current time as an argument) and returns a typed
decision; none does I/O, reads a clock, or changes a ``Backend``, a ``Pool`` or a record. The
router's ``Turn`` (``_turn.py`` with its steps ``_pin.py``, ``_decode_step.py`` and
``_capture.py``) executes the decisions: the calls, the headers, the metrics. The simulator
(``kvturn_server.sim``) runs the same functions through this package's face, so both decide
every turn alike (``tests/server/sim/test_sim_same_turns.py`` runs one script through both).

In a turn's order:

1. :func:`plan_probe`: whether to ask the decode what it still holds of a conversation whose
   retention is known gone; :func:`plan_route`: where the turn runs (:class:`TurnPath`): the
   decode that holds the conversation continues it alone (kvturn), the decode that served it
   runs it alone with nothing retained (stock conditional disaggregation), or a prefill leg
   then a decode leg (plain P/D, reading the decode's retention when pinned). A continuation
   that fails before its first byte falls back to the prefill path
   (:attr:`RoutePlan.fallback_reason`).
2. :func:`plan_pin`: whether the chosen prefill gets the retention pinned for it (a round trip
   to the decode, worth it only for what that prefill lacks), and what the turn reports when
   not; :func:`refuse_pin` and :func:`pin_gone`: a pin refused before or by the decode;
   :func:`plan_host_route`: a pin that found the retention in the decode's host tier alone
   (nothing a prefill could read on the device) may move the turn to that decode instead;
   otherwise the turn pins it again for a read of the decode's host tier (``_pin.py``).
3. :func:`plan_retry`: a failed prefill leg's second attempt, and what becomes of its pin.
4. :func:`settle_prefill` / :func:`settle_continued`: the reuse value the turn reports
   (``X-KVTurn-Reuse``), from the prefill's report or the decode's usage.
5. :func:`recorded_prefill` and :func:`moved_from`: what the turn's record says of the prefill,
   and which old retention the router releases once the record is written;
   :func:`lost_record`: the record after a keepalive found the retention gone;
   :func:`marked_lost`: the record after a decode's lost log named a retention dropped.

Which backend serves a leg is ``_placement.py``'s (``choose_prefill``, ``choose_decode``), and
the estimates behind the route (``continuation``, ``conditional_decode``, ``read_gain``) too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvturn.wire import GoneReason, ReuseReason, Route, gone_reason
from kvturn_server.router._history import Transcript
from kvturn_server.router._legs import (
    DecodeUsage,
    ReuseReport,
    continued_reuse,
    local_coverage,
)
from kvturn_server.router._placement import (
    conditional_decode,
    continuation,
    gone_from_lease,
    host_continuation,
    read_floor,
    read_gain,
)
from kvturn_server.router._pool import Backend
from kvturn_server.router._state import Placement

if TYPE_CHECKING:
    from kvturn_server.router._config import RouterConfig


@dataclass(frozen=True, slots=True)
class TurnPolicy:
    """The settings that decide a turn (the router's ``RouterConfig``, or a simulated policy).

    Attributes:
        reuse: kvturn's reuse for this turn: continuation by the holder, pins, reads (the
            router's ``kv_reuse``, unless the client opted out of it for this request).
        retain: the decode is asked to retain a keyed turn, and the router captures it (the
            router's ``kv_reuse``: a client's opt-out of reuse still leaves a retention).
        conditional_disagg: with ``reuse`` off, stock conditional disaggregation's threshold
            (0: off).
        decode_continue_tokens: the holder continues a turn that lacks at most this many tokens.
        decode_continue_budget: estimated tokens of continued turns one decode may hold at once.
        decode_continue_host_tokens: a turn whose retention its holder keeps in the host tier
            alone continues there when it lacks at most this many tokens, the holder's other
            continued turns included (:func:`plan_host_route`; 0: never).
        min_read_tokens: a pin must offer at least this many tokens beyond the prefill's own.
    """

    reuse: bool
    retain: bool
    conditional_disagg: int = 0
    decode_continue_tokens: int = 0
    decode_continue_budget: int = 0
    decode_continue_host_tokens: int = 0
    min_read_tokens: int = 1

    @classmethod
    def of(cls, config: RouterConfig, *, no_reuse: bool = False) -> TurnPolicy:
        return cls(reuse=config.kv_reuse and not no_reuse, retain=config.kv_reuse,
                   conditional_disagg=config.conditional_disagg,
                   decode_continue_tokens=config.decode_continue_tokens,
                   decode_continue_budget=config.decode_continue_budget,
                   decode_continue_host_tokens=config.decode_continue_host_tokens,
                   min_read_tokens=config.min_read_tokens)

    @property
    def reads_transcript(self) -> bool:
        """Whether a keyed turn's messages are measured (and recorded) for a later turn's
        estimate of what it adds."""
        return self.retain or self.conditional_disagg > 0


class TurnPath(enum.Enum):
    """The path a turn takes: where it runs."""

    CONTINUE = "continue"
    """The decode holding the conversation continues it alone: no pin, no prefill leg; its
    prefix cache supplies what it still holds (kvturn)."""
    DECODE_ONLY = "decode-only"
    """The decode that served the conversation runs it alone, nothing retained behind it
    (stock conditional disaggregation)."""
    PREFILL = "prefill"
    """A prefill leg, then a decode leg (plain P/D; the prefill reads the decode's retention
    when :func:`plan_pin` pins it)."""

    @property
    def route(self) -> Route:
        """The ``X-KVTurn-Route`` value while the turn runs there (``fallback`` is set when
        no prefill leg succeeds)."""
        return Route.PREFILL if self is TurnPath.PREFILL else Route.DECODE


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """Where a turn runs, and why not on the decode alone.

    Attributes:
        where: the path the turn takes first.
        estimate: a continued turn's estimated new tokens (held of the holder's
            ``decode_continue_budget`` until its first token).
        not_continued: why the decode that served the conversation does not run the turn
            alone (``continuation`` / ``conditional_decode``'s word, counted); None when there
            was no such decode to ask.
        reason: the reuse value the turn starts with (``disabled`` without reuse); None: the
            one it has (``miss``, or what locating the record found).
        fallback: the reuse value if the decode-alone attempt fails before its first byte,
            when not the path's own (:attr:`fallback_reason`).
    """

    where: TurnPath
    estimate: int = 0
    not_continued: str | None = None
    reason: ReuseReason | None = None
    fallback: ReuseReason | None = None

    @property
    def fallback_reason(self) -> ReuseReason | None:
        """The reuse value of a turn whose decode-alone attempt failed before its first byte
        and that takes the prefill path instead: ``miss`` after a continuation (it read
        nothing of what it expected), the same after a stock one (``disabled``); a host
        continuation's ``stale``, as the prefill path reports a host-only retention."""
        if self.fallback is not None:
            return self.fallback
        return ReuseReason.MISS if self.where is TurnPath.CONTINUE else None


NOT_CONTINUED_FAILED = "decode_failed"
"""``not_continued`` of a decode-alone attempt that failed before its first byte."""


def plan_probe(policy: TurnPolicy, *, placement: Placement | None, holder: Backend | None,
               transcript: Transcript | None, now: float) -> bool:
    """Whether to ask ``holder`` how much of the conversation it still holds (one control
    round trip) before :func:`plan_route`: only when its retention is known gone and the turn
    would continue on the decode if the history were still there."""
    if not policy.reuse or placement is None or holder is None \
            or gone_from_lease(placement, now) is None:
        return False
    _, why = conditional_decode(placement=placement, holder=holder, transcript=transcript,
                                max_tokens=policy.decode_continue_tokens)
    return not why


def plan_route(policy: TurnPolicy, *, placement: Placement | None, holder: Backend | None,
               transcript: Transcript | None, now: float,
               held: int | None = None) -> RoutePlan:
    """Where a turn runs, given the conversation's record and the decode it names (``now`` on
    the record's clock: a lease that ran out is known gone), and, for a retention known gone,
    what that decode said it still holds of the conversation (``held``: :func:`plan_probe`)."""
    reason = None if policy.reuse else ReuseReason.DISABLED
    if placement is None or holder is None:
        return RoutePlan(TurnPath.PREFILL, reason=reason)
    if not policy.reuse:
        if not policy.conditional_disagg:
            return RoutePlan(TurnPath.PREFILL, reason=reason)
        _, why = conditional_decode(placement=placement, holder=holder, transcript=transcript,
                                    max_tokens=policy.conditional_disagg)
        if why:
            return RoutePlan(TurnPath.PREFILL, not_continued=why, reason=reason)
        return RoutePlan(TurnPath.DECODE_ONLY, reason=reason)
    estimate, why = continuation(
        placement=placement, holder=holder, transcript=transcript, now=now,
        max_tokens=policy.decode_continue_tokens, budget=policy.decode_continue_budget,
        held=held)
    if why:
        return RoutePlan(TurnPath.PREFILL, not_continued=why)
    return RoutePlan(TurnPath.CONTINUE, estimate=estimate)


@dataclass(frozen=True, slots=True)
class PinPlan:
    """Whether a prefill leg gets the conversation's retention pinned for it.

    Attributes:
        pin: pin it (its params go to the prefill, which reads what it verifies and lacks).
        skipped: no pin because the prefill holds all the retention would add: the turn then
            reports its own cache's coverage (:func:`settle_prefill`).
        reason: the reuse value the turn reports without a pin (``below-threshold``, or why
            the decode said the retention is gone); None: unchanged.
    """

    pin: bool
    skipped: bool = False
    reason: ReuseReason | None = None


NO_PIN = PinPlan(False)


def plan_pin(policy: TurnPolicy, *, placement: Placement | None, holder: Backend | None,
             prefill: Backend | None, now: float) -> PinPlan:
    """A pin costs a round trip to the decode before the prefill leg: take it only when the
    retention holds at least ``min_read_tokens`` beyond what ``prefill`` holds, and more than
    that prefill lately declined to read (``now`` on the read floors' clock)."""
    if not policy.reuse or prefill is None or placement is None or holder is None:
        return NO_PIN
    if not placement.retained:
        # The decode serves the conversation but retains nothing to read; one it said it
        # dropped reports why, as a pin that found it gone would.
        return PinPlan(False, reason=None if placement.lost is None
                       else gone_reuse(gone_reason(placement.lost)))
    gain = read_gain(placement, prefill)
    if gain >= max(1, policy.min_read_tokens) and gain > read_floor(prefill, now):
        return PinPlan(True)
    return PinPlan(False, skipped=gain == 0, reason=ReuseReason.BELOW_THRESHOLD)


# Gone codes -> X-KVTurn-Reuse. "expired": the lease ran out. "stale": the handle pointed at
# blocks the decode no longer has (evicted, or forgotten: a restart). "miss": the retention was
# deliberately ended (released, or replaced by a newer turn this router did not record).
_GONE_REUSE = {
    GoneReason.EXPIRED: ReuseReason.EXPIRED,
    GoneReason.RELEASED: ReuseReason.MISS,
    GoneReason.REPLACED: ReuseReason.MISS,
    GoneReason.EVICTED: ReuseReason.STALE,
    GoneReason.NO_RETENTION: ReuseReason.STALE,
}


def gone_reuse(code: GoneReason) -> ReuseReason:
    """The X-KVTurn-Reuse value of a retention gone for ``code`` (a raw code from a peer
    or a stored record is read by ``kvturn.wire.gone_reason`` first)."""
    return _GONE_REUSE[code]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A pin not taken: what the turn reports, and whether the record it read is dropped.

    Attributes:
        reason: the reuse value.
        drop: the stale-handle count under which the record is forgotten (only the one this
            turn read); None: kept.
    """

    reason: ReuseReason
    drop: str | None = None


def refuse_pin(placement: Placement, holder: Backend) -> Refusal | None:
    """Before asking: a decode whose control endpoint is not trusted to speak for the engine
    behind it gets no pin; a record of another engine (the decode restarted) is stale."""
    if not holder.control_trusted or holder.control_url is None:
        return Refusal(ReuseReason.STALE)
    if holder.engine_id is not None and placement.engine_id is not None \
            and holder.engine_id != placement.engine_id:
        return Refusal(ReuseReason.STALE, "engine_changed")
    return None


def pin_gone(code: GoneReason) -> Refusal:
    """The decode answered that the retention is gone, for ``code``: the record is dropped,
    counted among the stale handles under that code."""
    return Refusal(gone_reuse(code), code)


def plan_host_route(policy: TurnPolicy, *, placement: Placement, holder: Backend,
                    transcript: Transcript | None, host_tokens: int) -> RoutePlan | None:
    """After a pin answered that ``holder`` keeps the retention in its host tier alone
    (``host_tokens`` of it from the start, nothing on the device for a prefill to read): the
    turn continues on ``holder``, which loads that history from host memory and computes the
    rest, when :func:`host_continuation` allows it; None: the prefill path, which recomputes
    the history (the record stays: the lease goes on in host memory). With continuation off
    (``decode_continue_tokens`` 0) the decode never runs a turn alone, this one neither."""
    if not policy.reuse or policy.decode_continue_tokens <= 0:
        return None
    estimate, why = host_continuation(placement=placement, holder=holder, transcript=transcript,
                                      host_tokens=host_tokens,
                                      max_tokens=policy.decode_continue_host_tokens)
    if why:
        return None
    return RoutePlan(TurnPath.CONTINUE, estimate=estimate,
                     fallback=gone_reuse(GoneReason.EVICTED))


@dataclass(frozen=True, slots=True)
class PrefillRetry:
    """A failed prefill leg's second attempt.

    Attributes:
        on: the prefill that takes it; None: no prefill leg, the decode computes the prompt.
        keep_pin: the first attempt timed out: that prefill may still be reading under its
            pin, so the pin is left to expire rather than freed.
        repin: the second attempt takes a new pin (never passing on params this turn did not
            just pin).
    """

    on: Backend | None
    keep_pin: bool
    repin: bool


def plan_retry(failed: str, first: Backend, other: Backend | None, *,
               pinned: bool) -> PrefillRetry:
    """After the first prefill attempt failed with ``failed`` (an attempt's failure kind),
    ``other`` being the prefill the policy would pick besides ``first``: a prefill that was
    never reached (``connect``) may take it again when it is the only one."""
    on = other if other is not None or failed != "connect" else first
    timed_out = failed == "timeout"
    return PrefillRetry(on, keep_pin=timed_out, repin=timed_out and pinned)


def gave_up_reason(pinned: bool) -> ReuseReason | None:
    """The reuse value of a turn no prefill leg served (route ``fallback``): ``stale`` when a
    retention was pinned for it (nothing of it was read); None: unchanged."""
    return ReuseReason.STALE if pinned else None


@dataclass(frozen=True, slots=True)
class Settled:
    """The reuse value a turn reports after its prefill leg.

    Attributes:
        reason: ``X-KVTurn-Reuse``.
        reused_tokens: ``X-KVTurn-Reused-Tokens``: read from the decode.
        learn: the report the prefill's read floor learns from (``Pool.read_reported``); None
            when it weighed no read.
    """

    reason: ReuseReason
    reused_tokens: int = 0
    learn: ReuseReport | None = None


def settle_prefill(report: ReuseReport | None, *, read_offered: bool, pin_skipped: bool,
                   prompt_tokens: int, block_size: int) -> Settled | None:
    """The prefill's own report when it was given a retention to read (``miss`` when it sent
    none); its cache's coverage of the prompt when the pin was skipped because it held all the
    retention offered; None when the router's reason stands (``miss``, ``disabled``,
    ``expired``, ``stale``, ``below-threshold``)."""
    if read_offered:
        if report is None:
            return Settled(ReuseReason.MISS)
        return Settled(report.reason, report.reused_tokens, learn=report)
    if pin_skipped:
        return Settled(local_coverage(report, prompt_tokens, block_size))
    return None


def settle_continued(usage: DecodeUsage | None, connector: ReuseReport | None,
                     block_size: int) -> ReuseReport | None:
    """The reuse value of a turn the decode continued alone (:attr:`TurnPath.CONTINUE`): what its
    own prefix cache supplied, by its usage (else its connector's count); None: still
    ``pending``. A stock decode-only turn keeps ``disabled``."""
    return continued_reuse(usage, connector, block_size)


def recorded_prefill(old: Placement | None, prefill: str | None,
                     prefill_tokens: int) -> tuple[str | None, int]:
    """The prefill a turn's record names, and its prompt tokens: the one that computed this
    turn's prefill leg, else (the decode ran it alone) the one recorded before."""
    if prefill is not None:
        return prefill, prefill_tokens
    if old is not None:
        return old.prefill, old.prefill_tokens
    return None, 0


def moved_from(old: Placement | None, decode: str) -> str | None:
    """The decode whose retention of the conversation is released once a turn's record on
    ``decode`` is written: the one the conversation moved from; None when it did not move."""
    if old is not None and old.decode != decode:
        return old.decode
    return None


# Gone codes after which the record keeps the decode and the prefill for affinity, marked lost
# (its blocks were freed: the next turn takes a prefill rather than continue on it, and later
# keepalives are answered without calling the decode). Released and replaced retentions are
# forgotten.
_KEPT_LOST = frozenset({GoneReason.EXPIRED, GoneReason.EVICTED, GoneReason.NO_RETENTION})


def lost_record(placement: Placement, code: GoneReason) -> Placement | None:
    """The record of a conversation whose decode answered a keepalive that its retention is
    gone for ``code``: kept, marked lost, or None: forgotten."""
    if code in _KEPT_LOST:
        return replace(placement, retained=False, lost=code)
    return None


def marked_lost(placement: Placement | None, *, decode: str, read_id: str,
                reason: GoneReason) -> Placement | None:
    """The record of a conversation after ``decode``'s lost log said it dropped the retention
    ``read_id`` on its own for ``reason`` (evicted, expired: ``_lost.py``): kept for affinity,
    marked lost, when that is the retention the record names (same decode, same read id, still
    retained); None when the entry is not this record's (no record, another decode's, a newer
    retention under the same key, or one already known not to be retained)."""
    if placement is None or placement.decode != decode or placement.read_id != read_id \
            or not placement.retained:
        return None
    return replace(placement, retained=False, lost=reason)
