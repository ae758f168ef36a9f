"""vLLM's CPU offloading spec, made to run on vLLM's CPU platform.

``OffloadingConnector`` with ``spec_name: "HostOffloadingSpec"`` and ``spec_module_path:
"kvturn_server.offload"`` (vLLM's documented way to load an offloading spec from outside the
tree). Everything on the scheduler side is vLLM's own ``CPUOffloadingSpec``: its
``CPUOffloadingManager`` (the host tier's chunks, LRU or ARC eviction, ``cpu_bytes_to_use``,
``store_threshold``), lookups, store and load jobs, metrics. Only the worker differs, and only on
the CPU platform, where vLLM's worker refuses to start ("CPU Offloading is currently only supported
on CUDA-alike and XPU GPUs"): there it is ``HostCopyWorker``. On CUDA and XPU it is vLLM's.
"""

from __future__ import annotations

from typing import Any

from vllm.platforms import current_platform
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvturn_server.offload._worker import HostCopyWorker


class HostOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """``CPUOffloadingSpec`` with a worker for the CPU platform."""

    _worker: Any  # vLLM's slot for the worker it builds once (None until then)

    def get_worker(self, kv_caches: Any) -> Any:
        if current_platform.device_type != "cpu":
            return super().get_worker(kv_caches)
        if self._worker is None:
            if self.config.canonical_layout:
                raise ValueError("HostOffloadingSpec copies the engine's own block layout; "
                                 "leave canonical_layout off on the CPU platform")
            self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker
