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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvturn_server._control_secret import is_loopback
from kvturn_server.connector import ConnectorConfig
from kvturn_server.local._launch import server_specs
from kvturn_server.local._model import build_model, is_built
from kvturn_server.local._process import (
    ServerSpec,
    StackError,
    http_url,
    launch,
    pid_alive,
    port_is_free,
    stop_group,
    wait_healthy,
)
from kvturn_server.local._secret import ensure_control_secret
from kvturn_server.local._supervise import Backoff, Say, Supervisor

STATE_FILE = "stack.json"
# Seconds `kvturn down` waits for the supervising process to stop the members itself.
SUPERVISOR_STOP_TIMEOUT = 90.0
Progress = Callable[[float, list[str], list[str]], None]
# The connector's own defaults: the stack passes its lease and read settings on to it.
CONNECTOR_DEFAULTS = ConnectorConfig()


@dataclass(frozen=True)
class StackConfig:
    """Everything that shapes the local stack. Ports must differ from each other."""

    state_dir: Path = Path(".kvturn")
    model_size: str = "tiny"
    model_dir: Path | None = None
    host: str = "127.0.0.1"
    """The loopback address of every member that has none of its own below."""
    router_host: str | None = None
    prefill_host: str | None = None
    decode_host: str | None = None
    reference_host: str | None = None
    """Each member's own loopback address (None: ``host``). Distinct ones (127.0.0.2, 127.0.0.3,
    ...: all of 127.0.0.0/8 is loopback) put each member on a host of its own, as a fleet does:
    ``--host``, the NIXL side channel, the control endpoint and every URL a peer dials follow."""
    router_port: int = 8000
    prefill_port: int = 8100
    decode_port: int = 8200
    prefill_side_channel_port: int = 5600
    decode_side_channel_port: int = 5700
    prefill_control_port: int = 8101
    decode_control_port: int = 8201
    served_model_name: str = "kvturn-tiny"
    kv_cache_gib: float = 1.0
    kv_buffer_device: str | None = "cpu"
    """``kv_buffer_device`` of both instances: ``cpu`` for the CPU build; None leaves vLLM's
    default (the accelerator's memory; the connector refuses a host buffer on a GPU)."""
    max_model_len: int = 8192
    kv_read_timeout: float = CONNECTOR_DEFAULTS.kv_read_timeout
    prefill_prefix_caching: bool = True
    decoder_kv_blocks_ttl: float = CONNECTOR_DEFAULTS.decoder_kv_blocks_ttl
    retention_max_hold: float = CONNECTOR_DEFAULTS.retention_max_hold
    retention_budget: float = CONNECTOR_DEFAULTS.retention_budget
    startup_timeout: float = 600.0
    with_reference: bool = False
    reference_port: int = 8300
    with_router: bool = True
    decode_num_blocks: int | None = None
    extra_vllm_args: tuple[str, ...] = field(default_factory=tuple)
    router_args: tuple[str, ...] = field(default_factory=tuple)
    prefill_connector_extra: dict[str, Any] = field(default_factory=dict)
    """More keys for the prefill's ``kv_connector_extra_config`` (e.g. the reuse cost model's,
    docs/connector.md); they override the stack's own."""
    decode_connector_extra: dict[str, Any] = field(default_factory=dict)
    """The same for the decode's."""
    kv_offload_gib: float = 0.0
    """Host memory (GiB) of the host tier on the prefill and the decode: vLLM's CPU KV offloading
    under kvturn's lease, beside the kvturn connector in a ``MultiConnector``
    (``kvturn_server.offload``, docs/connector.md "The host tier", docs/cpu-stack.md). 0: off.
    The reference never offloads."""
    kv_offload_extra: dict[str, Any] = field(default_factory=dict)
    """More keys for the host tier's ``kv_connector_extra_config`` (``eviction_policy``,
    ``offload_prompt_only``, ...; ``{"eviction_policy": "lru", "offload_prompt_only": true}``:
    vLLM's own behaviour); they override the stack's own."""

    @property
    def model_path(self) -> Path:
        return self.model_dir or self.state_dir / "models" / self.model_size

    def host_of(self, member: str) -> str:
        """The address ``member`` (router, prefill, decode, reference) listens on."""
        own = {"router": self.router_host, "prefill": self.prefill_host,
               "decode": self.decode_host, "reference": self.reference_host}[member]
        return own or self.host

    def url(self, member: str, port: int) -> str:
        return http_url(self.host_of(member), port)

    @property
    def router_url(self) -> str:
        return self.url("router", self.router_port)

    @property
    def prefill_url(self) -> str:
        return self.url("prefill", self.prefill_port)

    @property
    def decode_url(self) -> str:
        return self.url("decode", self.decode_port)

    @property
    def reference_url(self) -> str:
        return self.url("reference", self.reference_port)

    @property
    def prefill_control_url(self) -> str:
        return self.url("prefill", self.prefill_control_port)

    @property
    def decode_control_url(self) -> str:
        return self.url("decode", self.decode_control_port)

    def binds(self) -> dict[str, tuple[str, int]]:
        """Every address and port a member binds, by what it is for."""
        binds = {
            "prefill": ("prefill", self.prefill_port),
            "decode": ("decode", self.decode_port),
            "prefill NIXL side channel": ("prefill", self.prefill_side_channel_port),
            "decode NIXL side channel": ("decode", self.decode_side_channel_port),
            "prefill control": ("prefill", self.prefill_control_port),
            "decode control": ("decode", self.decode_control_port),
        }
        if self.with_router:
            binds["router"] = ("router", self.router_port)
        if self.with_reference:
            binds["reference"] = ("reference", self.reference_port)
        return {what: (self.host_of(member), port) for what, (member, port) in binds.items()}

    def ports(self) -> dict[str, int]:
        return {what: port for what, (_, port) in self.binds().items()}

    def validate(self) -> None:
        for member in ("router", "prefill", "decode", "reference"):
            if not is_loopback(self.host_of(member)):
                raise StackError(f"the local stack listens on loopback only, not "
                                 f"{self.host_of(member)!r} ({member})")
        if self.kv_offload_gib < 0:
            raise StackError(f"kv_offload_gib must be 0 (off) or positive, got "
                             f"{self.kv_offload_gib:g}")
        # Members on different addresses may share port numbers, as hosts of a fleet do.
        binds = self.binds()
        if len(set(binds.values())) != len(binds):
            raise StackError(f"stack ports must all differ on each address: {binds}")


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

