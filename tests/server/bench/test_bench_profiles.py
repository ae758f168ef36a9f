"""The benchmarks' instance profiles without servers: the offload profile's host tier sized
against each instance's device KV, what the results say of it, and the instances of every
needed profile started one after the other, kept up together and stopped together."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvturn_server.bench._profiles import (
    HOST_TIER_MULTIPLE,
    OFFLOAD,
    PLAIN,
    ProfileFleets,
    describe_host_tier,
    device_kv_bytes,
    host_tier,
    needed,
    profile_config,
)
from kvturn_server.local._fleet import FleetConfig

GIB = 1 << 30
BLOCK = 128 * 2048  # the tiny model: 128 tokens of 2 KiB each


def test_the_offload_profile_gives_each_instance_twice_its_device_kv_in_host_memory(
        tmp_path: Path) -> None:
    base = FleetConfig(state_dir=tmp_path, prefills=1, decodes=1, kv_cache_gib=1.0,
                       decode_num_blocks=100)
    assert profile_config(base, PLAIN) is base
    assert (device_kv_bytes(base, "prefill"), device_kv_bytes(base, "decode")) == (
        GIB, 100 * BLOCK)
    cfg = profile_config(base, OFFLOAD)
    assert HOST_TIER_MULTIPLE == 2.0
    assert cfg.kv_offload_gib_of("prefill") == 2.0
    assert cfg.kv_offload_gib_of("decode") == 2 * 100 * BLOCK / GIB
    # Replies are history; vLLM's own order for the stock baseline.
    assert cfg.kv_offload_extra == {"eviction_policy": "lru", "offload_prompt_only": False}
    # kvturn's host tier: the same size, kvturn's defaults (its leases' order, replies stored).
    tiered = profile_config(base, "host-tier")
    assert tiered.kv_offload_extra == {}
    assert tiered.decode_kv_offload_gib == cfg.decode_kv_offload_gib
    # Its own logs, the same model and everything else as the plain instances.
    assert cfg.state_dir == tmp_path / "offload" and cfg.model_path == base.model_path
    assert (cfg.decode_num_blocks, cfg.prefill_prefix_caching) == (100, True)
    tight = FleetConfig(state_dir=tmp_path, prefill_num_blocks=85, decode_num_blocks=85)
    assert profile_config(tight, OFFLOAD, 3.0).kv_offload_gib_of("prefill") == 3 * 85 * BLOCK / GIB
    with pytest.raises(ValueError, match="GPU"):
        profile_config(FleetConfig(state_dir=tmp_path, kv_buffer_device=None), OFFLOAD)
    with pytest.raises(ValueError, match="multiple"):
        profile_config(base, OFFLOAD, 0.0)
    with pytest.raises(ValueError, match="profile"):
        profile_config(base, "disk")


def test_the_host_tier_is_stated_with_its_multiple_and_the_device_kv(tmp_path: Path) -> None:
    base = FleetConfig(state_dir=tmp_path, decode_num_blocks=100)
    assert host_tier(base) is None and describe_host_tier(None) == "no host tier"
    tier = host_tier(profile_config(base, OFFLOAD), 2.0)
    assert tier == {"prefill_gib": 2.0, "decode_gib": 0.0488, "prefill_device_kv_gib": 1.0,
                    "decode_device_kv_gib": 0.0244, "multiple_of_device_kv": 2.0,
                    "offload_extra": {"eviction_policy": "lru", "offload_prompt_only": False}}
    assert describe_host_tier(tier) == (
        "vLLM CPU offloading, host tier 2x the device KV: prefill 2.00 GiB (device 1.00 GiB), "
        "decode 50 MiB (device 25 MiB), eviction_policy lru, offload_prompt_only false")


def test_only_the_profiles_asked_for_are_named_once_in_order() -> None:
    assert needed(["offload", "plain", "offload"]) == (PLAIN, OFFLOAD)
    assert needed(["offload"]) == (OFFLOAD,)
    with pytest.raises(ValueError, match="disk"):
        needed(["disk"])


class _Fleet:
    """``Fleet`` as far as ``ProfileFleets`` uses it; ``events`` records what happened."""

    events: ClassVar[list[str]] = []
    fail: ClassVar[str | None] = None

    def __init__(self, config: FleetConfig, die_with_parent: bool = False) -> None:
        self.config = config
        self.name = config.state_dir.name
        self.startup_seconds: float | None = None

    def __enter__(self) -> _Fleet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.events.append(f"stop {self.name}")

    def start(self, progress: Any = None) -> _Fleet:
        self.events.append(f"start {self.name}")
        if self.name == self.fail:
            raise RuntimeError("vLLM died")
        self.startup_seconds = 1.0
        return self


def test_every_needed_profile_starts_in_turn_and_all_stop_together(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvturn_server.local.Fleet", _Fleet)
    _Fleet.events = []
    base = FleetConfig(state_dir=tmp_path / "bench")
    said: list[str] = []
    with ProfileFleets(base, ["offload", "plain"]) as fleets:
        fleets.start(say=said.append)
        assert list(fleets.fleets) == [PLAIN, OFFLOAD]
        assert _Fleet.events == ["start bench", "start offload"]
    assert _Fleet.events[2:] == ["stop offload", "stop bench"]
    assert said[0].startswith("starting the plain instances (2 prefills + 1 decode; no host "
                              "tier); logs in ")
    assert "starting the offload instances (2 prefills + 1 decode; vLLM CPU offloading, host " \
           "tier 2x the device KV: prefill 2.00 GiB" in said[1]
    described = fleets.describe()
    assert described["plain"]["host_tier"] is None and described["offload"]["startup_s"] == 1.0
    assert described["offload"]["host_tier"]["decode_gib"] == 2.0
    # A profile nobody asked for is not started; a failed start stops what had started.
    _Fleet.events, _Fleet.fail = [], "offload"
    with pytest.raises(RuntimeError), ProfileFleets(base, ["plain", "offload"]) as fleets:
        fleets.start(say=lambda _: None)
    assert _Fleet.events == ["start bench", "start offload", "stop offload", "stop bench"]
    _Fleet.events, _Fleet.fail = [], None
    with ProfileFleets(base, ["plain"]) as fleets:
        fleets.start(say=lambda _: None)
    assert _Fleet.events == ["start bench", "stop bench"]
