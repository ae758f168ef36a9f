"""Run a function on the engine thread soon, also when the engine is idle.

Block frees must happen on vLLM's engine thread. While requests run, the scheduler hooks call
the keeper every step; but an idle engine blocks on its input queue and calls nothing, so a
release or an expiry would hold its blocks until the next request. vLLM's busy loop has a seam
for exactly "run this on the engine thread when idle": ``EngineCore._idle_state_callbacks``,
drained by the idle loop, plus the ``WAKEUP`` input that unblocks it. The connector finds its
engine while the engine is constructing the scheduler (the only time both are on the stack).
``tests/server/test_vllm_contract.py`` pins these internals.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvturn.connector")


class EngineWaker:
    """Schedules one pending call of ``work`` on the engine thread at a time."""

    def __init__(self, engine: Any | None, work: Callable[[], None]) -> None:
        self._engine = weakref.ref(engine) if engine is not None else None
        self._work = work
        self._pending = threading.Event()

    @classmethod
    def from_stack(cls, work: Callable[[], None]) -> EngineWaker:
        """Find the EngineCore under construction on the calling thread's stack."""
        try:
            from vllm.v1.engine.core import EngineCore
        except ImportError:  # pragma: no cover - vLLM always has it
            return cls(None, work)
        frame = sys._getframe(1)
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, EngineCore):
                return cls(candidate, work)
            frame = frame.f_back  # type: ignore[assignment]
        log.warning("kvturn: engine not found; frees of released or expired retentions wait "
                    "for the next request")
        return cls(None, work)

    @property
    def attached(self) -> bool:
        return self._engine is not None and self._engine() is not None

    def wake(self) -> bool:
        """Ask the engine thread to run ``work`` soon; False when no engine is attached."""
        engine = self._engine() if self._engine is not None else None
        if engine is None:
            return False
        if self._pending.is_set():
            return True
        callbacks = getattr(engine, "_idle_state_callbacks", None)
        queue = getattr(engine, "input_queue", None)
        if callbacks is None or queue is None:
            return False
        from vllm.v1.engine import EngineCoreRequestType

        self._pending.set()
        callbacks.append(self._run)  # list.append is atomic; the engine pops on its thread
        queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
        return True

    def _run(self, engine: Any) -> None:
        self._pending.clear()
        try:
            self._work()
        except Exception:  # never let kvturn's housekeeping take the engine down
            log.exception("kvturn: retention service on the engine thread failed")


class Housekeeper:
    """Wakes the engine when the retention table has something due (expiry, lapsed pin)."""

    def __init__(self, due: Callable[[], bool], waker: EngineWaker,
                 interval: float = 1.0) -> None:
        self._due = due
        self._waker = waker
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvturn-housekeeper",
                                        daemon=True)

    def start(self) -> Housekeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                if self._due():
                    self._waker.wake()
            except Exception:
                log.exception("kvturn: housekeeping check failed")
