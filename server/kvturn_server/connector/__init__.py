"""kvturn's vLLM KV connector.

vLLM loads it with ``{"kv_connector": "KVTurnConnector",
"kv_connector_module_path": "kvturn_server.connector"}``. The connector class imports vLLM and
NIXL, so it is loaded on first access; the decision logic and the config import without them.

The plain-Python decision logic is public too, for the packages that run it outside vLLM: the
simulator (``kvturn_server.sim``: retention table, verified reuse, cost model) and the host tier
(``kvturn_server.offload``: the lease view its eviction order reads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvturn_server.connector._config import (
    ConnectorConfig,
    ConnectorConfigError,
    settings_table,
)
from kvturn_server.connector._cost import CostModel, CostSettings
from kvturn_server.connector._hashing import HASH_SIZE, verified_prefix_blocks
from kvturn_server.connector._lease import Retention
from kvturn_server.connector._params import HOST_ENGINE_SUFFIX, HostRead, conversation_key
from kvturn_server.connector._retention import RetentionTable
from kvturn_server.connector._reuse import decide_reuse
from kvturn_server.connector._tiers import (
    HostCounters,
    HostLoad,
    LeaseView,
    Standing,
    TierLink,
    tier_link,
)

if TYPE_CHECKING:
    from kvturn_server.connector._connector import KVTurnConnector
    from kvturn_server.connector._worker import registered_nixl_worker

__all__ = [
    "HASH_SIZE",
    "HOST_ENGINE_SUFFIX",
    "ConnectorConfig",
    "ConnectorConfigError",
    "CostModel",
    "CostSettings",
    "HostCounters",
    "HostLoad",
    "HostRead",
    "KVTurnConnector",
    "LeaseView",
    "Retention",
    "RetentionTable",
    "Standing",
    "TierLink",
    "conversation_key",
    "decide_reuse",
    "registered_nixl_worker",
    "settings_table",
    "tier_link",
    "verified_prefix_blocks",
]


def __getattr__(name: str) -> Any:
    if name == "KVTurnConnector":
        from kvturn_server.connector._connector import KVTurnConnector

        return KVTurnConnector
    if name == "registered_nixl_worker":
        from kvturn_server.connector._worker import registered_nixl_worker

        return registered_nixl_worker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
