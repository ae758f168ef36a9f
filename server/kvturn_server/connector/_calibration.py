"""Timing a prefill's engine steps and reads for its :class:`~._cost.CostModel`.

The scheduler side sees each step twice: when it is scheduled (``build_connector_meta``) and
when its output comes back (``update_connector_output``), and each read of retained KV when it
is decided and when the workers report it finished. This module turns those events, on a
clock, into the model's observations; it knows nothing of vLLM's types.

Steps. vLLM hands outputs back in the order steps were scheduled, with at most a few steps in
flight (two with async scheduling). A step's compute time is from when it could start (it was
scheduled, and the step before it had finished) to its output. Every step that computed tokens
reports back, but a step that computed none (all requests waiting for KV) reports only when a
transfer finished in it, so such steps are tracked only to keep the order: a report that could
belong either to such a step or to the computing step behind it is not used as an
observation. Steps with fewer than :data:`MIN_STEP_TOKENS` tokens are not observed either:
their per-step overhead would be charged to a handful of tokens.

Reads. The wait runs from the decision to read (the request is parked from then on) to the
report that the read finished; failed and abandoned reads are dropped. The first read from
each decode engine includes the NIXL handshake with it, once per engine's life, so it is not
observed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from kvturn_server.connector._cost import CostModel

MIN_STEP_TOKENS = 64
MAX_STEPS_IN_FLIGHT = 8
"""More than vLLM ever has in flight: past it the oldest is forgotten (a report that never
came), so that a lost report cannot make the queue grow."""


@dataclass(frozen=True, slots=True)
class _Step:
    scheduled: float
    chunks: tuple[tuple[int, int], ...]

    @property
    def tokens(self) -> int:
        return sum(n for n, _ in self.chunks)


@dataclass(frozen=True, slots=True)
class _Read:
    started: float
    tokens: int
    engine_id: str


class Calibration:
    """Feeds a :class:`CostModel` from scheduler events, on ``clock`` (seconds)."""

    def __init__(self, model: CostModel, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self._clock = clock
        self._steps: deque[_Step] = deque()
        self._last_report: float | None = None
        self._reads: dict[str, _Read] = {}
        self._engines_read: set[str] = set()

    # Steps.

    def step_scheduled(self, chunks: Iterable[tuple[int, int]]) -> None:
        """A step was scheduled to compute these ``(tokens, context)`` chunks (maybe none)."""
        self._steps.append(_Step(self._clock(), tuple((n, c) for n, c in chunks if n > 0)))
        while len(self._steps) > MAX_STEPS_IN_FLIGHT:
            self._steps.popleft()

    def step_reported(self) -> None:
        """The output of the oldest step in flight came back."""
        now = self._clock()
        previous, self._last_report = self._last_report, now
        idle = 0
        while self._steps and not self._steps[0].tokens:
            self._steps.popleft()
            idle += 1
        if not self._steps:
            return  # a step that computed nothing, or one scheduled before we were watching
        if idle:
            # This report may be the idle step's, and the computing step's still to come; or
            # the idle steps never reported. Either way its time is unknown.
            self._steps.popleft()
            return
        step = self._steps.popleft()
        start = step.scheduled if previous is None else max(step.scheduled, previous)
        if step.tokens >= MIN_STEP_TOKENS:
            self.model.observe_step(step.chunks, now - start)

    # Reads.

    def read_planned(self, req_id: str, tokens: int, engine_id: str) -> None:
        """``req_id`` will read ``tokens`` tokens from ``engine_id`` (replaces an earlier plan
        of the same request: vLLM may ask again before it can allocate)."""
        self._reads[req_id] = _Read(self._clock(), tokens, engine_id)

    def read_finished(self, req_ids: Iterable[str], failed: Collection[str] = ()) -> None:
        """The workers report these requests' reads done; ``failed`` ones did not load."""
        now = self._clock()
        for req_id in req_ids:
            read = self._reads.pop(req_id, None)
            if read is None or req_id in failed:
                continue
            if read.engine_id not in self._engines_read:
                self._engines_read.add(read.engine_id)
                continue
            self.model.observe_read(read.tokens, now - read.started)
        for req_id in failed:
            self._reads.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        """``req_id`` reads nothing (any more): re-planned without a read, or finished."""
        self._reads.pop(req_id, None)

    # NIXL's own transfer telemetry.

    def transfers(self, num_bytes: Sequence[float], seconds: Sequence[float]) -> None:
        """Transfers the workers completed since the last report (NIXL's stats lists)."""
        total_bytes, total_s = sum(num_bytes), sum(seconds)
        if total_bytes > 0 and total_s > 0:
            self.model.observe_transfer(total_bytes, total_s)
