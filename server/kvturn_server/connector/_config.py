"""The connector's own settings, read from ``kv_connector_extra_config``."""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvturn_server._defaults import RETENTION_BUDGET, RETENTION_MAX_HOLD, RETENTION_TTL
from kvturn_server._settings import markdown_table, setting, settings_of
from kvturn_server.connector._cost import CostSettings

COST_MODELS = ("auto", "off")


class ConnectorConfigError(ValueError):
    """A ``kv_connector_extra_config`` value kvturn cannot use."""


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


@dataclass(frozen=True)
class ConnectorConfig:
    """kvturn's keys in ``kv_connector_extra_config`` (vLLM's own NIXL keys pass through).

    One field per key, documented in its ``setting(...)``: the validation of
    :meth:`from_extra`, ``kvturn up``'s help for the keys it sets and the settings table of
    docs/connector.md are built from these fields (``kvturn_server._settings``). vLLM's own
    ``kv_recompute_threshold`` (a shorter verified range is recomputed) is read by vLLM's NIXL
    scheduler, which kvturn's extends.
    """

    control_port: int | None = field(default=None, metadata=setting(
        "port of the control endpoint (plus the data-parallel rank, like vLLM's NIXL side "
        "channel); unset means no control endpoint, and a decode then retains nothing (nobody "
        "could pin, describe or release what it kept)", check=_port))
    control_host: str = field(default="127.0.0.1", metadata=setting(
        "the address the control endpoint binds (IP or localhost; docs/http-api.md, section "
        "C). In a fleet, an address inside the fleet network only, with a control secret "
        "(\"Network exposure\"). A decode reports its control URL in "
        "kv_transfer_params.kvturn.control with this address, or with its "
        "VLLM_NIXL_SIDE_CHANNEL_HOST when this is a wildcard (0.0.0.0, ::)", check=_host))
    control_secret_file: str | None = field(default=None, metadata=setting(
        "file holding the control API's shared secret (else $KVTURN_CONTROL_SECRET_FILE, else "
        "$KVTURN_CONTROL_SECRET; none: no authentication, and a warning when control_host is "
        "not loopback). The secret itself is never a key here: this config is on vLLM's "
        "command line", check=_path))
    decoder_kv_blocks_ttl: float = field(default=RETENTION_TTL, metadata=setting(
        "lease of a retention: seconds a decode keeps a finished conversation's KV unless "
        "renewed by keepalive (vLLM's key, with kvturn's lease semantics: renewable, "
        "releasable; kvturn up --retention-ttl, the router's retention_ttl)", unit="s",
        check=_seconds))
    retention_max_hold: float = field(default=RETENTION_MAX_HOLD, metadata=setting(
        "no keepalive extends a retention past this many seconds after its creation",
        unit="s", check=_seconds))
    retention_budget: float = field(default=RETENTION_BUDGET, metadata=setting(
        "fraction of the decode's KV blocks retentions may hold; 0 turns retention off. Live "
        "requests evict retentions whenever they need blocks (least recently used first, "
        "never a pinned one), so retentions only ever hold blocks nothing else wants; a lower "
        "budget keeps the rest for vLLM's plain prefix cache (1.0 against 0.5: "
        "docs/simulate.md, \"Choosing the defaults\")", check=_fraction))
    retention_max_pin: float = field(default=300.0, metadata=setting(
        "cap on one read pin's life", unit="s", check=_seconds))
    kv_read_timeout: float = field(default=20.0, metadata=setting(
        "seconds a NIXL read of remote blocks may stay in flight before it is abandoned and "
        "the request recomputes those blocks instead", unit="s", check=_seconds))
    reuse_cost_model: str = field(default="auto", metadata=setting(
        "auto: a prefill reads a verified range only when the cost model (_cost.py) expects "
        "the read to be faster than computing it; off: vLLM's kv_recompute_threshold alone "
        "decides. The threshold is a floor either way", choices=COST_MODELS, check=_choice))
    read_fixed_ms: float | None = field(default=None, metadata=setting(
        "the cost of one read whatever its size, in ms (setup, the engine steps the request "
        "waits, the completion notice; 0 allowed); null: calibrated from this instance's "
        "reads", default_doc="calibrated", check=_milliseconds))
    read_gbps: float | None = field(default=None, metadata=setting(
        "read bandwidth per worker in GB/s (10^9 bytes); null: calibrated from NIXL's "
        "transfer telemetry", default_doc="calibrated", check=_rate))
    compute_tokens_per_s: float | None = field(default=None, metadata=setting(
        "prompt tokens this instance computes per second at context 0; null: calibrated from "
        "its engine steps", default_doc="calibrated", check=_rate))
    compute_attention_tokens: int | None = field(default=None, metadata=setting(
        "the context length at which attention costs a token as much as the dense layers",
        default_doc="6 x the model's hidden size", check=_tokens))
    nixl_progress_thread: bool | None = field(default=None, metadata=setting(
        "run NIXL's progress thread. Unset: on decodes (a prefill reads a decode's retained "
        "blocks while the decode's engine idles, and on transports that need the target's "
        "progress, such as UCX over TCP, the thread gives it), off on prefills (their engine "
        "steps drive progress, as in vLLM)", default_doc="on decodes",
        check=_optional_flag))
    nixl_progress_delay_ms: float = field(default=10.0, metadata=setting(
        "the longest a progress thread sleeps between UCX events, in ms (it wakes when "
        "traffic arrives); nixl's Python API would use 0, a busy loop", unit="ms",
        check=_delay))
    keep_thread_affinity: bool = field(default=True, metadata=setting(
        "undo vLLM's CPU re-pinning of the model thread (CPU platforms)", default_doc="true",
        check=_flag))
    request_amx: bool = field(default=True, metadata=setting(
        "ask Linux for AMX tile permission at start-up (x86 hosts with AMX)",
        default_doc="true", check=_flag))

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
        for f, meta in settings_of(cls):
            if f.name in extra:
                raw = extra[f.name]
                values[f.name] = raw if meta.check is None else meta.check(f.name, raw)
        return cls(**values)


def settings_table() -> str:
    """The connector's keys as a Markdown table (docs/connector.md holds a copy)."""
    return markdown_table(ConnectorConfig, key="key", flags=False)
