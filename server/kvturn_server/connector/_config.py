"""The connector's own settings, read from ``kv_connector_extra_config``."""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvturn_server.connector._cost import CostSettings

COST_MODELS = ("auto", "off")


class ConnectorConfigError(ValueError):
    """A ``kv_connector_extra_config`` value kvturn cannot use."""


@dataclass(frozen=True)
class ConnectorConfig:
    """kvturn's keys in ``kv_connector_extra_config`` (vLLM's own NIXL keys pass through).

    Attributes:
        kv_read_timeout: seconds a NIXL read of remote blocks may stay in flight before it is
            abandoned and the request recomputes those blocks instead.
        nixl_progress_thread: run NIXL's progress thread; unset: on decodes (a prefill reads
            a decode's retained blocks while the decode's engine idles, and on transports that
            need the target's progress, such as UCX over TCP, the thread gives it), off on
            prefills (their engine steps drive progress, as in vLLM).
        nixl_progress_delay_ms: the longest a progress thread sleeps between UCX events (it
            wakes when traffic arrives); nixl's Python API would use 0, a busy loop.
        keep_thread_affinity: undo vLLM's CPU re-pinning of the model thread (CPU platforms).
        request_amx: ask Linux for AMX tile permission at start-up (x86 hosts with AMX).
        control_host: address the control endpoint binds (docs/http-api.md, section C).
            Loopback by default; in a fleet, an address inside the fleet network only, with
            a control secret (docs/connector.md, "Network exposure").
        control_port: its port; unset means no control endpoint, and then a decode retains
            nothing (nobody could pin, describe or release what it kept). With data parallelism
            each rank adds its index, like vLLM's NIXL side channel.
        control_secret_file: file holding the control API's shared secret; unset: the
            ``KVTURN_CONTROL_SECRET_FILE`` or ``KVTURN_CONTROL_SECRET`` environment variable;
            none of them: no authentication (a warning when the endpoint is not on loopback).
            The secret itself is never a config value: this config is on vLLM's command line.
        decoder_kv_blocks_ttl: seconds a decode keeps a finished conversation's KV unless
            renewed (vLLM's key, with kvturn's lease semantics: renewable, releasable).
        retention_max_hold: seconds no keepalive can extend a retention past, from its creation.
        retention_budget: fraction of the decode's KV blocks retentions may hold; 0 turns
            retention off. Live requests that need blocks evict retentions whatever the budget,
            so the default (all of it) only ever gives retentions blocks nothing else wants:
            docs/simulate.md, "Choosing the defaults", measured 0.5 against 1.0.
        retention_max_pin: cap, in seconds, on a read pin's lifetime.
        reuse_cost_model: ``"auto"``: a prefill reads a verified range only when the cost model
            (``_cost.py``) expects the read to be faster than computing it; ``"off"``: vLLM's
            ``kv_recompute_threshold`` alone decides. The threshold is a floor either way.
        read_fixed_ms: the cost of one read whatever its size, in ms (setup, the engine steps
            the request waits, the completion notice); unset: calibrated from this instance's
            reads.
        read_gbps: read bandwidth per worker in GB/s (10^9 bytes); unset: calibrated from NIXL's
            transfer telemetry.
        compute_tokens_per_s: prompt tokens this instance computes per second at context 0;
            unset: calibrated from its engine steps.
        compute_attention_tokens: the context length at which attention costs a token as much
            as the dense layers; unset: 6 x the model's hidden size.
    """

    kv_read_timeout: float = 20.0
    nixl_progress_thread: bool | None = None
    nixl_progress_delay_ms: float = 10.0
    keep_thread_affinity: bool = True
    request_amx: bool = True
    control_host: str = "127.0.0.1"
    control_port: int | None = None
    control_secret_file: str | None = None
    decoder_kv_blocks_ttl: float = 480.0
    retention_max_hold: float = 3600.0
    retention_budget: float = 1.0
    retention_max_pin: float = 300.0
    reuse_cost_model: str = "auto"
    read_fixed_ms: float | None = None
    read_gbps: float | None = None
    compute_tokens_per_s: float | None = None
    compute_attention_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.retention_max_hold < self.decoder_kv_blocks_ttl:
            raise ConnectorConfigError(
                f"kv_connector_extra_config.retention_max_hold ({self.retention_max_hold:g} s) "
                f"must be at least decoder_kv_blocks_ttl ({self.decoder_kv_blocks_ttl:g} s)")
        _choice("reuse_cost_model", self.reuse_cost_model)
        if self.reuse_cost_model == "off":
            pinned = [f.name for f in fields(CostSettings) if getattr(self, f.name) is not None]
            if pinned:
                raise ConnectorConfigError(
                    f"kv_connector_extra_config.{pinned[0]} has no effect with "
                    f"reuse_cost_model 'off' (the recompute threshold alone decides); remove "
                    f"it or set reuse_cost_model to 'auto'")

    def progress_thread(self, decode: bool) -> bool:
        """Whether this instance's NIXL agents run a progress thread (``decode``: its role)."""
        return decode if self.nixl_progress_thread is None else self.nixl_progress_thread

    @property
    def cost_settings(self) -> CostSettings:
        """The cost model's configured parameters (None: calibrated)."""
        return CostSettings(**{f.name: getattr(self, f.name) for f in fields(CostSettings)})

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Validate kvturn's keys in ``extra``; unknown keys are vLLM's and are left alone."""
        extra = extra or {}
        values: dict[str, Any] = {}
        for field in fields(cls):
            if field.name in extra:
                values[field.name] = _PARSERS[field.name](field.name, extra[field.name])
        return cls(**values)


Parser = Callable[[str, Any], Any]
"""Validates one key's raw JSON value (given the key's name, for the message)."""


def _invalid(name: str, what: str, raw: Any) -> ConnectorConfigError:
    return ConnectorConfigError(f"kv_connector_extra_config.{name} must be {what}, got {raw!r}")


def _number(what: str, ok: Callable[[Any], bool], *, whole: bool = False,
            optional: bool = False) -> Parser:
    """A parser of a number that ``ok`` accepts: a float, or an int with ``whole``; with
    ``optional`` also null (None: the default, or calibrated)."""
    kinds = int if whole else int | float

    def parse(name: str, raw: Any) -> Any:
        if optional and raw is None:
            return None
        # bool is an int subclass; true as a port or a TTL is a typo, not a 1.
        if isinstance(raw, bool) or not isinstance(raw, kinds) or not ok(raw):
            raise _invalid(name, what, raw)
        return raw if whole else float(raw)

    return parse


_seconds = _number("a positive number of seconds", lambda v: v > 0)
_delay = _number("a number of milliseconds above 0 and at most 1000", lambda v: 0 < v <= 1000)
_fraction = _number("a fraction from 0 to 1", lambda v: 0 <= v <= 1)
_port = _number("a TCP port (1-65535)", lambda v: 0 < v < 65536, whole=True, optional=True)
_rate = _number("a positive number, or null to calibrate it", lambda v: 0 < v < math.inf,
                optional=True)
_milliseconds = _number("a number of milliseconds >= 0, or null to calibrate it",
                        lambda v: 0 <= v < math.inf, optional=True)
_tokens = _number("a positive whole number of tokens, or null for the model's default",
                  lambda v: v >= 1, whole=True, optional=True)


def _flag(name: str, raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise _invalid(name, "true or false", raw)
    return raw


def _optional_flag(name: str, raw: Any) -> bool | None:
    if raw is not None and not isinstance(raw, bool):
        raise _invalid(name, "true, false or null (the role's default)", raw)
    return raw


def _host(name: str, raw: Any) -> str:
    if not isinstance(raw, str) or not raw:
        raise _invalid(name, "a host address", raw)
    if raw != "localhost":
        try:
            ipaddress.ip_address(raw)
        except ValueError as exc:
            raise _invalid(name, "an IP address or localhost", raw) from exc
    return raw


def _path(name: str, raw: Any) -> str | None:
    if raw is not None and (not isinstance(raw, str) or not raw):
        raise _invalid(name, "a file path", raw)
    return raw


def _choice(name: str, raw: Any) -> str:
    if raw not in COST_MODELS:
        raise _invalid(name, f"one of {', '.join(map(repr, COST_MODELS))}", raw)
    return str(raw)


_PARSERS: dict[str, Parser] = {
    "kv_read_timeout": _seconds,
    "nixl_progress_thread": _optional_flag,
    "nixl_progress_delay_ms": _delay,
    "keep_thread_affinity": _flag,
    "request_amx": _flag,
    "control_host": _host,
    "control_port": _port,
    "control_secret_file": _path,
    "decoder_kv_blocks_ttl": _seconds,
    "retention_max_hold": _seconds,
    "retention_budget": _fraction,
    "retention_max_pin": _seconds,
    "reuse_cost_model": _choice,
    "read_fixed_ms": _milliseconds,
    "read_gbps": _rate,
    "compute_tokens_per_s": _rate,
    "compute_attention_tokens": _tokens,
}
