"""Heartbeats: renew a conversation's lease on an interval while its agent runs a tool.

One loop per conversation at most: ``pause()`` blocks that overlap (nested, or concurrent in
several threads or tasks) hold the same heartbeat, which starts with the first and stops with
the last. The loop never raises: ``renew`` is expected to log and count its own failures, and
anything that still escapes is logged here, because a missed renewal only lets a lease expire
while an exception would break the user's tool call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

log = logging.getLogger("kvturn")


class Heartbeat:
    """Sync heartbeat: a daemon thread waiting on an ``Event`` between renewals.

    Each run gets its own ``Event``, so a pause that starts while the previous run's thread is
    still finishing a renewal never revives or stops the wrong loop.
    """

    def __init__(self, renew: Callable[[], None], interval: float, name: str) -> None:
        if interval <= 0:
            raise ValueError(f"keepalive interval must be positive, got {interval}")
        self._renew = renew
        self._interval = interval
        self._name = name
        self._lock = threading.Lock()
        self._holders = 0
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def hold(self) -> None:
        with self._lock:
            self._holders += 1
            if self._holders > 1:
                return
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._stop,),
                                            name=self._name, daemon=True)
            self._thread.start()

    def release(self) -> None:
        with self._lock:
            self._holders = max(self._holders - 1, 0)  # stop() may have zeroed it meanwhile
            if self._holders > 0 or self._stop is None:
                return
            # Not joined: a renewal in flight may take up to its timeout, and the tool's caller
            # must not wait for it. The thread exits as soon as that renewal returns.
            self._stop.set()
            self._stop = None

    def stop(self) -> None:
        """Stop the loop whatever the holders (the conversation is closing)."""
        with self._lock:
            self._holders = 0
            if self._stop is not None:
                self._stop.set()
                self._stop = None

    @property
    def running(self) -> bool:
        with self._lock:
            return self._stop is not None

    def join(self, timeout: float) -> bool:
        """Wait for the last loop's thread to end; True when it has (for tests and shutdown)."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self._interval):
            try:
                self._renew()
            except Exception:  # renew() counts its own failures; this is the last guard
                log.exception("kvturn: keepalive loop %s: renewal failed", self._name)


class AsyncHeartbeat:
    """Async heartbeat: one asyncio task sleeping between renewals, cancelled by the last exit."""

    def __init__(self, renew: Callable[[], Awaitable[None]], interval: float, name: str) -> None:
        if interval <= 0:
            raise ValueError(f"keepalive interval must be positive, got {interval}")
        self._renew = renew
        self._interval = interval
        self._name = name
        self._holders = 0
        self._task: asyncio.Task[None] | None = None

    def hold(self) -> None:
        self._holders += 1
        if self._holders == 1:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def release(self) -> None:
        self._holders = max(self._holders - 1, 0)  # stop() may have zeroed it meanwhile
        if self._holders == 0:
            await self._cancel()

    async def stop(self) -> None:
        self._holders = 0
        await self._cancel()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _cancel(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        # asyncio.wait, not `await task`: it does not raise the task's CancelledError, so it
        # cannot swallow a cancellation of the caller itself, which still propagates.
        await asyncio.wait([task])

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self._renew()
            except Exception:
                log.exception("kvturn: keepalive loop %s: renewal failed", self._name)
