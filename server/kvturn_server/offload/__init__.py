"""vLLM's CPU KV offloading on vLLM's CPU platform (docs/cpu-stack.md, "vLLM's CPU offloading").

Loaded by vLLM from ``kv_connector_extra_config`` of an ``OffloadingConnector``:
``{"spec_name": "HostOffloadingSpec", "spec_module_path": "kvturn_server.offload",
"cpu_bytes_to_use": N}``; ``with_offloading`` builds that connector beside another one in a
``MultiConnector``. The spec imports vLLM and torch, so it is loaded on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvturn_server.offload._config import offloading_connector, with_offloading

if TYPE_CHECKING:
    from kvturn_server.offload._spec import HostOffloadingSpec

__all__ = ["HostOffloadingSpec", "offloading_connector", "with_offloading"]


def __getattr__(name: str) -> Any:
    if name == "HostOffloadingSpec":
        from kvturn_server.offload._spec import HostOffloadingSpec

        return HostOffloadingSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
