"""The connector's own settings, read from ``kv_connector_extra_config``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


class ConnectorConfigError(ValueError):
    """A ``kv_connector_extra_config`` value kvturn cannot use."""


@dataclass(frozen=True)
class ConnectorConfig:
    """kvturn's keys in ``kv_connector_extra_config`` (vLLM's own NIXL keys pass through).

    Attributes:
        kv_read_timeout: seconds a NIXL read of remote blocks may stay in flight before it is
            abandoned and the request recomputes those blocks instead.
        nixl_progress_thread: start NIXL's progress thread. Off by default: it busy-polls a core,
            and the connector's per-step polling already drives transfers.
        keep_thread_affinity: undo vLLM's CPU re-pinning of the model thread (CPU platforms).
        request_amx: ask Linux for AMX tile permission at start-up (x86 hosts with AMX).
    """

    kv_read_timeout: float = 20.0
    nixl_progress_thread: bool = False
    keep_thread_affinity: bool = True
    request_amx: bool = True

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = extra or {}
        values: dict[str, Any] = {}
        for field in fields(cls):
            if field.name not in extra:
                continue
            raw = extra[field.name]
            if field.type == "float":
                if isinstance(raw, bool) or not isinstance(raw, int | float) or raw <= 0:
                    raise ConnectorConfigError(
                        f"kv_connector_extra_config.{field.name} must be a positive number "
                        f"of seconds, got {raw!r}")
                values[field.name] = float(raw)
            elif field.type == "bool":
                if not isinstance(raw, bool):
                    raise ConnectorConfigError(
                        f"kv_connector_extra_config.{field.name} must be true or false, "
                        f"got {raw!r}")
                values[field.name] = raw
        return cls(**values)
