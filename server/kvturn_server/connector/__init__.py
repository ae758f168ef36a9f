"""kvturn's vLLM KV connector.

vLLM loads it with ``{"kv_connector": "KVTurnConnector",
"kv_connector_module_path": "kvturn_server.connector"}``. The connector class imports vLLM and
NIXL, so it is loaded on first access; the decision logic and the config import without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvturn_server.connector._config import ConnectorConfig, ConnectorConfigError

if TYPE_CHECKING:
    from kvturn_server.connector._connector import KVTurnConnector

__all__ = ["ConnectorConfig", "ConnectorConfigError", "KVTurnConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTurnConnector":
        from kvturn_server.connector._connector import KVTurnConnector

        return KVTurnConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
