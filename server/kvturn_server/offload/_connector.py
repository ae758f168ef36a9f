"""The host tier's connector: vLLM's ``OffloadingConnector`` that tells kvturn what it loaded,
and survives a failed copy.

``{"kv_connector": "HostTierConnector", "kv_connector_module_path": "kvturn_server.offload"}``
(``_config.py`` builds it beside kvturn's connector in a ``MultiConnector``). Everything else is
vLLM's offloading connector with kvturn's spec (``_spec.py``). What it adds:

- **What a request loaded.** vLLM tells only the connector it chose how many tokens a request
  loads; this one notes them with the manager (``HostTierManager.note_load``), where kvturn's
  decode side reads them into the turn's reuse report (``host_tokens``), and forgets them when
  the request finishes.
- **A failed copy.** vLLM 0.32's offloading worker asserts that every transfer succeeded ("we
  currently do not support job failures") and never reports blocks that failed to load, so a
  failed copy would kill the worker. kvturn's host-copy worker (``_worker.py``) completes a
  failed job as done and reports it apart: the destination blocks of a failed load through
  ``get_block_ids_with_load_errors`` (vLLM then recomputes from the first of them:
  ``kv_load_failure_policy: "recompute"``, which the ``MultiConnector`` carries from kvturn's
  config), and every failed job, through :class:`HostWorkerMetadata`, to the scheduler side,
  which discards the job's chunks: a failed store's chunks hold garbage, a failed load's would
  fail again. The request's next look-up misses them and it is computed: one failed load, then
  recompute, as for a failed NIXL read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvturn_server.offload._manager import HostTierManager
from kvturn_server.offload._worker import HostCopyWorker


@dataclass
class HostWorkerMetadata(OffloadingWorkerMetadata):  # type: ignore[misc]
    """vLLM's worker-to-scheduler note of completed jobs, plus those whose copy failed."""

    failed_jobs: set[int] = field(default_factory=set)
    read_port: int | None = None
    """The port of the worker's host read side channel (``_reads.py``), until reported."""

    def aggregate(self, other: Any) -> HostWorkerMetadata:
        merged = super().aggregate(other)
        return HostWorkerMetadata(completed_jobs=merged.completed_jobs,
                                  transfer_stats=merged.transfer_stats,
                                  failed_jobs=self.failed_jobs | getattr(other, "failed_jobs",
                                                                         set()),
                                  read_port=self.read_port or getattr(other, "read_port", None))


@dataclass(frozen=True)
class FailedJob:
    """A transfer job whose copy failed, as the scheduler side knew it."""

    request_id: str
    keys: frozenset[bytes]
    is_store: bool


def failed_jobs(meta: Any, jobs: Mapping[int, Any]) -> list[FailedJob]:
    """The jobs ``meta`` reports failed, looked up in the scheduler's job table (vLLM's
    ``TransferJobStatus``: ``req_id``, ``keys``, ``is_store``). Jobs from before a cache reset
    are no longer in the table: their chunks are gone already."""
    if not isinstance(meta, HostWorkerMetadata):
        return []
    return [FailedJob(status.req_id, frozenset(status.keys), status.is_store)
            for job_id in sorted(meta.failed_jobs) if (status := jobs.get(job_id)) is not None]


class HostTierConnector(OffloadingConnector):  # type: ignore[misc]
    """vLLM's offloading connector, reporting host loads to kvturn and surviving failed copies."""

    # Scheduler side.

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        manager = self._host_manager()
        if manager is not None and num_external_tokens > 0:
            manager.note_load(request.request_id, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        # Read the failed jobs before vLLM completes them (and forgets their keys).
        failed = failed_jobs(connector_output.kv_connector_worker_meta, self.scheduler._jobs)
        super().update_connector_output(connector_output)
        manager = self._host_manager()
        if manager is None:
            return
        port = getattr(connector_output.kv_connector_worker_meta, "read_port", None)
        if port is not None:
            manager.read_port = port
        for job in failed:
            manager.discard_keys(job.keys)
            if not job.is_store:
                manager.note_load_failed(job.request_id)

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        result: tuple[bool, dict[str, Any] | None] = super().request_finished(request, block_ids)
        self._forget(request)
        return result

    def request_finished_all_groups(
            self, request: Any,
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        result: tuple[bool, dict[str, Any] | None] = super().request_finished_all_groups(
            request, block_ids)
        self._forget(request)
        return result

    # Worker side.

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._host_worker()
        return worker.take_load_errors() if worker is not None else set()

    def build_connector_worker_meta(self) -> HostWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        worker = self._host_worker()
        failed = worker.take_failed_jobs() if worker is not None else set()
        port = worker.take_read_port() if worker is not None else None
        if meta is None and not failed and port is None:
            return None
        base = meta if meta is not None else OffloadingWorkerMetadata()
        # Always this class, so that aggregating several workers' notes keeps the failures.
        return HostWorkerMetadata(completed_jobs=base.completed_jobs,
                                  transfer_stats=base.transfer_stats, failed_jobs=failed,
                                  read_port=port)

    # Internals.

    def _host_manager(self) -> HostTierManager | None:
        scheduler = self.connector_scheduler
        manager = scheduler.manager if scheduler is not None else None
        return manager if isinstance(manager, HostTierManager) else None

    def _host_worker(self) -> HostCopyWorker | None:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        return worker if isinstance(worker, HostCopyWorker) else None

    def _forget(self, request: Any) -> None:
        # kvturn's connector, first in the MultiConnector, has taken the note of a conversation
        # turn already; anything else is dropped here.
        manager = self._host_manager()
        if manager is not None:
            manager.forget_load(request.request_id)


def _register_by_name() -> None:
    """Make ``HostTierConnector`` known to vLLM's connector registry by name: ``MultiConnector``
    rebuilds each child's stats in the API server from the child's class name alone
    (``KVConnectorFactory.get_connector_class_by_name``), as for ``KVTurnConnector``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # registered already
        KVConnectorFactory.register_connector("HostTierConnector", __name__,
                                              "HostTierConnector")


_register_by_name()
