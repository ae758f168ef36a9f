"""The host tier's copies on vLLM's CPU platform, where the "device" KV cache is host memory too.

vLLM's own ``CPUOffloadingWorker`` copies with CUDA streams, events and a CUDA kernel
(``ops.swap_blocks_batch``) and refuses any other platform. Here both sides are ordinary host
tensors, so a copy is one memcpy per run of consecutive blocks (``_rows.py``), done when
submitted, through numpy views: single-threaded. torch's ``copy_`` splits a copy over the OpenMP
threads, and where the engines share the cores one straggling thread holds up the whole copy
(measured for 7.5 MiB on the 2-core host under load: torch p50 31 ms, numpy 0.56 ms).

The connector submits stores at the start of the engine step after the one that computed their
blocks, and loads before the forward that needs them, both on the worker's own thread: a copy
done in place is ordered before anything that could change its blocks, and ``wait`` has nothing
left to wait for. Each copy's time goes with its result into vLLM's ``vllm:kv_offload_*``
metrics.

A copy that fails (it raises) is finished all the same: vLLM 0.32's offloading worker asserts
that every job succeeded and would die on ``success=False``. The failure is kept apart instead,
for the host-tier connector (``_connector.py``) to report: the destination blocks of a failed
load (:meth:`HostCopyWorker.take_load_errors`, which vLLM recomputes) and the failed jobs
(:meth:`HostCopyWorker.take_failed_jobs`, whose chunks the scheduler side discards).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

from kvturn_server.offload._reads import HostReadEndpoint, start_endpoint
from kvturn_server.offload._rows import transfer_rows

log = logging.getLogger("kvturn.offload")


class HostCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """Copies block pages between the engine's KV tensors and a host tensor per KV tensor."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_chunks: int) -> None:
        self._blocks_per_chunk = blocks_per_chunk
        # One (num_blocks, page bytes) int8 view per KV tensor, as vLLM's connector built them.
        self._device: list[torch.Tensor] = [t.tensor.detach() for t in kv_caches.tensors]
        # Allocated and touched up front, as vLLM's own worker does (cpu_bytes_to_use is a budget
        # the operator gives away): a store into pages the kernel has not committed yet pays
        # their page faults (measured: 24 ms for 4 MiB against 0.2 ms into touched pages).
        self._host: list[torch.Tensor] = [
            torch.zeros((num_chunks * blocks_per_chunk, t.page_size_bytes), dtype=torch.int8)
            for t in kv_caches.tensors]
        # numpy views of the same memory, made once: the copies go through them.
        self._device_np: list[Any] = [t.numpy() for t in self._device]
        self._host_np: list[Any] = [t.numpy() for t in self._host]
        # Per KV-cache group: (tensor index, bytes of each block page that hold KV).
        self._refs: list[list[tuple[int, int]]] = [
            [(r.tensor_idx, r.page_size_bytes) for r in refs]
            for refs in kv_caches.group_data_refs]
        self.read_endpoint: HostReadEndpoint | None = None  # set by the spec (host_reads)
        self._port_reported = False
        self._finished: list[TransferResult] = []
        self._load_errors: set[int] = set()
        self._failed_jobs: set[int] = set()
        log.info("host KV tier: %d chunks of %d block(s), %.1f MiB in %d tensor(s)",
                 num_chunks, blocks_per_chunk,
                 sum(h.numel() for h in self._host) / 2**20, len(self._host))

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self._finished.append(self._run(job_id, src_spec, dst_spec.block_ids, to_host=True))
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self._finished.append(self._run(job_id, dst_spec, src_spec.block_ids, to_host=False))
        return True

    def get_finished(self) -> list[TransferResult]:
        if self.read_endpoint is not None:
            self.read_endpoint.drain()
        done, self._finished = self._finished, []
        return done

    def serve_reads(self, engine_id: str) -> HostReadEndpoint | None:
        """Make the host tensors readable by prefills over NIXL (``_reads.py``)."""
        # Bytes of each tensor's block that every copy writes: what a read may take.
        pages = [min((p for refs in self._refs for i, p in refs if i == t), default=0)
                 for t in range(len(self._host))]
        self.read_endpoint = start_endpoint(engine_id, self._device, self._host, pages)
        return self.read_endpoint

    def take_read_port(self) -> int | None:
        """The read endpoint's port, once: the scheduler side keeps it (``_connector.py``)."""
        if self.read_endpoint is None or self._port_reported:
            return None
        self._port_reported = True
        return self.read_endpoint.port

    def take_load_errors(self) -> set[int]:
        """Device blocks that failed loads left unwritten, since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_jobs(self) -> set[int]:
        """Jobs (stores and loads) whose copy failed, since the last call."""
        failed, self._failed_jobs = self._failed_jobs, set()
        return failed

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy completed when it was submitted

    def shutdown(self) -> None:
        if self.read_endpoint is not None:
            self.read_endpoint.close()
            self.read_endpoint = None
        for views in (self._host_np, self._device_np, self._host, self._device):
            views.clear()

    def _run(self, job_id: int, device_spec: Any, host_chunks: Any,
             *, to_host: bool) -> TransferResult:
        try:
            return self._copy(job_id, device_spec, host_chunks, to_host=to_host)
        except Exception:
            log.exception("host KV tier: %s job %d failed; %s", "store" if to_host else "load",
                          job_id, "its chunks are discarded" if to_host
                          else "its blocks are recomputed")
            self._failed_jobs.add(job_id)
            if not to_host:
                self._load_errors.update(int(b) for b in device_spec.block_ids.tolist())
            # Finished, not successful: see the module docstring. No size or time, so that
            # vLLM's transfer metrics count only real copies.
            return TransferResult(job_id=job_id, success=True)

    def _copy(self, job_id: int, device_spec: Any, host_chunks: Any,
              *, to_host: bool) -> TransferResult:
        started = time.perf_counter()
        moved = 0
        for part in transfer_rows(device_spec.block_ids.tolist(), host_chunks.tolist(),
                                  device_spec.group_sizes, device_spec.block_indices,
                                  self._blocks_per_chunk):
            runs = part.runs()
            for tensor_idx, page in self._refs[part.group]:
                device, host = self._device_np[tensor_idx], self._host_np[tensor_idx]
                for d, h, n in runs:
                    # A slice past the end would copy nothing, silently: fail the job instead.
                    if d < 0 or h < 0 or d + n > len(device) or h + n > len(host):
                        raise ValueError(f"blocks {d}..{d + n - 1} / host rows {h}..{h + n - 1}"
                                         f" outside {len(device)} / {len(host)}")
                    if to_host:
                        host[h:h + n, :page] = device[d:d + n, :page]
                    else:
                        device[d:d + n, :page] = host[h:h + n, :page]
                moved += len(part.device) * page
        return TransferResult(job_id=job_id, success=True, transfer_size=moved,
                              transfer_time=time.perf_counter() - started)
