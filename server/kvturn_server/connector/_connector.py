"""The class vLLM loads: ``{"kv_connector": "KVTurnConnector",
"kv_connector_module_path": "kvturn_server.connector"}``."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector

from kvturn_server.connector._config import ConnectorConfig
from kvturn_server.connector._host import (
    default_nixl_progress_thread,
    keep_thread_affinity,
    request_amx_permission,
)
from kvturn_server.connector._scheduler import KVTurnPullScheduler
from kvturn_server.connector._worker import KVTurnPullWorker


class KVTurnConnector(NixlBaseConnector):  # type: ignore[misc]
    """vLLM KV connector: NIXL pull transfers with kvturn's host fixes, bounded reads and, in
    vLLM's bidirectional mode, content-verified reads of the decode's retained blocks.

    The scheduler side runs in vLLM's EngineCore process, the worker side in each worker
    process; each role builds only its own half.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.kvturn_config = ConnectorConfig.from_extra(extra)
        self.connector_scheduler: KVTurnPullScheduler | None
        self.connector_worker: KVTurnPullWorker | None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVTurnPullScheduler(
                vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            cfg = self.kvturn_config
            if cfg.request_amx:
                request_amx_permission()
            default_nixl_progress_thread(cfg.nixl_progress_thread)
            self.connector_scheduler = None
            with keep_thread_affinity(cfg.keep_thread_affinity):
                self.connector_worker = KVTurnPullWorker(
                    vllm_config, self.engine_id, kv_cache_config, config=cfg)
        else:
            raise ValueError(f"unsupported KV connector role {role!r}")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.start_load_kv(self._connector_metadata)
