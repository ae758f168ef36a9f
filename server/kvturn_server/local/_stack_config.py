"""The local stack's configuration: every member's address, port and vLLM settings.

Apart from the stack that runs it (``_stack.py``) so that the launch specs (``_launch.py``),
which the stack builds from it, need not import the stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvturn_server._control_secret import is_loopback
from kvturn_server.connector import ConnectorConfig
from kvturn_server.local._process import StackError, http_url

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
