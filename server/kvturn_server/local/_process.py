"""Child processes of the local stack: launch, health-wait with progress, stop."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


class StackError(RuntimeError):
    """The local stack could not be started, reached or stopped."""


@dataclass(frozen=True)
class ServerSpec:
    """One server of the stack: how to start it and how to tell it is ready."""

    name: str
    argv: Sequence[str]
    port: int
    health_url: str
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    other_ports: tuple[int, ...] = ()
    """Ports it binds besides ``port`` (NIXL side channel, control endpoint): a restart waits
    until they are free."""
    host: str = "127.0.0.1"
    """The address ``port`` and ``other_ports`` are bound on (each member of a stack may have
    its own, as each host of a fleet does)."""


def http_url(host: str, port: int) -> str:
    """The URL of a server listening on ``host``:``port`` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Listening:
    """A mixin for a member that listens on ``host``:``port``: its ``url``."""

    host: str
    port: int

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel sends SIGTERM when the parent dies,
    # so servers started by tests never outlive a killed test run.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def launch(spec: ServerSpec, *, die_with_parent: bool) -> subprocess.Popen[bytes]:
    """Start ``spec`` in its own process group, output appended to its log file."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(spec.env)
    with open(spec.log_path, "ab") as log:
        log.write(f"\n=== kvturn: starting {spec.name}: {' '.join(spec.argv)}\n".encode())
        log.flush()
        return subprocess.Popen(
            list(spec.argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            # Own process group (so stop_group reaches vLLM's engine and worker children) but
            # the caller's session: a new session is a new scheduler autogroup on Linux, and
            # prefill and decode in separate autogroups starve each other's NIXL transfers on
            # small hosts (docs/cpu-stack.md, "stalled transfers").
            process_group=0,
            preexec_fn=_die_with_parent if die_with_parent and sys.platform == "linux" else None,
        )


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


# Ports handed out by this process: a port stays free until its server binds it, so without
# this two calls in a row could return the same one.
_handed_out: set[int] = set()
_LOWEST_PORT = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing listens on right now (for tests and ad-hoc stacks), below the
    kernel's ephemeral range. A port from that range (what binding port 0 gives) can be taken by
    any socket bound to port 0 before our server binds it, and UCX in every NIXL worker binds
    dozens: measured, a prefill's NIXL handshake port taken by the decode's UCX at start-up, and
    the prefill never became healthy."""
    low, high = _ephemeral_range()
    candidates = range(_LOWEST_PORT, low) if low - _LOWEST_PORT >= 1000 else range(high + 1, 65536)
    rng = random.SystemRandom()
    for _ in range(200 if candidates else 0):
        port = rng.choice(candidates)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise StackError(f"no free port on {host} in {candidates.start}-{candidates.stop - 1}")


def is_healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def wait_healthy(
    procs: Mapping[str, tuple[ServerSpec, subprocess.Popen[bytes]]],
    *,
    timeout: float,
    progress: Callable[[float, list[str], list[str]], None] | None = None,
    interval: float = 0.5,
    elapsed_offset: float = 0.0,
) -> float:
    """Wait until every server answers its health URL; return the seconds it took.

    Raises StackError as soon as one server exits, or when ``timeout`` passes, with the tail
    of the culprit's log so that the reason is visible without opening files. ``progress``
    sees the elapsed time plus ``elapsed_offset`` (a wait that continues an earlier one).
    """
    start = time.monotonic()
    ready: set[str] = set()
    while True:
        elapsed = time.monotonic() - start
        for name, (spec, proc) in procs.items():
            if name in ready:
                continue
            code = proc.poll()
            if code is not None:
                raise StackError(
                    f"{name} exited with code {code} while starting; last lines of "
                    f"{spec.log_path}:\n{log_tail(spec.log_path)}")
            if is_healthy(spec.health_url):
                ready.add(name)
        waiting = [n for n in procs if n not in ready]
        if progress is not None:
            progress(elapsed + elapsed_offset, sorted(ready), waiting)
        if not waiting:
            return elapsed
        if elapsed > timeout:
            names = ", ".join(waiting)
            spec = procs[waiting[0]][0]
            raise StackError(
                f"{names} not healthy after {timeout:.0f} s; last lines of {spec.log_path}:\n"
                f"{log_tail(spec.log_path)}")
        time.sleep(interval)


def _exists(signal_zero: Callable[[int, int], None], target: int) -> bool:
    # Signal 0 checks existence only; EPERM means it exists but belongs to someone else.
    try:
        signal_zero(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_alive(pid: int) -> bool:
    return _exists(os.kill, pid)


def stop_group(pid: int, *, grace: float = 15.0) -> None:
    """SIGTERM the process group led by ``pid``; SIGKILL it if still alive after ``grace``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        _reap(pid)
        if not _group_alive(pid):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    _reap(pid)


def _group_alive(pgid: int) -> bool:
    return _exists(os.killpg, pgid)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
