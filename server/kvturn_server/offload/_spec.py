"""vLLM's CPU offloading spec, made to run on vLLM's CPU platform and to serve kvturn's lease.

``OffloadingConnector`` (or kvturn's ``HostTierConnector``) with ``spec_name:
"HostOffloadingSpec"`` and ``spec_module_path: "kvturn_server.offload"`` (vLLM's documented way
to load an offloading spec from outside the tree). It is vLLM's own ``CPUOffloadingSpec``
(``cpu_bytes_to_use``, ``eviction_policy``, ``store_threshold``, lookups, store and load jobs,
metrics) with two differences:

- its manager is ``HostTierManager``: vLLM's ``CPUOffloadingManager`` plus what kvturn's keeper
  needs of a host tier (discards, load notes), linked to the keeper through the engine id
  (``kvturn_server.connector._tiers``); with ``eviction_policy: "kvturn"`` its cache policy
  evicts in the lease's order (``_policy.py``, ``_order.py``);
- on the CPU platform, where vLLM's worker refuses to start ("CPU Offloading is currently only
  supported on CUDA-alike and XPU GPUs"), its worker is ``HostCopyWorker``. On CUDA and XPU it
  is vLLM's.
"""

from __future__ import annotations

from typing import Any

from vllm.platforms import current_platform
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvturn_server.connector import tier_link
from kvturn_server.offload._manager import HostTierManager
from kvturn_server.offload._worker import HostCopyWorker


def host_reads(extra: dict[str, Any]) -> bool:
    """Whether prefills may read this host tier over NIXL (``_reads.py``; decodes only).
    On by default: a router asks for it per pin (``host_reads``), so one that does not gets
    the answers it always got."""
    value = extra.get("host_reads", True)
    if not isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config.host_reads must be true or false, "
                         f"got {value!r}")
    return value


class HostOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """``CPUOffloadingSpec`` with kvturn's manager, and a worker for the CPU platform."""

    _worker: Any  # vLLM's slots for what it builds once (None until then)
    _manager: Any

    def get_manager(self) -> Any:
        if self._manager is None:
            extra = self.extra_config
            store_one_offs = extra.get("store_one_offs", True)
            if not isinstance(store_one_offs, bool):
                raise ValueError(f"kv_connector_extra_config.store_one_offs must be true or "
                                 f"false, got {store_one_offs!r}")
            # The arguments vLLM's CPUOffloadingSpec.get_manager gives its manager, read the
            # same way (tests/server/offload/test_offload.py pins them).
            self._manager = HostTierManager(
                link=tier_link(self.config.engine_id),
                tokens_per_block=self.tokens_per_block[0] * self.blocks_per_chunk,
                store_one_offs=store_one_offs, blocks_per_chunk=self.blocks_per_chunk,
                num_chunks=self.num_chunks, cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(extra.get("store_threshold", 0)),
                max_tracker_size=int(extra.get("max_tracker_size", 64_000)))
        return self._manager

    def get_worker(self, kv_caches: Any) -> Any:
        if current_platform.device_type != "cpu":
            return super().get_worker(kv_caches)
        if self._worker is None:
            if self.config.canonical_layout:
                raise ValueError("HostOffloadingSpec copies the engine's own block layout; "
                                 "leave canonical_layout off on the CPU platform")
            self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
            if host_reads(self.extra_config):
                self._worker.serve_reads(self.config.engine_id)
        return self._worker
