"""Worker side: vLLM's NIXL pull worker plus a deadline on every read of remote blocks, and
recognition of reads of this decode's retentions."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from kvturn_server.connector._config import ConnectorConfig
from kvturn_server.connector._stats import KVTurnStats

READ_NOTIF_PREFIX = b"kvturn-read/"
"""Completion notifications of prefills that read a retention (see ``_params.READ_PREFIX``).
vLLM would treat them as "this request's blocks may be freed now" for a request it no longer
knows; a retention outlives its request and is freed by its lease instead."""


_registered: dict[str, KVTurnPullWorker] = {}


def registered_nixl_worker(engine_id: str) -> KVTurnPullWorker | None:
    """kvturn's NIXL worker of ``engine_id`` in this (worker) process, once it registered its
    KV caches: the decode's host tier serves prefills a copy of its handshake metadata
    (``kvturn_server.offload._reads``)."""
    return _registered.get(engine_id)


class KVTurnPullWorker(NixlPullConnectorWorker):  # type: ignore[misc]
    """Reads remote KV like vLLM's pull worker, but never waits on a read forever.

    vLLM polls a posted NIXL read until it reports DONE or an error. A read whose peer stops
    making progress (a wedged or paused prefill, a transport that lost its peer) stays "in
    progress" indefinitely and its request never leaves WAITING_FOR_REMOTE_KVS. Here each
    request's reads carry a deadline; past it they are treated as failed, which vLLM's
    ``kv_load_failure_policy="recompute"`` turns into a local recompute of those blocks.
    """

    def __init__(self, *args: Any, config: ConnectorConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kvturn_config = config
        self._read_deadlines: dict[str, float] = {}
        self._abandoned: set[str] = set()
        self.xfer_stats = KVTurnStats()
        self.nixl_wrapper.get_new_notifs = _drop_retention_reads(
            self.nixl_wrapper.get_new_notifs, self._count_read_served)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        # vLLM's MultiConnector registers its children in order, kvturn's first: the host
        # tier's worker, built next in this process, finds this one here.
        _registered[self.engine_id] = self

    def _count_read_served(self) -> None:
        self.xfer_stats.record("kvturn_reads_served", 1)

    def _pop_done_transfers(
        self, transfers: dict[str, list[int]]
    ) -> tuple[set[str], set[str]]:
        now = time.monotonic()
        failed: set[str] = set()
        for req_id in list(transfers):
            deadline = self._read_deadlines.setdefault(
                req_id, now + self.kvturn_config.kv_read_timeout)
            if now < deadline:
                continue
            if req_id not in self._abandoned:
                self._abandoned.add(req_id)
                self.xfer_stats.record("kvturn_read_timeouts", 1)
                self._log_failure(
                    failure_type="transfer_timeout", req_id=req_id,
                    msg=f"read still in flight after {self.kvturn_config.kv_read_timeout:g} s; "
                        "abandoning it, the blocks are recomputed")
            # A handle NIXL refuses to release stays: its blocks may still be written to.
            kept = [h for h in transfers[req_id]
                    if not self._handle_failed_transfer(req_id, h, failed)]
            if kept:
                transfers[req_id] = kept
            else:
                del transfers[req_id]
        done, newly_failed = super()._pop_done_transfers(transfers)
        for req_id in list(self._read_deadlines):
            if req_id not in transfers:
                del self._read_deadlines[req_id]
                self._abandoned.discard(req_id)
        return done, newly_failed | failed


def _drop_retention_reads(
    get_new_notifs: Callable[[], dict[str, list[bytes]]], on_read: Callable[[], None],
) -> Callable[[], dict[str, list[bytes]]]:
    """Wrap ``nixl_agent.get_new_notifs`` so vLLM never sees retention-read notifications."""

    def filtered() -> dict[str, list[bytes]]:
        notifs = get_new_notifs()
        for agent, messages in notifs.items():
            kept = [m for m in messages if not m.startswith(READ_NOTIF_PREFIX)]
            for _ in range(len(messages) - len(kept)):
                on_read()
            notifs[agent] = kept
        return notifs

    return filtered
