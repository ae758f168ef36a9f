"""A local fleet: N prefills and M decodes of one model with the kvturn connector, and routers in
front of them, on loopback (``kvturn bench fleet``; e2e tests with several instances). All
listen on 127.0.0.1 unless ``FleetConfig.hosts`` gives each instance an address of its own in
127.0.0.0/8 (and ``router_host`` the routers'), as hosts of a real fleet have.

Each instance is launched exactly as the ``Stack`` launches its prefill or decode
(``_launch.vllm_spec``: same flags, same connector config), only with ports of its own, so a
fleet and the stack differ in how many instances run, not in how one runs. Routers are started
and stopped separately (``start_router``), any number of them against the same instances, each
with its own flags: a benchmark can give every mode a fresh router on the same warm backends.

    with Fleet(FleetConfig(state_dir=tmp, prefills=2), die_with_parent=True) as fleet:
        fleet.start()
        router = fleet.start_router("router", ["--prefill-policy", "kv-aware"])
        ...  # router.url, fleet.prefills[i].url, fleet.decodes[j].control_url

Logs go to ``<state_dir>/logs/<name>.log``; ports come from ``free_port(host)``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvturn_server._control_secret import is_loopback
from kvturn_server.local._launch import vllm_spec
from kvturn_server.local._model import SIZES, build_model, is_built
from kvturn_server.local._process import (
    Listening,
    ServerSpec,
    StackError,
    free_port,
    http_url,
    launch,
    stop_group,
    wait_healthy,
)
from kvturn_server.local._secret import ensure_control_secret
from kvturn_server.local._stack import INSTALL_HINT, Progress, vllm_is_installed
from kvturn_server.local._stack_config import CONNECTOR_DEFAULTS, StackConfig

PREFILL, DECODE = "prefill", "decode"
_ROLES = {PREFILL: "kv_producer", DECODE: "kv_consumer"}


@dataclass(frozen=True)
class FleetConfig:
    """What shapes a fleet. The vLLM settings mean what they mean in ``StackConfig``.

    ``prefill_num_blocks`` / ``decode_num_blocks`` fix the number of KV blocks of every prefill
    / decode (vLLM's ``--num-gpu-blocks-override``; None: what ``kv_cache_gib`` gives). vLLM
    refuses to start when the blocks cannot hold one ``max_model_len`` request.
    """

    state_dir: Path
    prefills: int = 2
    decodes: int = 1
    model_size: str = "tiny"
    model_dir: Path | None = None
    served_model_name: str | None = None
    kv_cache_gib: float = 1.0
    kv_buffer_device: str | None = "cpu"
    max_model_len: int | None = None
    kv_read_timeout: float = CONNECTOR_DEFAULTS.kv_read_timeout
    prefill_prefix_caching: bool = True
    prefill_num_blocks: int | None = None
    decode_num_blocks: int | None = None
    decoder_kv_blocks_ttl: float = CONNECTOR_DEFAULTS.decoder_kv_blocks_ttl
    retention_max_hold: float = CONNECTOR_DEFAULTS.retention_max_hold
    retention_budget: float = CONNECTOR_DEFAULTS.retention_budget
    startup_timeout: float = 600.0
    extra_vllm_args: tuple[str, ...] = field(default_factory=tuple)
    kv_offload_gib: float = 0.0
    """Host memory (GiB) of every instance's host tier, as ``StackConfig.kv_offload_gib``
    (kvturn's by default; ``kv_offload_extra`` as ``StackConfig``'s); 0: off."""
    kv_offload_extra: dict[str, Any] = field(default_factory=dict)
    prefill_kv_offload_gib: float | None = None
    """The host tier of every prefill where it differs from ``kv_offload_gib`` (None: that
    one), e.g. sized against each instance's own device KV."""
    decode_kv_offload_gib: float | None = None
    """The same for every decode."""
    hosts: tuple[str, ...] = ()
    """One loopback address per instance in plan order (``prefill0..``, then ``decode0..``);
    empty: every instance on 127.0.0.1."""
    router_host: str = "127.0.0.1"
    """The address routers listen on."""

    def __post_init__(self) -> None:
        if self.prefills < 1 or self.decodes < 1:
            raise StackError("a fleet needs at least one prefill and one decode")
        if self.hosts and len(self.hosts) != self.prefills + self.decodes:
            raise StackError(f"hosts names {len(self.hosts)} addresses for "
                             f"{self.prefills + self.decodes} instances")
        for host in (*self.hosts, self.router_host):
            if not is_loopback(host):
                raise StackError(f"a local fleet listens on loopback only, not {host!r}")
        if self.model_size not in SIZES:
            raise StackError(f"unknown model size {self.model_size!r}; one of {sorted(SIZES)}")
        for name in ("kv_offload_gib", "prefill_kv_offload_gib", "decode_kv_offload_gib"):
            gib = getattr(self, name)
            if gib is not None and gib < 0:
                raise StackError(f"{name} must be 0 (off) or positive, got {gib:g}")
        for name in ("prefill_num_blocks", "decode_num_blocks"):
            value = getattr(self, name)
            if value is not None and value < 2:
                raise StackError(f"{name} must be at least 2, got {value}")

    @property
    def model_path(self) -> Path:
        return self.model_dir or self.state_dir / "models" / self.model_size

    @property
    def model_name(self) -> str:
        return self.served_model_name or f"kvturn-{self.model_size}"

    @property
    def context(self) -> int:
        return self.max_model_len or SIZES[self.model_size].max_positions

    def kv_offload_gib_of(self, role: str) -> float:
        """The host tier (GiB) of every instance of ``role`` (``prefill``, ``decode``)."""
        own = self.prefill_kv_offload_gib if role == PREFILL else self.decode_kv_offload_gib
        return self.kv_offload_gib if own is None else own

    def stack_config(self) -> StackConfig:
        """The ``StackConfig`` every instance's command line is built from (ports aside)."""
        return StackConfig(
            state_dir=self.state_dir, model_size=self.model_size, model_dir=self.model_path,
            served_model_name=self.model_name, kv_cache_gib=self.kv_cache_gib,
            kv_buffer_device=self.kv_buffer_device, max_model_len=self.context,
            kv_read_timeout=self.kv_read_timeout,
            prefill_prefix_caching=self.prefill_prefix_caching,
            decoder_kv_blocks_ttl=self.decoder_kv_blocks_ttl,
            retention_max_hold=self.retention_max_hold, retention_budget=self.retention_budget,
            startup_timeout=self.startup_timeout, with_router=False,
            decode_num_blocks=self.decode_num_blocks, extra_vllm_args=self.extra_vllm_args,
            kv_offload_gib=self.kv_offload_gib, kv_offload_extra=self.kv_offload_extra)

    def describe(self) -> dict[str, Any]:
        return {"prefills": self.prefills, "decodes": self.decodes, "model": self.model_size,
                "served_model_name": self.model_name, "max_model_len": self.context,
                "kv_cache_gib": self.kv_cache_gib, "kv_buffer_device": self.kv_buffer_device,
                "prefill_prefix_caching": self.prefill_prefix_caching,
                "prefill_num_blocks": self.prefill_num_blocks,
                "decode_num_blocks": self.decode_num_blocks,
                "decoder_kv_blocks_ttl": self.decoder_kv_blocks_ttl,
                "retention_budget": self.retention_budget,
                "kv_read_timeout": self.kv_read_timeout,
                "kv_offload_gib": self.kv_offload_gib,
                "prefill_kv_offload_gib": self.kv_offload_gib_of(PREFILL),
                "decode_kv_offload_gib": self.kv_offload_gib_of(DECODE),
                "kv_offload_extra": dict(self.kv_offload_extra),
                "extra_vllm_args": list(self.extra_vllm_args)}


@dataclass(frozen=True)
class Instance(Listening):
    """One vLLM instance of the fleet."""

    name: str
    role: str
    port: int
    side_channel_port: int
    control_port: int
    spec: ServerSpec
    host: str = "127.0.0.1"

    @property
    def control_url(self) -> str:
        return http_url(self.host, self.control_port)


@dataclass(frozen=True)
class Router(Listening):
    """A router process in front of the fleet."""

    name: str
    port: int
    argv: tuple[str, ...]
    pid: int
    startup_s: float
    host: str = "127.0.0.1"


def instance_spec(cfg: FleetConfig, name: str, role: str, port: int, side_channel_port: int,
                  control_port: int, host: str = "127.0.0.1") -> ServerSpec:
    """The Stack's prefill or decode command line with this instance's address, ports, block
    count and host tier."""
    base = replace(cfg.stack_config(), kv_offload_gib=cfg.kv_offload_gib_of(role))
    if role == PREFILL:
        extra = base.extra_vllm_args
        if cfg.prefill_num_blocks is not None:
            extra = (*extra, "--num-gpu-blocks-override", str(cfg.prefill_num_blocks))
        stack = replace(base, prefill_host=host, prefill_control_port=control_port,
                        extra_vllm_args=extra)
    elif role == DECODE:
        stack = replace(base, decode_host=host, decode_control_port=control_port)
    else:
        raise ValueError(f"role must be {PREFILL!r} or {DECODE!r}, got {role!r}")
    return vllm_spec(stack, name, port, _ROLES[role], side_channel_port)


def plan_instances(cfg: FleetConfig,
                   port: Callable[[str], int] = free_port) -> list[Instance]:
    """``prefill0..`` then ``decode0..``, each with its address (``cfg.hosts``) and three ports
    of its own there."""
    out = []
    hosts = iter(cfg.hosts)
    for role, count in ((PREFILL, cfg.prefills), (DECODE, cfg.decodes)):
        for i in range(count):
            name = f"{role}{i}"
            host = next(hosts, "127.0.0.1")
            http, side, control = port(host), port(host), port(host)
            out.append(Instance(name, role, http, side, control,
                                instance_spec(cfg, name, role, http, side, control, host),
                                host))
    binds = [(i.host, p) for i in out for p in (i.port, i.side_channel_port, i.control_port)]
    if len(set(binds)) != len(binds):
        raise StackError(f"fleet ports must all differ on each address: {binds}")
    return out


def router_argv(prefills: Sequence[Instance], decodes: Sequence[Instance], port: int,
                retention_ttl: float, args: Sequence[str] = (),
                host: str = "127.0.0.1") -> list[str]:
    """``kvturn router`` over these instances; ``args`` are appended (policy flags, ...)."""
    argv = [sys.executable, "-m", "kvturn_server.cli", "router", "--host", host,
            "--port", str(port), "--retention-ttl", f"{retention_ttl:g}"]
    for p in prefills:
        argv += ["--prefill", p.url]
    for d in decodes:
        argv += ["--decode", f"{d.url},control={d.control_url}"]
    return [*argv, *args]


class Fleet:
    """Start and stop the fleet's vLLM instances and routers (a context manager: leaving it
    stops everything it started)."""

    def __init__(self, config: FleetConfig, *, die_with_parent: bool = False,
                 port: Callable[[str], int] = free_port) -> None:
        self.config = config
        self.die_with_parent = die_with_parent
        self._port = port
        self.instances = plan_instances(config, port)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.routers: dict[str, Router] = {}
        self.startup_seconds: float | None = None

    @property
    def prefills(self) -> list[Instance]:
        return [i for i in self.instances if i.role == PREFILL]

    @property
    def decodes(self) -> list[Instance]:
        return [i for i in self.instances if i.role == DECODE]

    def instance(self, name: str) -> Instance:
        for i in self.instances:
            if i.name == name:
                return i
        raise KeyError(name)

    def start(self, progress: Progress | None = None) -> Fleet:
        """Launch every vLLM instance and wait until all are healthy; stop them all on any
        failure."""
        if not vllm_is_installed():
            raise StackError(INSTALL_HINT)
        cfg = self.config
        if not is_built(cfg.model_path, cfg.model_size):
            build_model(cfg.model_size, cfg.model_path)
        ensure_control_secret(cfg.state_dir)
        started = time.monotonic()
        try:
            for i in self.instances:
                self._procs[i.name] = launch(i.spec, die_with_parent=self.die_with_parent)
            wait_healthy({i.name: (i.spec, self._procs[i.name]) for i in self.instances},
                         timeout=cfg.startup_timeout, progress=progress)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def pid(self, name: str) -> int:
        if name in self.routers:
            return self.routers[name].pid
        return self._procs[name].pid

    def start_router(self, name: str, args: Sequence[str] = (), *, timeout: float = 60.0,
                     prefills: Sequence[Instance] | None = None,
                     decodes: Sequence[Instance] | None = None) -> Router:
        """A router over every instance (or the ones given) with ``args`` added; returns once
        it answers ``/health``. Its log is ``logs/<name>.log``."""
        if name in self.routers or name in self._procs:
            raise StackError(f"{name!r} is already running")
        host = self.config.router_host
        port = self._port(host)
        argv = router_argv(self.prefills if prefills is None else prefills,
                           self.decodes if decodes is None else decodes, port,
                           self.config.decoder_kv_blocks_ttl, args, host)
        spec = ServerSpec(name=name, argv=argv, port=port,
                          health_url=f"{http_url(host, port)}/health",
                          log_path=self.config.state_dir / "logs" / f"{name}.log",
                          env={"PYTHONUNBUFFERED": "1"}, host=host)
        proc = launch(spec, die_with_parent=self.die_with_parent)
        try:
            seconds = wait_healthy({name: (spec, proc)}, timeout=timeout)
        except BaseException:
            stop_group(proc.pid)
            raise
        router = Router(name, port, tuple(argv), proc.pid, seconds, host)
        self.routers[name] = router
        return router

    def stop_router(self, name: str) -> None:
        router = self.routers.pop(name, None)
        if router is not None:
            stop_group(router.pid)

    def stop(self) -> None:
        # Routers first, so that no new request reaches a stopping vLLM.
        for name in list(self.routers):
            self.stop_router(name)
        for proc in self._procs.values():
            stop_group(proc.pid)
        self._procs.clear()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
