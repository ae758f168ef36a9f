"""The local stack: one prefill vLLM, one decode vLLM and the router, on loopback.

All listen on 127.0.0.1 by default; each may have an address of its own in 127.0.0.0/8
(``StackConfig.prefill_host`` ...), which runs the stack the way a multi-host fleet runs: every
address an instance binds, advertises or dials is passed explicitly, as on separate hosts.

``Stack.start()`` launches the servers, waits for health with progress output and records them
in ``<state_dir>/stack.json``; ``Stack.stop()`` (or ``kvturn down`` from another shell) stops
them. A second start while one runs is refused with a clear message instead of clashing on
ports.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvturn_server.local._launch import server_specs
from kvturn_server.local._model import build_model, is_built
from kvturn_server.local._process import (
    ServerSpec,
    StackError,
    launch,
    pid_alive,
    port_is_free,
    stop_group,
    wait_healthy,
)
from kvturn_server.local._secret import ensure_control_secret
from kvturn_server.local._stack_config import StackConfig
from kvturn_server.local._supervise import Backoff, Say, Supervisor

STATE_FILE = "stack.json"
# Seconds `kvturn down` waits for the supervising process to stop the members itself.
SUPERVISOR_STOP_TIMEOUT = 90.0
Progress = Callable[[float, list[str], list[str]], None]
def vllm_is_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None and importlib.util.find_spec(
        "nixl") is not None


INSTALL_HINT = (
    "the vLLM CPU stack is not installed in this environment. Run `make test` or `make demo` "
    "from the repository root (they install it into .venv), or `pip install -e '.[cpu,router]'` "
    "and then `pip uninstall -y torchvision torchaudio torchcodec triton` (see README)."
)




@dataclass
class RunningStack:
    """What ``stack.json`` records about a started stack."""

    config: StackConfig
    pids: dict[str, int]
    started_at: float
    supervisor: int | None = None
    """The process that supervises the members (``kvturn up``): ``kvturn down`` stops it first,
    or it would restart what is being stopped."""

    def to_json(self) -> str:
        cfg = asdict(self.config)
        cfg["state_dir"] = str(self.config.state_dir)
        cfg["model_dir"] = str(self.config.model_path)
        cfg["extra_vllm_args"] = list(self.config.extra_vllm_args)
        return json.dumps({"config": cfg, "pids": self.pids, "started_at": self.started_at,
                           "supervisor": self.supervisor}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> RunningStack:
        data = json.loads(text)
        cfg = dict(data["config"])
        cfg["state_dir"] = Path(cfg["state_dir"])
        cfg["model_dir"] = Path(cfg["model_dir"])
        cfg["extra_vllm_args"] = tuple(cfg.get("extra_vllm_args", ()))
        supervisor = data.get("supervisor")
        return cls(StackConfig(**cfg), {k: int(v) for k, v in data["pids"].items()},
                   float(data["started_at"]),
                   int(supervisor) if supervisor is not None else None)


def read_running(state_dir: Path) -> RunningStack | None:
    """The stack recorded in ``state_dir`` if any of its processes is still alive."""
    path = state_dir / STATE_FILE
    try:
        running = RunningStack.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        path.unlink(missing_ok=True)
        return None
    pids = [*running.pids.values(), *([running.supervisor] if running.supervisor else [])]
    if any(pid_alive(pid) for pid in pids):
        return running
    path.unlink(missing_ok=True)
    return None


class Stack:
    """Start and stop the local prefill/decode/router stack described by a ``StackConfig``.

    With ``supervise``, a member that dies after start-up is cleaned up (its whole process
    group) and restarted with backoff (``_supervise.py``); ``say`` gets one line per step.
    """

    def __init__(self, config: StackConfig, *, die_with_parent: bool = False,
                 supervise: bool = False, say: Say | None = None,
                 backoff: Backoff | None = None) -> None:
        self.config = config
        self.die_with_parent = die_with_parent
        self.supervise = supervise
        self.say = say
        self.backoff = backoff
        self.supervisor: Supervisor | None = None
        # Held while members are replaced: by restart(), stop() and the supervisor.
        self.lock = threading.RLock()
        self._procs: dict[str, tuple[ServerSpec, subprocess.Popen[bytes]]] = {}
        self.startup_seconds: float | None = None

    # What the supervisor uses (``_supervise.Members``).

    def member_procs(self) -> dict[str, tuple[ServerSpec, subprocess.Popen[bytes]]]:
        return dict(self._procs)

    def replace_member(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        spec = self._procs[name][0]
        self._procs[name] = (spec, proc)
        self._record()

    @property
    def startup_timeout(self) -> float:
        return self.config.startup_timeout

    def check(self) -> None:
        """Raise StackError if the stack cannot start here (before anything is launched)."""
        cfg = self.config
        cfg.validate()
        if not vllm_is_installed():
            raise StackError(INSTALL_HINT)
        running = read_running(cfg.state_dir)
        if running is not None:
            raise StackError(
                f"a kvturn stack is already running from {cfg.state_dir} (router "
                f"{running.config.router_url}, pids {sorted(running.pids.values())}); "
                "stop it with `kvturn down` first")
        busy = [f"{name} port {port} on {host}" for name, (host, port) in cfg.binds().items()
                if not port_is_free(host, port)]
        if busy:
            raise StackError(f"in use by another process: {', '.join(busy)}; stop it or "
                             "choose other ports (see `kvturn up --help`)")

    def start(self, progress: Progress | None = None) -> Stack:
        """Launch the servers and wait until all are healthy; stop them all on any failure."""
        self.check()
        cfg = self.config
        if not is_built(cfg.model_path, cfg.model_size):
            build_model(cfg.model_size, cfg.model_path)
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        ensure_control_secret(cfg.state_dir)
        started = time.monotonic()
        specs = server_specs(cfg)
        # vLLM first, the router once they answer: a router started beside them would see its
        # backends fail their first health checks and eject them until they are re-admitted.
        waves = [w for w in ([s for s in specs if s.name != "router"],
                             [s for s in specs if s.name == "router"]) if w]
        try:
            for wave in waves:
                for spec in wave:
                    self._procs[spec.name] = (spec, launch(spec,
                                                           die_with_parent=self.die_with_parent))
                self._record()
                wait_healthy({s.name: self._procs[s.name] for s in wave},
                             timeout=cfg.startup_timeout - (time.monotonic() - started),
                             progress=progress, elapsed_offset=time.monotonic() - started)
            self.startup_seconds = time.monotonic() - started
        except BaseException:
            self.stop()
            raise
        if self.supervise:
            self.supervisor = Supervisor(self, backoff=self.backoff,
                                         say=self.say).start()
            self._record()
        return self

    def _record(self) -> None:
        running = RunningStack(self.config, {n: p.pid for n, (_, p) in self._procs.items()},
                               time.time(), os.getpid() if self.supervisor else None)
        path = self.config.state_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(running.to_json())
        os.replace(tmp, path)

    def pid(self, name: str) -> int:
        return self._procs[name][1].pid

    def restart(self, name: str, progress: Progress | None = None) -> float:
        """Stop one server and start it again with the same command line; return the seconds
        until it was healthy again. A restarted vLLM is a new engine (new engine id)."""
        with self.lock:  # the supervisor must not take this stop for a death
            spec, proc = self._procs[name]
            stop_group(proc.pid)
            self._procs[name] = (spec, launch(spec, die_with_parent=self.die_with_parent))
            self._record()
        return wait_healthy({name: self._procs[name]}, timeout=self.config.startup_timeout,
                            progress=progress)

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()  # first: it would restart what is being stopped
            self.supervisor = None
        with self.lock:
            # Router first, so that no new request reaches a stopping vLLM.
            for name in sorted(self._procs, key=lambda n: n != "router"):
                stop_group(self._procs[name][1].pid)
            self._procs.clear()
            (self.config.state_dir / STATE_FILE).unlink(missing_ok=True)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_running(state_dir: Path) -> RunningStack | None:
    """Stop the stack recorded in ``state_dir`` (``kvturn down``); None if none was running."""
    running = read_running(state_dir)
    if running is None:
        return None
    supervisor = running.supervisor
    if supervisor is not None and supervisor != os.getpid() and pid_alive(supervisor):
        # It stops the members itself (and would restart them if they were stopped first).
        with contextlib.suppress(ProcessLookupError):
            os.kill(supervisor, signal.SIGTERM)
        deadline = time.monotonic() + SUPERVISOR_STOP_TIMEOUT
        while pid_alive(supervisor) and time.monotonic() < deadline:
            time.sleep(0.2)
    for name in sorted(running.pids, key=lambda n: n != "router"):
        pid = running.pids[name]
        if pid_alive(pid):
            stop_group(pid)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    return running

