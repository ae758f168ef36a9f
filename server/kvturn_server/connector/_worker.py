"""Worker side: vLLM's NIXL pull worker plus a deadline on every read of remote blocks."""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from kvturn_server.connector._config import ConnectorConfig


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
