"""What the agent benchmarks read from the instances while agents run: a decode's retained bytes,
samples taken in a background thread, the wait until one run's leases are gone, and the load
average around a run."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

from kvturn.wire import STATS_PATH


def loadavg() -> tuple[float, ...]:
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        return ()


def retained_bytes(control_url: str) -> int | None:
    """What a decode retains (``retention.held_bytes`` of its control endpoint's
    ``/kvturn/v1/stats``); None where it cannot be read."""
    from kvturn_server.local import control

    try:
        status, stats = control(control_url, "GET", STATS_PATH, timeout=5.0)
    except (OSError, ValueError):
        return None
    retention = stats.get("retention") if status == 200 else None
    if not isinstance(retention, dict) or "held_bytes" not in retention:
        return None
    return int(retention["held_bytes"])


async def wait_released(held: Callable[[], int | None], timeout: float,
                        sleep: Callable[[float], Awaitable[None]],
                        clock: Callable[[], float]) -> int | None:
    """Wait (up to ``timeout``) until ``held()`` (the decodes' retained bytes, read in a thread)
    is nothing, so that one run's leases do not show in the next run's samples; returns what
    they still hold."""
    deadline = clock() + timeout
    while True:
        value = await asyncio.to_thread(held)
        if not value or clock() >= deadline:
            return value
        await sleep(0.25)


class _Timed(Protocol):
    @property
    def t_s(self) -> float: ...


S = TypeVar("S", bound=_Timed)


class PeriodicSampler(Generic[S]):
    """Takes a sample (``read()``, which a subclass defines) every ``interval`` seconds in a
    daemon thread, once at ``start()`` and once more at ``stop()`` (so a run always has its
    first and last point)."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.perf_counter,
                 name: str = "kvturn-bench-sampler") -> None:
        self.interval = interval
        self.clock = clock
        self.name = name
        self.samples: list[S] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = 0.0

    def read(self) -> S:
        """One sample, stamped with ``elapsed()`` where the reading is taken."""
        raise NotImplementedError

    def elapsed(self) -> float:
        """Seconds since ``start()``'s ``t0``."""
        return round(self.clock() - self.t0, 4)

    def sample(self) -> S:
        point = self.read()
        with self._lock:
            self.samples.append(point)
        return point

    def latest(self) -> S | None:
        with self._lock:
            return self.samples[-1] if self.samples else None

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.sample()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> list[S]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.sample()
        with self._lock:
            return sorted(self.samples, key=lambda s: s.t_s)
