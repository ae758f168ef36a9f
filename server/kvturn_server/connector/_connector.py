"""The class vLLM loads: ``{"kv_connector": "KVTurnConnector",
"kv_connector_module_path": "kvturn_server.connector"}``."""

from __future__ import annotations

import contextlib
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector

from kvturn_server.connector._config import ConnectorConfig, ConnectorConfigError
from kvturn_server.connector._host import (
    configure_nixl_agents,
    keep_thread_affinity,
    request_amx_permission,
)
from kvturn_server.connector._scheduler import KVTurnPullScheduler
from kvturn_server.connector._stats import KVTurnPromMetrics, KVTurnStats
from kvturn_server.connector._worker import KVTurnPullWorker


class KVTurnConnector(NixlBaseConnector):  # type: ignore[misc]
    """vLLM KV connector: NIXL pull transfers with kvturn's host fixes and bounded reads;
    content-verified reads of a decode's retained KV on prefills; retention leases, room for
    live requests and a control endpoint on decodes.

    The scheduler side runs in vLLM's EngineCore process, the worker side in each worker
    process; each role builds only its own half.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config
        self.kvturn_config = cfg = ConnectorConfig.from_extra(extra)
        _check_supported(transfer)
        if transfer.kv_role == "kv_producer":
            # A prefill reads decode KV only through kvturn's verified path, so vLLM's
            # bidirectional read is on unless the deployment turned it off explicitly.
            extra.setdefault("bidirectional_kv_xfer", True)
        super().__init__(vllm_config, role, kv_cache_config)
        self.connector_scheduler: KVTurnPullScheduler | None
        self.connector_worker: KVTurnPullWorker | None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVTurnPullScheduler(
                vllm_config, self.engine_id, kv_cache_config, config=cfg)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            if cfg.request_amx:
                request_amx_permission()
            configure_nixl_agents(cfg.progress_thread(transfer.kv_role == "kv_consumer"),
                                  cfg.nixl_progress_delay_ms)
            self.connector_scheduler = None
            with keep_thread_affinity(cfg.keep_thread_affinity):
                self.connector_worker = KVTurnPullWorker(
                    vllm_config, self.engine_id, kv_cache_config, config=cfg)
        else:
            raise ValueError(f"unsupported KV connector role {role!r}")

    # Scheduler side.

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.bind_block_pool(gpu_block_pool)

    def has_pending_block_frees(self) -> bool:
        return self.connector_scheduler is not None and \
            self.connector_scheduler.has_pending_block_frees()

    def get_kv_connector_stats(self) -> Any:
        if self.connector_scheduler is not None:
            return self.connector_scheduler.take_stats()
        return super().get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTurnStats:
        return KVTurnStats(data=data) if data is not None else KVTurnStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVTurnPromMetrics:
        return KVTurnPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # Worker side.

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.start_load_kv(self._connector_metadata)


def _check_supported(transfer: Any) -> None:
    """Refuse configurations kvturn cannot serve correctly, before vLLM builds anything."""
    from vllm.platforms import current_platform

    extra = transfer.kv_connector_extra_config
    if transfer.kv_role not in ("kv_producer", "kv_consumer"):
        raise ConnectorConfigError(
            f"KVTurnConnector needs kv_role 'kv_producer' (prefill) or 'kv_consumer' (decode), "
            f"got {transfer.kv_role!r}")
    if transfer.kv_role == "kv_consumer" and extra.get("bidirectional_kv_xfer"):
        raise ConnectorConfigError(
            "on a decode (kv_consumer) leave bidirectional_kv_xfer off: kvturn retains decode "
            "KV itself, under renewable leases; vLLM's mode would also pin every finished "
            "request for a fixed TTL")
    if current_platform.device_type != "cpu" and transfer.kv_buffer_device == "cpu":
        raise ConnectorConfigError(
            "KVTurnConnector needs the KV cache registered in place (kv_buffer_device = the "
            "accelerator): with a host staging buffer vLLM 0.32 never reads a decode's KV "
            "back into a prefill")


def _register_by_name() -> None:
    """Make ``KVTurnConnector`` known to vLLM's connector registry by name.

    vLLM loads the class by module path, but ``MultiConnector`` rebuilds each child's stats in
    the API server from the child's class name alone (``KVConnectorFactory.
    get_connector_class_by_name``), which knows only registered names: beside vLLM's CPU
    offloading (docs/cpu-stack.md) the first stats then killed the API server's output handler
    ("Connector 'KVTurnConnector' is not registered"). Every process that resolves the class
    imports this module first, the API server included (it builds the children's metrics).
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # registered already: this module imported twice
        KVConnectorFactory.register_connector("KVTurnConnector", __name__, "KVTurnConnector")


_register_by_name()
