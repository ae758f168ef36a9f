"""kvturn's vLLM KV connector (imports vLLM and NIXL: load it inside vLLM processes)."""

from kvturn_server.connector._config import ConnectorConfig, ConnectorConfigError
from kvturn_server.connector._connector import KVTurnConnector

__all__ = ["ConnectorConfig", "ConnectorConfigError", "KVTurnConnector"]
