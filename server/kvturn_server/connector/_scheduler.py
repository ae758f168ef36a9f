"""Scheduler side: vLLM's NIXL pull scheduler, bound to kvturn's prefill or decode side.

vLLM builds one scheduler-side connector per engine; kvturn's decisions differ by role, so
this adapter builds the role's object once and forwards vLLM's hooks to it, around vLLM's own
NIXL behaviour:

- a **prefill** (``kv_producer``): :class:`~kvturn_server.connector._prefill.PrefillSide`
  restricts each read of a decode's retention to verified blocks and reports the outcome;
- a **decode** (``kv_consumer``): :class:`~kvturn_server.connector._decode.DecodeSide`
  retains finished conversation turns, makes room for live requests and reports local hits.

Either role serves the control endpoint when ``control_port`` is set (on a prefill: health and
the cost model's stats only). What a decode's keeper publishes is built from its
:class:`~kvturn_server.connector._params.ReadCoordinates`, which this adapter reads off vLLM's
scheduler once and passes down as a value.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)

from kvturn_server._control_secret import ControlSecretError, resolve_secret
from kvturn_server.connector._config import ConnectorConfig, ConnectorConfigError
from kvturn_server.connector._control import ControlServer
from kvturn_server.connector._decode import DecodeSide, make_keeper
from kvturn_server.connector._extra_keys import engine_seed
from kvturn_server.connector._keeper import RetentionKeeper
from kvturn_server.connector._params import ReadCoordinates
from kvturn_server.connector._prefill import PrefillSide, ReadRules, make_calibration
from kvturn_server.connector._stats import KVTurnStats
from kvturn_server.connector._tiers import tier_link

log = logging.getLogger("kvturn.connector")


class KVTurnPullScheduler(NixlPullConnectorScheduler):  # type: ignore[misc]
    """Verifies reads on prefills; retains, makes room and serves control on decodes."""

    hash_seed: bytes
    """Start of every verification chain (``engine_seed``: the model's identity)."""
    side: PrefillSide | DecodeSide
    control: ControlServer | None

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any, *,
                 config: ConnectorConfig | None = None) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.kvturn_config = config = config or ConnectorConfig()
        self.is_decode = vllm_config.kv_transfer_config.kv_role == "kv_consumer"
        self.hash_seed = engine_seed(vllm_config)
        if not self.is_decode:
            prefill = PrefillSide(self.read_rules(), make_calibration(
                config, vllm_config, kv_cache_config, self.block_size))
            self.side = prefill
            self.control = self._start_control(vllm_config, None, prefill.control_stats)
            return
        keeper: RetentionKeeper | None = None
        if config.control_port is None:
            log.warning("kvturn: no control_port in kv_connector_extra_config, so this "
                        "decode retains no KV for the next turn's prefill")
        else:
            keeper = make_keeper(config, kv_cache_config, self.hash_seed)
        if keeper is not None:
            # A host tier beside this connector (kvturn_server.offload) orders its evictions
            # by these leases.
            tier_link(self.engine_id).leases = keeper
        self.control = self._start_control(vllm_config, keeper, None)
        # The workers (other processes) run NIXL's progress thread by the same rule.
        self.side = DecodeSide(keeper, self.read_coordinates(), PrefillSide(self.read_rules()),
                               progress_thread=config.progress_thread(decode=True))

    def read_rules(self) -> ReadRules:
        """What bounds this instance's reads, from vLLM's scheduler state."""
        return ReadRules(engine_id=self.engine_id, block_size=self.block_size,
                         hash_seed=self.hash_seed, threshold=self.kv_recompute_threshold,
                         enabled=bool(self.is_bidirectional_kv_xfer_enabled))

    def read_coordinates(self) -> ReadCoordinates:
        """Where a prefill reads this decode, from vLLM's scheduler state and the control
        endpoint's address."""
        parallel = self.vllm_config.parallel_config
        return ReadCoordinates(
            engine_id=self.engine_id, block_size=self.block_size,
            host=self.side_channel_host, port=self.side_channel_port,
            tp_size=self.transfer_tp_size, dcp_size=parallel.decode_context_parallel_size,
            pp_size=parallel.pipeline_parallel_size, transfer_mode=self._TRANSFER_MODE,
            control_url=self.control.url if self.control is not None else None)

    def _start_control(self, vllm_config: Any, keeper: RetentionKeeper | None,
                       extra_stats: Callable[[], dict[str, Any]] | None) -> ControlServer | None:
        config = self.kvturn_config
        if config.control_port is None:
            return None
        port = config.control_port + vllm_config.parallel_config.data_parallel_index
        try:
            secret = resolve_secret(os.environ, config.control_secret_file)
        except ControlSecretError as exc:
            raise ConnectorConfigError(str(exc)) from exc
        return ControlServer(config.control_host, port, engine_id=self.engine_id,
                             role="decode" if self.is_decode else "prefill", keeper=keeper,
                             extra_stats=extra_stats, secret=secret,
                             # vLLM's NIXL side-channel host: the address this instance
                             # advertises to its peers
                             advertise=self.side_channel_host).start()

    # Wiring done by the connector once the engine's cache manager exists.

    def bind_block_pool(self, pool: Any) -> None:
        if isinstance(self.side, DecodeSide):
            self.side.bind_block_pool(pool)

    def shutdown(self) -> None:
        if isinstance(self.side, DecodeSide):
            self.side.shutdown()
        if self.control is not None:
            self.control.stop()
        super().shutdown()

    # vLLM hooks: the role's side first, then vLLM's NIXL scheduler.

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        self.side.before_match(request, num_computed_tokens)
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens)
        return result

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        delay_free, out = super().request_finished(request, block_ids)
        if isinstance(self.side, DecodeSide):
            return delay_free, self.side.finished(request, block_ids, out)
        return delay_free, self.side.finished(request, out)

    def has_pending_block_frees(self) -> bool:
        return isinstance(self.side, DecodeSide) and self.side.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return isinstance(self.side, DecodeSide) and self.side.has_pending_push_work()

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self.side.step_scheduled(scheduler_output)
        return super().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        self.side.step_reported(connector_output)

    def take_stats(self) -> KVTurnStats | None:
        """kvturn's stats since the last call (vLLM calls this every step)."""
        return self.side.take_stats()
