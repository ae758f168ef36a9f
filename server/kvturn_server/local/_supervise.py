"""Supervision of the local stack's members: a member that dies is cleaned up and restarted.

Cleaned up means its whole process group: vLLM's API server is only the group's leader, and its
engine core and worker processes outlive a ``kill -9`` of it for minutes, still holding the
control and NIXL ports (the control endpoint and the KV live in the engine core). Until they are
gone the member cannot start again on its ports, and a router would keep reaching a server that
can no longer answer. So: SIGTERM the group, SIGKILL what is left after a grace, wait until the
member's ports are free, wait out a backoff, launch the same command line again, wait for health.

The backoff doubles per consecutive restart (``Backoff``), from ``initial`` to ``maximum``
seconds, and starts over once a member stayed up ``stable_after`` seconds. Every step is one
line on ``say`` (stderr for ``kvturn up``) and in the member's own log.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from subprocess import Popen
from typing import Protocol

from kvturn_server.local._process import (
    ServerSpec,
    StackError,
    launch,
    port_is_free,
    stop_group,
    wait_healthy,
)

Say = Callable[[str], None]


@dataclass(frozen=True)
class Backoff:
    """Seconds to wait before a member's n-th consecutive restart."""

    initial: float = 1.0
    maximum: float = 60.0
    stable_after: float = 120.0

    def delay(self, restarts: int) -> float:
        return float(min(self.initial * 2 ** max(restarts - 1, 0), self.maximum))


class Members(Protocol):
    """What the supervisor needs of a stack: its members, under one lock (``Stack``)."""

    lock: threading.RLock

    def member_procs(self) -> Mapping[str, tuple[ServerSpec, Popen[bytes]]]: ...

    def replace_member(self, name: str, proc: Popen[bytes]) -> None: ...

    @property
    def die_with_parent(self) -> bool: ...

    @property
    def startup_timeout(self) -> float: ...


class _Stopping(Exception):
    """The supervisor is being stopped while it waits."""


def describe_exit(code: int) -> str:
    """``-9`` -> ``"killed by SIGKILL"``; ``3`` -> ``"with code 3"``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"with code {code}"


def wait_ports_free(host: str, ports: Iterable[int], *, timeout: float,
                    stopping: threading.Event | None = None) -> list[int]:
    """Wait until nothing listens on ``ports``; return those still busy after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        busy = [p for p in ports if not port_is_free(host, p)]
        if not busy or time.monotonic() > deadline:
            return busy
        if stopping is not None and stopping.wait(0.2):
            raise _Stopping
        if stopping is None:
            time.sleep(0.2)


class Supervisor:
    """A thread that restarts the members of ``members`` that exit on their own."""

    def __init__(self, members: Members, *, backoff: Backoff | None = None, interval: float = 0.5,
                 group_grace: float = 5.0, say: Say | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.members = members
        self.backoff = backoff or Backoff()
        self.interval = interval
        self.group_grace = group_grace
        self.say = say or (lambda line: None)
        self.clock = clock
        self.restarts: dict[str, int] = {}  # consecutive restarts per member
        self.total_restarts = 0
        self._started_at: dict[str, float] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Supervisor:
        now = self.clock()
        for name in self.members.member_procs():
            self._started_at[name] = now
        self._thread = threading.Thread(target=self._run, name="kvturn-supervisor",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop supervising (waits for a restart in progress to notice)."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                self.check_once()
            except _Stopping:
                return
            except Exception as exc:  # a bug here must not end supervision
                self.say(f"kvturn supervisor: check failed: {type(exc).__name__}: {exc}")

    def check_once(self) -> None:
        """Restart every member found exited (one after the other)."""
        with self.members.lock:
            dead = [(name, spec, proc, code) for name, (spec, proc)
                    in self.members.member_procs().items()
                    if (code := proc.poll()) is not None]
        for name, spec, proc, code in dead:
            if self._stopping.is_set():
                return
            self._recover(name, spec, proc, code)

    def _note(self, spec: ServerSpec, line: str) -> None:
        self.say(line)
        try:
            with open(spec.log_path, "a", encoding="utf-8") as log:
                log.write(f"\n=== {line}\n")
        except OSError:
            pass

    def _recover(self, name: str, spec: ServerSpec, proc: Popen[bytes], code: int) -> None:
        now = self.clock()
        if now - self._started_at.get(name, now) >= self.backoff.stable_after:
            self.restarts[name] = 0
        count = self.restarts[name] = self.restarts.get(name, 0) + 1
        delay = self.backoff.delay(count)
        self._note(spec, f"kvturn: {name} (pid {proc.pid}) exited {describe_exit(code)}; "
                         f"stopping its process group and restarting it in {delay:g} s "
                         f"(restart {count} in a row)")
        t0 = time.monotonic()
        # The group outlives its leader: vLLM's engine core and workers hold the ports.
        stop_group(proc.pid, grace=self.group_grace)
        ports = (spec.port, *spec.other_ports)
        busy = wait_ports_free(spec.host, ports, timeout=30.0, stopping=self._stopping)
        self._note(spec, f"kvturn: {name}: process group {proc.pid} gone after "
                         f"{time.monotonic() - t0:.1f} s"
                         + (f"; ports {busy} still busy" if busy else "; its ports are free"))
        if self._stopping.wait(delay):
            return
        with self.members.lock:
            if self._stopping.is_set():
                return
            current = self.members.member_procs().get(name)
            if current is None or current[1] is not proc:
                return  # restarted or removed meanwhile (Stack.restart)
            new = launch(spec, die_with_parent=self.members.die_with_parent)
            self.members.replace_member(name, new)
            self._started_at[name] = self.clock()
            self.total_restarts += 1

        def progress(elapsed: float, ready: list[str], waiting: list[str]) -> None:
            if self._stopping.is_set():
                raise _Stopping

        try:
            seconds = wait_healthy({name: (spec, new)}, timeout=self.members.startup_timeout,
                                   progress=progress)
        except StackError as exc:
            first = str(exc).splitlines()[0]
            self._note(spec, f"kvturn: {name} did not come back: {first}")
            if new.poll() is None:
                stop_group(new.pid, grace=self.group_grace)  # the next check restarts it
            return
        self._note(spec, f"kvturn: {name} healthy again after {seconds:.0f} s (pid {new.pid})")
