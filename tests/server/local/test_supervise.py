"""Supervision of the local stack's members (``local/_supervise.py``), with real processes.

A member here is what a vLLM server is to the supervisor: a process-group leader that answers
``/health`` on its port, with a child that holds another port and outlives the leader (vLLM's
engine core holds the control and NIXL ports and outlives a ``kill -9`` of its API server).
The child ignores SIGTERM, so the supervisor has to escalate to SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvturn_server.local import free_port
from kvturn_server.local._process import ServerSpec, is_healthy, launch, port_is_free, stop_group
from kvturn_server.local._supervise import Backoff, Supervisor, describe_exit

MEMBER = r"""
import http.server, os, signal, socket, subprocess, sys, time
port, other = int(sys.argv[1]), int(sys.argv[2])
child = subprocess.Popen([sys.executable, "-c", '''
import signal, socket, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an engine core slow to go
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
time.sleep(3600)
''', str(other)])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


class Members:
    """The supervisor's view of a stack, over real child processes."""

    def __init__(self, specs: list[ServerSpec]) -> None:
        self.lock = threading.RLock()
        self.die_with_parent = True
        self.startup_timeout = 30.0
        self.procs = {s.name: (s, launch(s, die_with_parent=True)) for s in specs}
        self.replaced: list[str] = []

    def member_procs(self) -> dict[str, tuple[ServerSpec, subprocess.Popen[bytes]]]:
        return dict(self.procs)

    def replace_member(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        self.procs[name] = (self.procs[name][0], proc)
        self.replaced.append(name)

    def stop(self) -> None:
        for _, proc in self.procs.values():
            stop_group(proc.pid, grace=1.0)


def _spec(tmp_path: Path, name: str) -> ServerSpec:
    port, other = free_port(), free_port()
    return ServerSpec(name=name, argv=[sys.executable, "-c", MEMBER, str(port), str(other)],
                      port=port, health_url=f"http://127.0.0.1:{port}/health",
                      log_path=tmp_path / f"{name}.log", other_ports=(other,))


def _wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def members(tmp_path: Path) -> Iterator[Members]:
    m = Members([_spec(tmp_path, "decode")])
    spec = m.procs["decode"][0]
    _wait(lambda: is_healthy(spec.health_url, 0.5) and not port_is_free("127.0.0.1",
                                                                         spec.other_ports[0]),
          20, "member up")
    yield m
    m.stop()


def test_a_killed_leader_is_cleaned_up_with_its_group_and_restarted(
        members: Members) -> None:
    lines: list[str] = []
    supervisor = Supervisor(members, backoff=Backoff(initial=0.1), interval=0.05,
                            group_grace=0.5, say=lines.append).start()
    try:
        spec, proc = members.procs["decode"]
        os.kill(proc.pid, signal.SIGKILL)
        # Without supervision the child lives on holding its port; with it, the group goes.
        _wait(lambda: not _group_alive(proc.pid), 10, "old process group gone")
        _wait(lambda: members.replaced == ["decode"], 10, "relaunched")
        new = members.procs["decode"][1]
        assert new.pid != proc.pid
        _wait(lambda: is_healthy(spec.health_url, 0.5), 20, "healthy again on the same port")
        _wait(lambda: not port_is_free("127.0.0.1", spec.other_ports[0]), 10,
              "other port re-bound by the new member")
        _wait(lambda: any("healthy again" in line for line in lines), 10, "log line")
    finally:
        supervisor.stop()
    assert f"decode (pid {proc.pid}) exited killed by SIGKILL" in lines[0]
    assert "restarting it in 0.1 s (restart 1 in a row)" in lines[0]
    assert "gone after" in lines[1] and "its ports are free" in lines[1]
    log = spec.log_path.read_text()
    assert "exited killed by SIGKILL" in log and "healthy again" in log


def test_consecutive_restarts_back_off(members: Members) -> None:
    lines: list[str] = []
    supervisor = Supervisor(members, backoff=Backoff(initial=0.1, maximum=0.3,
                                                     stable_after=3600), interval=0.05,
                            group_grace=0.5, say=lines.append).start()
    try:
        for count in (1, 2, 3):
            proc = members.procs["decode"][1]
            _wait(lambda: is_healthy(members.procs["decode"][0].health_url, 0.5), 20, "up")
            os.kill(proc.pid, signal.SIGKILL)
            _wait(lambda c=count: len(members.replaced) == c, 20, f"restart {count}")  # type: ignore[misc]
    finally:
        supervisor.stop()
    waits = [line.split("restarting it in ")[1].split(" s")[0] for line in lines
             if "restarting it in" in line]
    assert waits == ["0.1", "0.2", "0.3"]
    assert supervisor.restarts["decode"] == 3


def test_a_stopped_supervisor_restarts_nothing(members: Members) -> None:
    supervisor = Supervisor(members, interval=0.05).start()
    supervisor.stop()
    proc = members.procs["decode"][1]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    supervisor.check_once()  # stopped: does nothing
    assert members.replaced == []


def test_backoff_and_exit_descriptions() -> None:
    b = Backoff(initial=1, maximum=60)
    assert [b.delay(n) for n in (1, 2, 3, 7, 8)] == [1, 2, 4, 60, 60]
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "with code 3"


def test_kvturn_down_stops_the_supervisor_before_the_members(tmp_path: Path) -> None:
    """Stopping members under a live supervisor would only get them restarted: `kvturn down`
    signals the supervising process, which stops them itself."""
    from kvturn_server.local import StackConfig
    from kvturn_server.local._stack import STATE_FILE, RunningStack, stop_running

    marker = tmp_path / "stopped"
    supervisor = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time, pathlib\n"
        "def stop(*a):\n"
        f"    pathlib.Path({str(marker)!r}).write_text('members stopped by me')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE)
    assert supervisor.stdout is not None and supervisor.stdout.readline() == b"ready\n"
    running = RunningStack(StackConfig(state_dir=tmp_path), {}, time.time(), supervisor.pid)
    (tmp_path / STATE_FILE).write_text(running.to_json())
    stopped = stop_running(tmp_path)
    assert stopped is not None and stopped.supervisor == supervisor.pid
    assert supervisor.wait(timeout=10) == 0
    assert marker.read_text() == "members stopped by me"
