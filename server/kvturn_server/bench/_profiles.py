"""Instance profiles: which vLLM settings a benchmark mode needs from its instances, and the
instances of every profile a run needs, started once and kept up side by side.

A mode whose instances need other vLLM settings than another's cannot share instances with it.
Each mode of ``kvturn bench agent``, ``trace`` and ``fleet`` names a profile:

- ``plain``: the kvturn connector alone, as ``kvturn up`` serves it.
- ``offload``: the same beside vLLM's CPU KV offloading as vLLM ships it (``kvturn_server.offload``:
  vLLM's ``OffloadingConnector`` in a ``MultiConnector`` after kvturn's connector, vLLM's LRU
  order), a host tier on every instance of ``multiple`` times that instance's device KV, replies
  stored too (``offload_prompt_only: false``: an agent sends the previous reply back in its next
  prompt, and with vLLM's default a host hit stops at the previous prompt, docs/cpu-stack.md).
  The stock baseline's host tier.
- ``host-tier``: the same host tier with kvturn's defaults (docs/connector.md, "The host tier":
  evicted in the leases' order, released and expired conversations discarded). kvturn's own.
  Its instances are not the stock mode's: leases left by a kvturn run would protect kvturn's
  conversations in a host tier a stock run then shares.

A benchmark starts the instances of each profile its modes use (``ProfileFleets``), one profile
after the other, and keeps them all up until it ends: every mode still runs in rotated order
on warm instances, one run at a time, the other profile's instances idle meanwhile. The
instances of a profile no mode asked for are not started. The plain profile's instances are the
benchmark's base configuration, unchanged (their logs where they always were); the offload
profile's keep theirs in ``offload/`` under the state directory and share the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kvturn_server._defaults import VLLM_CPU_BLOCK_SIZE

if TYPE_CHECKING:
    from kvturn_server.local import Fleet, FleetConfig, Progress

PLAIN, OFFLOAD, HOST_TIER = "plain", "offload", "host-tier"
PROFILES = (PLAIN, OFFLOAD, HOST_TIER)
HOST_TIER_MULTIPLE = 2.0
"""The host tier against the device KV by default: an H200 serving a 32B model keeps about
70 GB (65 GiB) of KV beside the weights, and llm-d's guides give each rank 100-150 GiB of CPU
tier (``kvturn simulate``'s stock-cond-offload takes 128 GiB): about twice the device KV."""
OFFLOAD_EXTRA: dict[str, dict[str, Any]] = {
    OFFLOAD: {"eviction_policy": "lru", "offload_prompt_only": False},
    HOST_TIER: {},  # kvturn's defaults: its leases' order, replies stored
}
"""The offloading connector's settings beyond the size, per host-tier profile."""
GIB = 1024 ** 3
CPU_BLOCK_SIZE = VLLM_CPU_BLOCK_SIZE  # the size the benchmarks assume until an instance says

HOST_TIER_PEERS = (
    "vLLM's CPU KV offloading on every instance (the offloading connector, LRU, write-through: "
    "every computed block, replies included, is copied to host memory and loaded back on a "
    "prefix hit), the host tier a stated multiple of each instance's device KV (default 2x: an "
    "H200 with ~70 GB of KV beside llm-d's 100-150 GiB of CPU tier per rank): the tool-gap KV "
    "that llm-d's P2P KV sharing (offload_prompt_only false), LMCache's CPU backend and "
    "Dynamo's KVBM keep in host memory")
HOST_TIER_SOURCES = (
    "vLLM vllm/v1/kv_offload (OffloadingConnector, CPUOffloadingSpec; --kv-offloading-size)",
    "llm-d guides: P2P KV sharing / tiered prefix cache with CPU offloading "
    "(100-150 GiB per rank; llm-d blog 2026-08-15, median TTFT 6.83 -> 1.09 s)",
    "LMCache CPU offloading backend (LMCacheConnectorV1, local_cpu)",
    "docs/cpu-stack.md \"vLLM's CPU offloading\" (how it runs on this build)")


def kv_bytes_per_token(size: str) -> int:
    """The local model's KV bytes per token (K and V of every layer)."""
    from kvturn_server.local import SIZES

    m = SIZES[size]
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * (4 if m.dtype == "float32" else 2)


def device_kv_bytes(cfg: FleetConfig, role: str) -> int:
    """The device KV of every instance of ``role`` (``prefill``, ``decode``): its block count
    times a block's bytes where the count is set, else ``kv_cache_gib``. Raises ValueError on a
    GPU, where vLLM sizes the KV from the accelerator's memory only once it starts."""
    if cfg.kv_buffer_device is None:
        raise ValueError("the offload profile sizes the host tier against the instances' "
                         "device KV, which on a GPU is known only once vLLM starts: run the "
                         "offload modes on the CPU build")
    blocks = cfg.prefill_num_blocks if role == "prefill" else cfg.decode_num_blocks
    if blocks is not None:
        return blocks * CPU_BLOCK_SIZE * kv_bytes_per_token(cfg.model_size)
    return int(cfg.kv_cache_gib * GIB)


def profile_config(base: FleetConfig, profile: str,
                   multiple: float = HOST_TIER_MULTIPLE) -> FleetConfig:
    """The fleet of ``profile``: ``base`` itself for ``plain``; for ``offload`` the same
    instances with a host tier of ``multiple`` x each one's device KV (``OFFLOAD_EXTRA``), their
    state under ``offload/`` and the plain profile's model."""
    if profile == PLAIN:
        return base
    if profile not in OFFLOAD_EXTRA:
        raise ValueError(f"unknown instance profile {profile!r}; one of {', '.join(PROFILES)}")
    if not multiple > 0:
        raise ValueError(f"the host tier multiple must be positive, got {multiple:g}")
    prefill, decode = (multiple * device_kv_bytes(base, role) / GIB
                       for role in ("prefill", "decode"))
    return replace(base, state_dir=base.state_dir / profile, model_dir=base.model_path,
                   kv_offload_gib=decode, prefill_kv_offload_gib=prefill,
                   decode_kv_offload_gib=decode, kv_offload_extra=dict(OFFLOAD_EXTRA[profile]))


def host_tier(cfg: FleetConfig, multiple: float | None = None) -> dict[str, Any] | None:
    """What host tier ``cfg``'s instances have (None: none), as the results state it."""
    from kvturn_server.local import DECODE, PREFILL

    gib = {role: cfg.kv_offload_gib_of(role) for role in (PREFILL, DECODE)}
    if not any(gib.values()):
        return None
    out: dict[str, Any] = {f"{role}_gib": round(value, 4) for role, value in gib.items()}
    out.update({f"{role}_device_kv_gib": round(device_kv_bytes(cfg, role) / GIB, 4)
                for role in (PREFILL, DECODE)})
    if multiple is not None:
        out["multiple_of_device_kv"] = multiple
    out["offload_extra"] = dict(cfg.kv_offload_extra)
    return out


def _mib(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.0f} MiB"


def describe_host_tier(tier: dict[str, Any] | None) -> str:
    """One line's worth: ``no host tier`` or the sizes per role and against the device KV."""
    if not tier:
        return "no host tier"
    multiple = tier.get("multiple_of_device_kv")
    extra = ", ".join(f"{k} {str(v).lower()}" for k, v in tier.get("offload_extra", {}).items())
    extra_keys = tier.get("offload_extra", {})
    what = ("vLLM CPU offloading" if extra_keys.get("eviction_policy") == "lru"
            else "kvturn's host tier (vLLM's offloading connector in the leases' order)")
    return (what + ", host tier"
            + (f" {multiple:g}x the device KV" if multiple is not None else "")
            + f": prefill {_mib(tier['prefill_gib'])} (device "
            f"{_mib(tier['prefill_device_kv_gib'])}), decode {_mib(tier['decode_gib'])} (device "
            f"{_mib(tier['decode_device_kv_gib'])})" + (f", {extra}" if extra else ""))


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def needed(profiles: Iterable[str]) -> tuple[str, ...]:
    """The profiles among ``profiles``, each once, in ``PROFILES`` order."""
    wanted = set(profiles)
    unknown = wanted - set(PROFILES)
    if unknown:
        raise ValueError(f"unknown instance profile(s) {', '.join(sorted(unknown))}")
    return tuple(p for p in PROFILES if p in wanted)


class ProfileFleets:
    """The instances of each needed profile (``profile_config`` of ``base``), started one
    profile after the other (each fleet's ports are chosen once the previous one listens) and
    stopped together (a context manager; a failed start stops what had started)."""

    def __init__(self, base: FleetConfig, profiles: Iterable[str],
                 multiple: float = HOST_TIER_MULTIPLE) -> None:
        self.multiple = multiple
        self.configs = {p: profile_config(base, p, multiple) for p in needed(profiles)}
        self.fleets: dict[str, Fleet] = {}
        self._stack = contextlib.ExitStack()

    def start(self, progress: Callable[[], Progress | None] = lambda: None,
              say: Callable[[str], None] = print) -> ProfileFleets:
        from kvturn_server.local import Fleet

        try:
            for profile, cfg in self.configs.items():
                say(f"starting the {profile} instances ({_count(cfg.prefills, 'prefill')} + "
                    f"{_count(cfg.decodes, 'decode')}; "
                    f"{describe_host_tier(self.host_tier(profile))}); logs in "
                    f"{cfg.state_dir / 'logs'}")
                fleet = self._stack.enter_context(Fleet(cfg, die_with_parent=True))
                fleet.start(progress=progress())
                self.fleets[profile] = fleet
        except BaseException:
            self.stop()
            raise
        return self

    def host_tier(self, profile: str) -> dict[str, Any] | None:
        return host_tier(self.configs[profile],
                         self.multiple if profile in OFFLOAD_EXTRA else None)

    def describe(self) -> dict[str, Any]:
        """Per profile: its fleet's configuration, start-up time and host tier."""
        return {p: {**cfg.describe(), "host_tier": self.host_tier(p),
                    "startup_s": None if p not in self.fleets
                    else self.fleets[p].startup_seconds}
                for p, cfg in self.configs.items()}

    def stop(self) -> None:
        self._stack.close()

    def __enter__(self) -> ProfileFleets:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
