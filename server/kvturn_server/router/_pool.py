"""Backend pools: which prefill and decode instances are usable, and which one gets a request.

- **Choice**: a prefill by load (fewest in-flight requests, ties in turn); a decode by affinity
  to the conversation's holder when that one is healthy, else by load.
- **Ejection**: ``eject_after`` consecutive failures eject a backend. Failures are active
  health checks that fail and legs that fail at the transport level (refused, timed out, broken
  off) or answer 502/503/504; a 500 or 4xx is about the request, and counting it would let a
  client eject backends with crafted requests.
- **Re-admission**: an ejected backend keeps being checked; ``readmit_after`` consecutive good
  checks put it back.
- **Control endpoint**: a decode whose control endpoint fails is still used for decoding, but
  gets no pins or captures until its control endpoint answers again (a hanging one would
  otherwise cost every turn a control timeout).
- **One engine behind both**: a decode's control endpoint is trusted only while it speaks for
  the engine behind its HTTP endpoint (:attr:`Backend.control_trusted`): the HTTP side's last
  health check or leg succeeded, and the engine id its replies name (``kv_transfer_params``)
  is the one the control endpoint names. vLLM's engine core, which serves the control
  endpoint and the NIXL reads, outlives a killed API server for minutes: without this the
  router would pin, and prefills read, blocks of a server that can no longer answer.

Every change of a backend's state is one of :class:`Pool`'s event methods (a leg started or
ended, a leg or check succeeded or failed, the control endpoint answered or failed, an engine
named, a continuation started or ended, a prefill's reuse reported): a ``Backend`` is what the
router knows, read anywhere, written only here. The pool owns the changes, not the backend,
because the health ones need the pool's thresholds (``eject_after``, ``readmit_after``) and
its role in their log lines, and every caller that learns something of a backend (a turn's
steps through ``TurnServices``, the health checker, the simulator) holds its pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator

from kvturn_server.router._backend import BackendClient, BackendError
from kvturn_server.router._control import ControlClient
from kvturn_server.router._log import event

log = logging.getLogger("kvturn.router")


READ_FLOOR_TTL = 60.0
"""Seconds a prefill's declined range keeps the router from pinning for no more than it: its
cost model calibrates as load changes, so the router asks again after this."""

# Control call failures that say the endpoint is unusable (others are about the call).
_CONTROL_DOWN = frozenset({"connect", "timeout", "unauthorized"})


class Backend:
    """One vLLM instance and what the router knows about it (changed only by its
    :class:`Pool`'s event methods)."""

    __slots__ = ("continuing", "control_engine_id", "control_ok", "control_url", "engine_id",
                 "failures", "healthy", "http_down", "http_engine_id", "in_flight", "last_error",
                 "read_floor", "read_floor_at", "role", "successes", "url")

    def __init__(self, role: str, url: str, control_url: str | None = None) -> None:
        self.role = role
        self.url = url
        self.control_url = control_url
        self.healthy = True
        self.control_ok = True
        self.in_flight = 0
        # Estimated prompt tokens of turns this decode continues itself, until their first
        # token (``_placement.py``).
        self.continuing = 0
        # Prefills: the largest range its cost model lately declined to read (cheaper to
        # compute), and when; a pin for no more than that is a wasted round trip.
        self.read_floor = 0
        self.read_floor_at = 0.0
        self.failures = 0
        self.successes = 0
        # The HTTP side's last health check failed, or a leg found nothing listening: the
        # server may be gone while its engine core (and control endpoint) lives on.
        self.http_down = False
        # The engine the router takes to be behind this decode (from either side, the
        # freshest); then what each side itself last named: the control endpoint (health
        # checks, pin and describe answers) and the HTTP endpoint (its replies' params).
        self.engine_id: str | None = None
        self.control_engine_id: str | None = None
        self.http_engine_id: str | None = None
        self.last_error: str | None = None

    def __repr__(self) -> str:
        return f"Backend({self.role} {self.url}{'' if self.healthy else ', ejected'})"

    @property
    def control_trusted(self) -> bool:
        """Whether pins, captures and keepalives may go to this decode's control endpoint:
        it answers, the HTTP side is up (not ejected, last check passed, no refused connection
        since), and both sides name the same engine where both have named one."""
        if self.control_url is None or not self.control_ok or not self.healthy \
                or self.http_down:
            return False
        return self.http_engine_id is None or self.control_engine_id is None \
            or self.http_engine_id == self.control_engine_id

    def distrust_reason(self) -> str:
        """Why :attr:`control_trusted` is False (for logs)."""
        if self.control_url is None:
            return "no control endpoint"
        if not self.control_ok:
            return "control endpoint not answering"
        if not self.healthy or self.http_down:
            return f"HTTP endpoint down ({self.last_error})"
        return (f"HTTP endpoint names engine {self.http_engine_id}, control endpoint "
                f"{self.control_engine_id}")


class Pool:
    """The backends of one role."""

    def __init__(self, role: str, members: list[Backend], *, eject_after: int,
                 readmit_after: int, discovered: bool = False) -> None:
        if not members and not discovered:
            raise ValueError(f"a {role} pool needs at least one backend")
        self.role = role
        self.members = members
        self.eject_after = eject_after
        self.readmit_after = readmit_after
        self._by_url = {b.url: b for b in members}
        self._next = 0

    def by_url(self, url: str) -> Backend | None:
        return self._by_url.get(url)

    def add(self, backend: Backend) -> None:
        """A backend joins (``_discovery.py``)."""
        self.members.append(backend)
        self._by_url[backend.url] = backend

    def remove(self, backend: Backend) -> None:
        """A backend leaves: no new requests; those in flight hold the backend itself and
        finish (``_discovery.py``)."""
        if self._by_url.get(backend.url) is backend:
            del self._by_url[backend.url]
            self.members.remove(backend)

    @property
    def healthy(self) -> list[Backend]:
        return [b for b in self.members if b.healthy]

    def pick(self, *, prefer: Backend | None = None,
             exclude: Backend | None = None) -> Backend | None:
        """``prefer`` if it is healthy, else the healthy backend with the fewest requests in
        flight (ties go round). When every backend (other than ``exclude``) is ejected, the
        least loaded ejected one: trying a backend that may have come back costs one fast
        failure, refusing the request costs the request (a pool that just started, or that
        lost its health checks, would otherwise refuse everything until re-admission). None
        only when there is no other backend at all."""
        if prefer is not None and prefer.healthy and prefer is not exclude:
            return prefer
        candidates = [b for b in self.members if b.healthy and b is not exclude] or \
            [b for b in self.members if b is not exclude]
        if not candidates:
            return None
        load = min(b.in_flight for b in candidates)
        best = [b for b in candidates if b.in_flight == load]
        self._next += 1
        return best[self._next % len(best)]

    def pick_in_turn(self, *, exclude: Backend | None = None) -> Backend | None:
        """The next healthy backend in a fixed rotation, whatever its load (vLLM's example
        proxy); the ejected ones only when none is healthy, as in :meth:`pick`."""
        candidates = [b for b in self.members if b.healthy and b is not exclude] or \
            [b for b in self.members if b is not exclude]
        if not candidates:
            return None
        self._next += 1
        return candidates[self._next % len(candidates)]

    # Requests in flight.

    def leg_started(self, backend: Backend) -> None:
        """A leg was sent to ``backend``: it counts in flight until :meth:`leg_ended`."""
        backend.in_flight += 1

    def leg_ended(self, backend: Backend) -> None:
        """A leg :meth:`leg_started` on ``backend`` ended (answered, failed or relayed)."""
        backend.in_flight -= 1

    @contextlib.contextmanager
    def lease(self, backend: Backend) -> Iterator[None]:
        """Count a leg in flight on ``backend`` for the duration of the block."""
        self.leg_started(backend)
        try:
            yield
        finally:
            self.leg_ended(backend)

    def continuation_started(self, backend: Backend, tokens: int) -> None:
        """The decode continues a turn alone, ``tokens`` estimated new tokens of it: they
        count against its ``decode_continue_budget`` until :meth:`continuation_ended`."""
        backend.continuing += tokens

    def continuation_ended(self, backend: Backend, tokens: int) -> None:
        """A continued turn's prompt is computed (first token out) or abandoned."""
        backend.continuing = max(0, backend.continuing - tokens)

    # What a prefill's reuse reports teach (its read floor).

    def read_reported(self, backend: Backend, *, declined: int, reused: int,
                      now: float) -> None:
        """A prefill reported its reuse: a declined range raises its read floor (the most
        its cost model lately found cheaper to compute than to read), a read lowers it below
        what was read. A floor older than :data:`READ_FLOOR_TTL` counts as none."""
        if declined > 0:
            fresh = now - backend.read_floor_at < READ_FLOOR_TTL
            backend.read_floor = max(backend.read_floor if fresh else 0, declined)
            backend.read_floor_at = now
        elif reused > 0 and backend.read_floor >= reused:
            backend.read_floor = reused - 1

    # The control endpoint and the engine behind a decode.

    def control_answered(self, backend: Backend, engine_id: str | None = None) -> None:
        """The decode's control endpoint answered (a health check, pin or describe), naming
        ``engine_id`` as its engine when it did."""
        backend.control_ok = True
        if engine_id is not None:
            backend.control_engine_id = engine_id

    def control_failed(self, backend: Backend, kind: str | None = None) -> bool:
        """A control call failed with ``kind`` (a ``ControlError``'s), or a health check
        found the endpoint unusable (None). Unreachable, too slow or refusing this router's
        secret, it gets no pins or captures until a check finds it answering again; other
        failures are about the call. Returns whether this took it out of use."""
        if kind is not None and kind not in _CONTROL_DOWN:
            return False
        was_ok, backend.control_ok = backend.control_ok, False
        return was_ok

    def engine_seen(self, backend: Backend, engine_id: str) -> bool:
        """The decode named the engine behind it (its control endpoint's health answer, or a
        retention it reported): True when that is another engine than the router took it to
        be. A new engine answered, and its control endpoint lives in the same process: an
        outage the health checks saw was the restart, so the endpoint is trusted again."""
        if engine_id == backend.engine_id:
            return False
        backend.engine_id = engine_id
        backend.control_ok = True
        return True

    def http_engine_seen(self, backend: Backend, engine_id: str) -> None:
        """A reply of the decode's HTTP endpoint named its engine (its transfer params)."""
        backend.http_engine_id = engine_id

    # Outcomes of legs (passive) and checks (active).

    def leg_succeeded(self, backend: Backend) -> None:
        """A real request went through: stronger evidence than a health check, so an ejected
        backend is back at once (else a decode that restarted between two checks would be
        skipped, and its conversations called stale, until two more checks passed)."""
        backend.failures = 0
        backend.http_down = False
        if not backend.healthy:
            backend.healthy = True
            backend.successes = 0
            event(log, logging.INFO, "backend_readmitted", role=self.role, backend=backend.url,
                  by="request")

    def leg_failed(self, backend: Backend, why: str, *, refused: bool = False) -> None:
        """``refused``: nothing listened (connection refused), the server is gone."""
        if refused:
            self._down(backend)
        self._failed(backend, why)

    def check_passed(self, backend: Backend) -> None:
        backend.failures = 0
        backend.http_down = False
        if backend.healthy:
            return
        backend.successes += 1
        if backend.successes >= self.readmit_after:
            backend.healthy = True
            backend.successes = 0
            event(log, logging.INFO, "backend_readmitted", role=self.role, backend=backend.url)

    def check_failed(self, backend: Backend, why: str) -> None:
        backend.successes = 0
        self._down(backend)
        self._failed(backend, why)

    @staticmethod
    def _down(backend: Backend) -> None:
        backend.http_down = True
        # Whatever answers next on the HTTP side may be another engine (a restart): what it
        # named before is no longer known.
        backend.http_engine_id = None

    def _failed(self, backend: Backend, why: str) -> None:
        backend.last_error = why
        backend.failures += 1
        if backend.healthy and backend.failures >= self.eject_after:
            backend.healthy = False
            backend.successes = 0
            event(log, logging.WARNING, "backend_ejected", role=self.role, backend=backend.url,
                  failures=backend.failures, last_error=why)


class HealthChecker:
    """Active checks of every backend, every ``interval`` seconds (also on ``poke``).

    Prefills and decodes answer vLLM's ``GET /health``; a decode's control endpoint answers
    ``GET /health`` with its ``engine_id``, which changes when the decode restarts (and makes
    every handle to its old retentions stale).
    """

    def __init__(self, client: BackendClient, control: ControlClient, pools: list[Pool], *,
                 interval: float,
                 timeout: float, on_engine_change: Callable[[Backend, str | None, str], None],
                 also: Callable[[], Awaitable[None]] | None = None) -> None:
        self.client = client
        self.control = control
        self.pools = pools
        self.interval = interval
        self.timeout = timeout
        self.on_engine_change = on_engine_change
        self.also = also
        self.rounds = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="kvturn-health")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    @property
    def running(self) -> bool:
        """Whether checks run in the background (``start``ed, not ``stop``ped)."""
        return self._task is not None

    def poke(self) -> None:
        """Run the next round now."""
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            try:
                await self.check_all()
                if self.also is not None:
                    await self.also()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one round must not end health checking
                log.exception("health check round failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
            self._wake.clear()

    async def check_all(self) -> None:
        """One round: every backend, concurrently."""
        await asyncio.gather(*(self._check(pool, b) for pool in self.pools
                               for b in pool.members))
        self.rounds += 1

    async def _check(self, pool: Pool, backend: Backend) -> None:
        try:
            reply = await self.client.call("GET", backend.url + "/health", timeout=self.timeout)
        except BackendError as exc:
            pool.check_failed(backend, f"health check: {exc}")
        else:
            if reply.status == 200:
                pool.check_passed(backend)
            else:
                pool.check_failed(backend, f"health check answered {reply.status}")
        if backend.control_url is not None:
            await self.check_control(backend)

    async def check_control(self, backend: Backend) -> None:
        """Ask the decode's control endpoint which engine it is (also outside a round)."""
        assert backend.control_url is not None
        pool = self._pool_of(backend)
        try:
            reply = await self.control.health(backend.control_url, timeout=self.timeout)
            info = reply.json() if reply.status == 200 else None
        except (BackendError, ValueError) as exc:
            if pool.control_failed(backend):
                event(log, logging.WARNING, "control_unreachable", backend=backend.url,
                      control=backend.control_url, error=str(exc))
            return
        engine_id = info.get("engine_id") if isinstance(info, dict) else None
        if not isinstance(engine_id, str):
            if pool.control_failed(backend):
                event(log, logging.WARNING, "control_unusable", backend=backend.url,
                      control=backend.control_url, status=reply.status,
                      why="a missing or wrong control secret" if reply.status == 401
                      else "no engine id in its /health answer")
            return
        pool.control_answered(backend, engine_id)
        old = backend.engine_id
        if pool.engine_seen(backend, engine_id):
            self.on_engine_change(backend, old, engine_id)

    def _pool_of(self, backend: Backend) -> Pool:
        """The pool of ``backend``'s role (one per role), whose events it reports to."""
        return next(pool for pool in self.pools if pool.role == backend.role)


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Stop a background loop (health checks, discovery) and wait until it has stopped."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
