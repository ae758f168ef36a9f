"""The decode's host tier: vLLM's CPU KV offloading under kvturn's lease (docs/connector.md,
"The host tier"), runnable on vLLM's CPU platform (docs/cpu-stack.md, "vLLM's CPU offloading").

``with_offloading`` puts it beside kvturn's connector in a ``MultiConnector``:
``{"kv_connector": "HostTierConnector", "kv_connector_module_path": "kvturn_server.offload",
"kv_connector_extra_config": {"spec_name": "HostOffloadingSpec", "spec_module_path":
"kvturn_server.offload", "cpu_bytes_to_use": N, "eviction_policy": "kvturn", ...}}``.

What it evicts first is decided in ``_order.py`` (no vLLM); ``_policy.py``, ``_manager.py``,
``_spec.py``, ``_connector.py`` and ``_worker.py`` bind that and kvturn's keeper to vLLM's
offloading connector. Those import vLLM and torch, so they are loaded on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvturn_server.offload._config import offloading_connector, with_offloading

if TYPE_CHECKING:
    from kvturn_server.offload._connector import HostTierConnector
    from kvturn_server.offload._spec import HostOffloadingSpec

__all__ = ["HostOffloadingSpec", "HostTierConnector", "offloading_connector", "with_offloading"]


def __getattr__(name: str) -> Any:
    if name == "HostOffloadingSpec":
        from kvturn_server.offload._spec import HostOffloadingSpec

        return HostOffloadingSpec
    if name == "HostTierConnector":
        from kvturn_server.offload._connector import HostTierConnector

        return HostTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
