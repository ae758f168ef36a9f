"""vLLM's CPU offloading on the CPU platform (``kvturn_server.offload``) and the stack's config.

The row pairing is pure logic; the worker is checked on real torch tensors with vLLM's own spec
classes, and the spec against vLLM's ``OffloadingConfig`` (a vLLM upgrade that changes either
fails here, not in a served request).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvturn_server.local import StackConfig, kv_transfer_config
from kvturn_server.local._launch import server_specs
from kvturn_server.local._stack import RunningStack
from kvturn_server.offload import HostOffloadingSpec, offloading_connector, with_offloading
from kvturn_server.offload._rows import GroupRows, transfer_rows
from kvturn_server.offload._worker import HostCopyWorker

# Row pairing.


def test_one_block_per_chunk_pairs_blocks_with_their_chunks() -> None:
    [part] = transfer_rows([7, 3, 9], [0, 1, 2], [3], [0], 1)
    assert part == GroupRows(0, (7, 3, 9), (0, 1, 2))


def test_a_group_starting_mid_chunk_skips_the_chunks_first_rows() -> None:
    # Logical blocks 5..7 of a request, chunks of 4 blocks: block 5 is row 1 of chunk 10.
    [part] = transfer_rows([40, 41, 42], [10], [3], [5], 4)
    assert part.host == (41, 42, 43)
    [part] = transfer_rows([40, 41, 42, 43], [10, 11], [4], [6], 4)
    assert part.host == (42, 43, 44, 45)


def test_groups_take_their_own_blocks_and_chunks_in_order() -> None:
    parts = transfer_rows([1, 2, 3, 4, 5], [8, 9, 6], [2, 0, 3], [0, 4, 3], 2)
    assert parts == [GroupRows(0, (1, 2), (16, 17)), GroupRows(2, (3, 4, 5), (19, 12, 13))]


@pytest.mark.parametrize("args", [
    ([1, 2], [0], [2], [0], 1),          # one chunk short
    ([1], [0, 1], [1], [0], 1),          # a chunk left over
    ([1, 2], [0, 1], [3], [0], 1),       # group sizes do not add up
    ([1], [0], [1, 0], [0], 1),          # sizes and indices disagree
    ([1], [0], [1], [0], 0),             # no blocks per chunk
])
def test_specs_that_do_not_describe_the_same_blocks_are_refused(args: Any) -> None:
    with pytest.raises(ValueError):
        transfer_rows(*args)


def test_runs_coalesce_where_both_sides_are_consecutive() -> None:
    part = GroupRows(0, (4, 5, 6, 9, 10, 2), (0, 1, 2, 3, 4, 8))
    assert part.runs() == [(4, 0, 3), (9, 3, 2), (2, 8, 1)]
    assert GroupRows(0, (), ()).runs() == []


# The worker, on real tensors.

PAGE = 64


def kv_caches(num_blocks: int, layers: int = 2) -> tuple[list[torch.Tensor], Any]:
    tensors = [torch.arange(num_blocks * PAGE, dtype=torch.int32).view(torch.int8)
               [:num_blocks * PAGE].view(num_blocks, PAGE).clone() + i for i in range(layers)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(i, PAGE) for i in range(layers)]])
    return tensors, caches


def device_spec(blocks: list[int], first: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[first])


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_a_stored_block_loads_back_byte_for_byte_into_another_block(
        blocks_per_chunk: int) -> None:
    device, caches = kv_caches(8)
    worker = HostCopyWorker(caches, blocks_per_chunk, num_chunks=4)
    original = [t[[2, 5, 6]].clone() for t in device]
    chunks = [1, 3] if blocks_per_chunk == 2 else [1, 2, 3]
    assert worker.submit_store(11, device_spec([2, 5, 6]), CPULoadStoreSpec(chunks))
    for t in device:
        t.zero_()
    assert worker.submit_load(12, CPULoadStoreSpec(chunks), device_spec([0, 1, 7]))
    for t, before in zip(device, original, strict=True):
        assert torch.equal(t[[0, 1, 7]], before)
        assert not t[[2, 3, 4, 5, 6]].any()  # nothing else was written
    done = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in done] == [
        (11, True, 3 * 2 * PAGE), (12, True, 3 * 2 * PAGE)]
    assert all(r.transfer_time is not None and r.transfer_time >= 0 for r in done)
    assert worker.get_finished() == []


def test_only_the_pages_kv_bytes_are_copied() -> None:
    device, _ = kv_caches(4, layers=1)
    caches = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(device[0], PAGE)],
                               group_data_refs=[[CanonicalKVCacheRef(0, PAGE // 2)]])
    worker = HostCopyWorker(caches, 1, num_chunks=2)
    before = device[0][1].clone()
    worker.submit_store(1, device_spec([1]), CPULoadStoreSpec([0]))
    device[0].zero_()
    worker.submit_load(2, CPULoadStoreSpec([0]), device_spec([3]))
    assert torch.equal(device[0][3][:PAGE // 2], before[:PAGE // 2])
    assert not device[0][3][PAGE // 2:].any()


# The spec, against vLLM's offloading config.


def offloading_config(cpu_bytes: int, **extra: Any) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"),
                                      group_id=0),),
        worker_kv_bytes_per_block=2 * PAGE, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": cpu_bytes, **extra}, engine_id="engine",
        model=OffloadingModelConfig(name="m", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True))


def test_vllm_finds_the_spec_by_the_names_the_config_gives() -> None:
    extra = offloading_connector(1 << 20)["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(extra) is HostOffloadingSpec


def test_the_spec_keeps_vllms_manager_and_gives_a_host_copy_worker_on_cpu() -> None:
    spec = HostOffloadingSpec(offloading_config(4096 * 10))
    assert isinstance(spec.get_manager(), CPUOffloadingManager)
    _, caches = kv_caches(8)
    worker = spec.get_worker(caches)
    assert isinstance(worker, HostCopyWorker)
    assert spec.get_worker(caches) is worker
    assert worker._host[0].shape == (spec.num_chunks, PAGE)


def test_the_spec_builds_kvturns_manager_with_its_policy_and_settings() -> None:
    from kvturn_server.offload._manager import HostTierManager
    from kvturn_server.offload._policy import LeasedCachePolicy

    spec = HostOffloadingSpec(offloading_config(
        4096 * 10, eviction_policy="kvturn", store_one_offs=False, store_threshold=2))
    manager = spec.get_manager()
    assert isinstance(manager, HostTierManager) and spec.get_manager() is manager
    assert isinstance(manager._policy, LeasedCachePolicy)
    assert manager._policy.store_one_offs is False and manager.store_threshold == 2
    assert manager.tokens_per_block == 16 and manager.usage()["blocks"] == spec.num_chunks
    with pytest.raises(ValueError, match="store_one_offs"):
        HostOffloadingSpec(offloading_config(4096, store_one_offs="no")).get_manager()


def test_the_spec_refuses_the_canonical_layout_it_does_not_copy() -> None:
    config = offloading_config(4096 * 10)
    spec = HostOffloadingSpec(config)
    spec.config = type(config)(**{**config.__dict__, "canonical_layout": True})
    with pytest.raises(ValueError, match="canonical_layout"):
        spec.get_worker(kv_caches(4)[1])


# The connector config.


def test_with_offloading_wraps_a_connector_in_a_multiconnector_that_keeps_its_role() -> None:
    inner = {"kv_connector": "KVTurnConnector", "kv_role": "kv_consumer",
             "kv_load_failure_policy": "recompute", "kv_buffer_device": "cpu",
             "kv_connector_extra_config": {"control_port": 1}}
    outer = with_offloading(inner, 1 << 30, {"offload_prompt_only": False})
    assert outer["kv_connector"] == "MultiConnector"
    assert {k: outer[k] for k in ("kv_role", "kv_load_failure_policy", "kv_buffer_device")} == {
        "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
        "kv_buffer_device": "cpu"}
    first, second = outer["kv_connector_extra_config"]["connectors"]
    assert first is inner  # asked first for external tokens: a transfer wins over the host tier
    assert second == {"kv_connector": "HostTierConnector",
                      "kv_connector_module_path": "kvturn_server.offload",
                      "kv_role": "kv_both",
                      "kv_connector_extra_config": {
                          "spec_name": "HostOffloadingSpec",
                          "spec_module_path": "kvturn_server.offload",
                          "cpu_bytes_to_use": 1 << 30, "eviction_policy": "kvturn",
                          "offload_prompt_only": False}}
    # vLLM's own behaviour (a stock baseline) is two keys away.
    stock = offloading_connector(1 << 30, {"eviction_policy": "lru",
                                           "offload_prompt_only": True})
    assert stock["kv_connector_extra_config"]["eviction_policy"] == "lru"
    with pytest.raises(ValueError, match="positive"):
        offloading_connector(0)


def test_the_stack_offloads_on_prefill_and_decode_only_when_asked(tmp_path: Any) -> None:
    assert kv_transfer_config(StackConfig(), "kv_consumer")["kv_connector"] == "KVTurnConnector"
    cfg = StackConfig(state_dir=tmp_path, kv_offload_gib=0.5, with_reference=True)
    specs = {s.name: s for s in server_specs(cfg)}
    for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        argv = specs[name].argv
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert kv == with_offloading(kv_transfer_config(StackConfig(state_dir=tmp_path), role),
                                     1 << 29)
    assert "--kv-transfer-config" not in specs["reference"].argv


def test_the_offload_settings_survive_the_state_file(tmp_path: Any) -> None:
    cfg = StackConfig(state_dir=tmp_path, kv_offload_gib=2,
                      kv_offload_extra={"eviction_policy": "arc"})
    again = RunningStack.from_json(RunningStack(cfg, {}, 0.0).to_json()).config
    assert (again.kv_offload_gib, again.kv_offload_extra) == (2, {"eviction_policy": "arc"})


def test_a_negative_host_tier_is_refused() -> None:
    with pytest.raises(Exception, match="kv_offload_gib"):
        StackConfig(kv_offload_gib=-1).validate()


def test_multiconnector_rebuilds_kvturns_stats_by_the_connectors_name() -> None:
    # The API server gets a MultiConnector's stats as one dict per child class name and looks
    # each name up in vLLM's registry: an unknown name killed its output handler.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvturn_server.connector._connector import KVTurnConnector
    from kvturn_server.connector._stats import KVTurnStats

    assert KVConnectorFactory.get_connector_class_by_name("KVTurnConnector") is KVTurnConnector
    stats = KVTurnStats()
    stats.record("kvturn_reuse", "hit")
    rebuilt = MultiConnector.build_kv_connector_stats({"KVTurnConnector": stats.data})
    assert rebuilt is not None
    assert rebuilt["KVTurnConnector"].data["kvturn_reuse"] == ["hit"]
