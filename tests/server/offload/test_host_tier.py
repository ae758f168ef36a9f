"""The decode's host tier bound to vLLM (``kvturn_server.offload``): kvturn's cache policy and
manager driven through vLLM's own ``CPUOffloadingManager`` API, failed copies, the host-tier
connector's additions, and the vLLM internals they rely on (a vLLM upgrade that moves them
fails here, not in a served request).

The decisions themselves are tested without vLLM in ``test_host_order.py``.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import TransferJobStatus
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

from kvturn_server.connector._params import HostRead
from kvturn_server.connector._tiers import HostLoad, LeaseView, Standing, TierLink, tier_link
from kvturn_server.offload import HostTierConnector
from kvturn_server.offload._connector import FailedJob, HostWorkerMetadata, failed_jobs
from kvturn_server.offload._manager import HostTierManager
from kvturn_server.offload._policy import LeasedCachePolicy
from kvturn_server.offload._worker import HostCopyWorker

TOKENS = 16  # tokens of a host block in these tests


class Leases:
    """kvturn's lease table as the host tier sees it: live conversations, set by the test."""

    def __init__(self) -> None:
        self.live: dict[str, LeaseView] = {}
        self.clock = 0.0
        self.headless: list[set[str]] = []

    def lease(self, conversation: str, standing: Standing = Standing.LEASED) -> None:
        self.clock += 1
        self.live[conversation] = LeaseView(standing, self.clock)

    def standings(self) -> dict[str, LeaseView]:
        return dict(self.live)

    def lost_in_host(self, conversations: Any) -> None:
        self.headless.append(set(conversations))


@pytest.fixture
def leases() -> Leases:
    return Leases()


def manager(blocks: int, leases: Leases | None, policy: str = "kvturn",
            events: bool = False, one_offs: bool = True) -> HostTierManager:
    link = tier_link(f"engine-{uuid.uuid4().hex}")
    link.leases = leases
    built = HostTierManager(link=link, tokens_per_block=TOKENS, num_chunks=blocks,
                            cache_policy=policy, enable_events=events, store_one_offs=one_offs)
    assert link.host is built
    return built


def key(name: str) -> OffloadKey:
    return make_offload_key(name.encode().ljust(16, b"."), 0)


def keys(prefix: str, n: int) -> list[OffloadKey]:
    return [key(f"{prefix}{i}") for i in range(n)]


def context(request_id: str, conversation: str | None = None) -> ReqContext:
    params = {"kvturn": {"conversation": conversation}} if conversation else None
    return ReqContext(req_id=request_id, kv_transfer_params=params)


def request(m: CPUOffloadingManager, request_id: str, blocks: list[OffloadKey],
            conversation: str | None = None) -> list[OffloadKey] | None:
    """A request stores ``blocks`` the way vLLM's connector does (prepare, copy, complete) and
    finishes; what the store evicted, or None when it could not store."""
    ctx = context(request_id, conversation)
    positions(m, ctx, blocks)
    m.on_new_request(ctx)
    out = m.prepare_store(blocks, ctx)
    if out is not None:
        m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)
    return None if out is None else list(out.evicted_keys)


def positions(m: CPUOffloadingManager, ctx: ReqContext, blocks: list[OffloadKey]) -> None:
    """Each block's end token in its request, as vLLM's offloading scheduler records it."""
    step = getattr(m, "tokens_per_block", TOKENS)
    for i, block in enumerate(blocks):
        ctx.set_offload_key_position(block, (i + 1) * step)


def present(m: CPUOffloadingManager, blocks: list[OffloadKey]) -> list[bool]:
    ctx = context("lookup")
    return [m.lookup(b, ctx).name == "HIT" for b in blocks]


# kvturn's order through vLLM's manager.


def test_a_leased_conversation_outlives_blocks_without_a_lease_where_lru_would_drop_it(
        leases: Leases) -> None:
    for policy, survives in (("kvturn", True), ("lru", False)):
        m = manager(8, leases, policy)
        history = keys("a", 4)
        request(m, "a1", history, "A")
        leases.lease("A")
        request(m, "x1", keys("x", 4), "X")  # the tier is full; X's turn was not retained
        request(m, "y1", keys("y", 4), "Y")  # needs 4 blocks: X's (kvturn) or A's (LRU)
        assert all(present(m, history)) is survives, policy
        assert m.resident_tokens("A") == (4 * TOKENS if policy == "kvturn" else 0)
    # The keeper hears when a conversation's first block goes (X's, above): a lease held in
    # host memory alone promises nothing then.
    assert leases.headless == [{"X"}]


def test_one_offs_go_first_and_a_decode_can_skip_them(leases: Leases) -> None:
    m = manager(8, leases)
    request(m, "a1", keys("a", 4), "A")
    leases.lease("A")
    request(m, "x1", keys("x", 4))
    assert request(m, "y1", keys("y", 4)) == keys("x", 4)[::-1]  # the one-off's, tail first
    assert all(present(m, keys("a", 4)))
    kvturn_only = manager(8, leases, one_offs=False)  # no stock router drives this decode
    assert request(kvturn_only, "x1", keys("x", 4)) == []  # nothing stored, nothing evicted
    assert kvturn_only.usage()["blocks_used"] == 0
    for other in (manager(8, None, one_offs=False),  # a prefill: no leases, no skipping
                  manager(8, leases, "lru", one_offs=False)):  # vLLM's policy: neither
        request(other, "x1", keys("x", 4))
        assert all(present(other, keys("x", 4)))


def test_a_running_turns_first_blocks_are_not_evicted_by_its_own_later_ones(
        leases: Leases) -> None:
    m = manager(8, leases)
    request(m, "a1", keys("a", 4), "A")
    leases.lease("A")
    ctx = context("d1", "D")  # a new conversation's long first turn: no lease yet
    m.on_new_request(ctx)
    for part in (keys("d", 4), keys("e", 4)):  # stored as it is computed, in two steps
        out = m.prepare_store(part, ctx)
        assert out is not None
        m.complete_store(out.keys_to_store, ctx)
    assert all(present(m, [*keys("d", 4), *keys("e", 4)]))  # A's blocks made the room
    m.on_request_finished(ctx)


def test_memory_stays_within_the_budget_under_a_flood_of_conversations(
        leases: Leases) -> None:
    m = manager(16, leases)
    for i in range(60):
        conversation = f"c{i % 20}"
        request(m, f"r{i}", keys(f"{conversation}-t{i}-", 3), conversation)
        if i % 3:
            leases.lease(conversation)
        else:
            leases.live.pop(conversation, None)  # this turn was not retained: no lease
        if i % 7 == 0 and leases.live:
            ended = sorted(leases.live)[0]
            del leases.live[ended]
            m.discard([ended])
        assert m.usage()["blocks_used"] <= 16
        assert m._num_allocated_chunks <= 16
    counters = m.take_counters()
    assert counters.evicted["gone"] > 0 and counters.evicted["leased"] > 0
    assert counters.discarded > 0
    # With every conversation pinned, a store finds no room and is refused; nothing is
    # evicted.
    for conversation in {f"c{i}" for i in range(20)}:
        leases.lease(conversation, Standing.PINNED)
    before = list(m._policy.chunks)
    assert request(m, "late", keys("late", 2), "late") is None
    assert list(m._policy.chunks) == before


def test_a_released_conversation_leaves_host_memory_unless_a_live_lease_shares_it(
        leases: Leases) -> None:
    m = manager(16, leases, events=True)
    shared = keys("sys", 2)
    request(m, "a1", [*shared, *keys("a", 3)], "A")
    request(m, "b1", [*shared, *keys("b", 2)], "B")
    leases.lease("A")
    leases.lease("B")
    assert m.usage()["blocks_used"] == 7
    assert m.discard(["A"]) == 0  # A's lease is live again (a newer turn): nothing goes
    del leases.live["A"]
    assert m.discard(["A"]) == 3
    assert m.usage()["blocks_used"] == 4 and m.usage()["discarded"] == 3
    assert present(m, [*shared, *keys("a", 3)]) == [True, True, False, False, False]
    assert m.resident_tokens("B") == 4 * TOKENS and m.resident_tokens("A") == 0
    removed = [e for e in m.take_events() if e.removed]
    assert sorted(removed[0].keys) == sorted(keys("a", 3))
    assert m.take_counters().discarded == 3


def test_a_chunk_in_use_is_freed_when_its_copy_completes(leases: Leases) -> None:
    m = manager(8, leases)
    history = keys("a", 2)
    request(m, "a1", history, "A")
    ctx = context("a2", "A")
    m.on_new_request(ctx)
    m.prepare_load(history, ctx)  # a load of A's history is in flight
    assert m.discard(["A"]) == 0  # its lease ended meanwhile: freed once the load is done
    assert all(present(m, history))
    m.complete_load(history, ctx)
    assert not any(present(m, history)) and m.usage()["blocks_used"] == 0
    # A chunk still being stored goes when its store completes (its copy may hold garbage).
    ctx = context("b1", "B")
    m.on_new_request(ctx)
    out = m.prepare_store(keys("b", 1), ctx)
    assert out is not None and out.keys_to_store == keys("b", 1)
    assert m.discard_keys(keys("b", 1)) == 0
    m.complete_store(keys("b", 1), ctx)
    assert not any(present(m, keys("b", 1)))


def test_without_kvturns_leases_the_host_tier_is_plain_lru() -> None:
    m = manager(4, None)  # a prefill, or a decode that retains nothing
    request(m, "a1", keys("a", 2), "A")
    request(m, "x1", keys("x", 2))
    request(m, "y1", keys("y", 2))
    assert present(m, keys("a", 2)) == [False, False]  # least recently used
    assert m.resident_tokens("A") == 0 and m.discard(["A"]) == 0


def test_with_vllms_own_policy_the_manager_still_frees_and_notes_loads() -> None:
    m = manager(4, None, "lru")
    request(m, "x1", keys("x", 2))
    assert m.discard_keys(keys("x", 1)) == 1 and m.usage()["blocks_used"] == 1
    assert m.usage()["policy"] == "lru" and m.usage()["evicted"] == {}


def test_what_a_request_loaded_is_noted_once_and_a_failure_replaces_it(leases: Leases) -> None:
    m = manager(4, leases)
    m.note_load("r1", 64)
    m.note_load("r1", 32)  # asked again after a preemption: the first load counts
    assert m.take_loaded("r1") == HostLoad(64)
    assert m.take_loaded("r1") is None
    m.note_load("r2", 64)
    m.note_load_failed("r2")
    assert m.take_loaded("r2") == HostLoad(0, failed=True)
    m.note_load("r3", 16)
    m.forget_load("r3")
    assert m.take_loaded("r3") is None
    assert m.take_counters().load_failures == 1 and m.usage()["load_failures"] == 1


def test_a_reset_cache_forgets_everything_and_the_order_starts_over(leases: Leases) -> None:
    m = manager(4, leases)
    request(m, "a1", keys("a", 2), "A")
    m.reset_cache()
    assert m.resident_tokens("A") == 0 and m.usage()["blocks_used"] == 0
    assert request(m, "b1", keys("b", 4), "B") == []


# A failed copy: finished, reported apart, discarded, recomputed.

PAGE = 64


def kv_caches(num_blocks: int) -> tuple[torch.Tensor, Any]:
    tensor = torch.arange(num_blocks * PAGE, dtype=torch.int32).view(torch.int8)[
        :num_blocks * PAGE].view(num_blocks, PAGE).clone()
    return tensor, CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(tensor, PAGE)],
                                     group_data_refs=[[CanonicalKVCacheRef(0, PAGE)]])


def test_a_failing_load_is_finished_and_its_blocks_reported_for_recompute() -> None:
    device, caches = kv_caches(8)
    worker = HostCopyWorker(caches, 1, num_chunks=4)
    assert worker.submit_store(1, GPULoadStoreSpec([2, 3], group_sizes=[2], block_indices=[0]),
                               CPULoadStoreSpec([0, 1]))
    # A device block outside the KV cache: the copy raises at its first run, writing nothing.
    broken = GPULoadStoreSpec([9, 5], group_sizes=[2], block_indices=[0])
    before = device.clone()
    assert worker.submit_load(2, CPULoadStoreSpec([0, 1]), broken)
    assert torch.equal(device, before)
    done = {r.job_id: r for r in worker.get_finished()}
    assert done[1].transfer_size == 2 * PAGE
    # Finished (vLLM 0.32's worker asserts success), without size or time for the metrics.
    assert done[2].success and done[2].transfer_size is None and done[2].transfer_time is None
    assert worker.take_load_errors() == {9, 5} and worker.take_load_errors() == set()
    assert worker.take_failed_jobs() == {2}


def test_a_failing_store_is_reported_but_loads_nothing_wrong() -> None:
    _, caches = kv_caches(4)
    worker = HostCopyWorker(caches, 1, num_chunks=2)
    assert worker.submit_store(7, GPULoadStoreSpec([1], group_sizes=[1], block_indices=[0]),
                               CPULoadStoreSpec([0, 1]))  # one block, two chunks: refused
    assert [r.job_id for r in worker.get_finished()] == [7]
    assert worker.take_failed_jobs() == {7} and worker.take_load_errors() == set()


def job(request_id: str, blocks: list[OffloadKey], is_store: bool) -> TransferJobStatus:
    return TransferJobStatus(req_id=request_id, pending_count=0, keys=set(blocks),
                             is_store=is_store)


def test_failed_jobs_are_looked_up_in_the_schedulers_job_table() -> None:
    jobs = {3: job("r1", keys("a", 2), False), 4: job("r2", keys("b", 1), True)}
    meta = HostWorkerMetadata(completed_jobs={3: 1, 4: 1}, failed_jobs={3, 4, 99})
    assert failed_jobs(meta, jobs) == [
        FailedJob("r1", frozenset(keys("a", 2)), False),
        FailedJob("r2", frozenset(keys("b", 1)), True)]  # 99: from before a cache reset
    assert failed_jobs(OffloadingWorkerMetadata(completed_jobs={3: 1}), jobs) == []
    assert failed_jobs(None, jobs) == []


def test_worker_notes_keep_their_failures_when_several_workers_aggregate() -> None:
    one = HostWorkerMetadata(completed_jobs={1: 1}, failed_jobs={1})
    two = HostWorkerMetadata(completed_jobs={1: 1, 2: 1}, failed_jobs={2})
    merged = one.aggregate(two)
    assert isinstance(merged, HostWorkerMetadata)
    assert merged.completed_jobs == {1: 2, 2: 1} and merged.failed_jobs == {1, 2}


@pytest.fixture
def connector(leases: Leases) -> Iterator[tuple[HostTierConnector, HostTierManager]]:
    """The host-tier connector over a real manager; vLLM's offloading scheduler stood in for
    by its job table and its completion of jobs (complete, then forget them)."""
    m = manager(8, leases)
    jobs: dict[int, TransferJobStatus] = {}

    def update_connector_output(output: Any) -> None:
        for job_id in list(output.kv_connector_worker_meta.completed_jobs):
            status = jobs.pop(job_id)
            ctx = context(status.req_id)
            if status.is_store:
                m.complete_store(status.keys, ctx)
            else:
                m.complete_load(status.keys, ctx)

    built = HostTierConnector.__new__(HostTierConnector)
    built.connector_scheduler = SimpleNamespace(
        manager=m, _jobs=jobs, update_connector_output=update_connector_output,
        update_state_after_alloc=lambda request, blocks, n: None,
        request_finished=lambda request: (False, None))
    built.connector_worker = None
    yield built, m


def test_a_failed_load_discards_its_chunks_and_the_turn_says_it_was_recomputed(
        connector: tuple[HostTierConnector, HostTierManager]) -> None:
    host, m = connector
    history = keys("a", 2)
    request(m, "a1", history, "A")
    req = SimpleNamespace(request_id="a2")
    ctx = context("a2", "A")
    m.on_new_request(ctx)
    m.prepare_load(history, ctx)
    host.update_state_after_alloc(req, None, 2 * TOKENS)
    host.connector_scheduler._jobs[5] = job("a2", history, is_store=False)
    host.update_connector_output(SimpleNamespace(kv_connector_worker_meta=HostWorkerMetadata(
        completed_jobs={5: 1}, failed_jobs={5})))
    # Never loaded again: the request's next look-up misses and it is computed.
    assert not any(present(m, history))
    assert m.take_loaded("a2") == HostLoad(0, failed=True)
    # An untouched load is noted until the request finishes (kvturn's decode side takes it
    # first; the connector forgets what is left).
    host.update_state_after_alloc(SimpleNamespace(request_id="b"), None, TOKENS)
    host.request_finished(SimpleNamespace(request_id="b"), [])
    assert m.take_loaded("b") is None


def test_the_worker_side_reports_failures_apart(
        connector: tuple[HostTierConnector, HostTierManager]) -> None:
    host, _ = connector
    _, caches = kv_caches(8)
    worker = HostCopyWorker(caches, 1, num_chunks=4)
    completed = OffloadingWorkerMetadata()
    host.connector_worker = SimpleNamespace(worker=worker,
                                            build_connector_worker_meta=lambda: completed)
    worker.submit_load(9, CPULoadStoreSpec([0]),
                       GPULoadStoreSpec([40], group_sizes=[1], block_indices=[0]))
    completed.mark_completed(9)
    assert host.get_block_ids_with_load_errors() == {40}
    meta = host.build_connector_worker_meta()
    assert isinstance(meta, HostWorkerMetadata) and meta.failed_jobs == {9}
    assert meta.completed_jobs == {9: 1}
    host.connector_worker = None  # the scheduler's half: nothing of the worker's
    assert host.get_block_ids_with_load_errors() == set()


# The vLLM internals the host tier relies on.


def _source(obj: object) -> str:
    return inspect.getsource(obj)  # type: ignore[arg-type]


def test_the_policy_is_found_by_name_and_gets_vllms_hooks() -> None:
    assert CachePolicyFactory.get_cache_policy_cls("kvturn") is LeasedCachePolicy
    for name, params in (
            ("on_store_miss", ["self", "keys", "req_context"]),
            ("on_request_finished", ["self", "key_groups", "insertion_only_keys",
                                     "reused_keys", "req_context"]),
            ("evict", ["self", "n", "protected"]), ("insert", ["self", "key", "chunk"]),
            ("mark_evictable", ["self", "key"]), ("mark_non_evictable", ["self", "key"])):
        assert list(inspect.signature(getattr(CachePolicy, name)).parameters) == params, name
    # A store's keys are claimed (on_store_miss) before they are inserted.
    source = _source(CPUOffloadingManager.prepare_store)
    assert source.index("self._policy.on_store_miss(") < source.index("self._policy.insert(")


def test_the_manager_internals_a_discard_uses() -> None:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    assert list(inspect.signature(CPUOffloadingManager.__init__).parameters) == [
        "self", "num_chunks", "cache_policy", "cache_policy_module_path", "enable_events",
        "store_threshold", "max_tracker_size"]
    # HostOffloadingSpec.get_manager reads the keys vLLM's does, the same way.
    source = _source(CPUOffloadingSpec.get_manager)
    for read in ('int(self.extra_config.get("store_threshold", 0))',
                 'int(self.extra_config.get("max_tracker_size", 64_000))',
                 "cache_policy=self.eviction_policy",
                 "enable_events=self.kv_events_config.enable_kv_cache_events"):
        assert read in source, read
    m = CPUOffloadingManager(num_chunks=2)
    for name in ("_policy", "_free_chunk", "_num_evictable_cache_chunks", "_num_allocated_chunks",
                 "_free_list", "_num_chunks", "events", "medium"):
        assert hasattr(m, name), name
    # An idle ready chunk is counted evictable; eviction frees it exactly as discard_keys does.
    source = _source(CPUOffloadingManager.prepare_store)
    assert "self._num_evictable_cache_chunks -= len(evicted)" in source
    assert "self._free_chunk(chunk)" in source


def test_the_offloading_connector_leaves_failures_and_load_notes_to_kvturn() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.core.sched.scheduler import Scheduler

    # vLLM's worker cannot carry a failed job (the reason HostCopyWorker reports them apart)...
    assert "assert transfer_result.success" in _source(OffloadingConnectorWorker.get_finished)
    # ...and its connector reports no load errors of its own.
    assert OffloadingConnector.get_block_ids_with_load_errors is \
        KVConnectorBase_V1.get_block_ids_with_load_errors
    # The MultiConnector gathers every child's load errors; vLLM's scheduler recomputes from
    # the first failed block under kv_load_failure_policy "recompute".
    assert "c.get_block_ids_with_load_errors()" in _source(
        MultiConnector.get_block_ids_with_load_errors)
    assert 'kv_load_failure_policy == "recompute"' in _source(Scheduler.__init__)
    assert "request.num_computed_tokens = idx * self.block_size" in _source(
        Scheduler._update_requests_with_invalid_blocks)
    # Failed jobs are read from the scheduler's job table before vLLM completes and drops them.
    source = _source(OffloadingConnectorScheduler.update_connector_output)
    assert "job_status = self._jobs[job_id]" in source and "del self._jobs[job_id]" in source
    assert {"req_id", "keys", "is_store"} <= set(TransferJobStatus.__slots__)
    # Only the chosen connector learns how many tokens a request loads; kvturn's connector,
    # first among the children, takes the note at request_finished before the host tier's.
    multi = _source(MultiConnector.update_state_after_alloc)
    assert "c.update_state_after_alloc(request, blocks, 0)" in multi
    assert "for c in self._connectors:" in _source(MultiConnector._aggregate_request_finished)


def test_both_children_of_a_multiconnector_share_the_engine_id_the_link_is_keyed_by() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )

    assert 'ktc.get("engine_id", vllm_config.kv_transfer_config.engine_id)' in _source(
        MultiConnector._get_connector_classes_and_configs)
    assert "engine_id = kv_transfer_config.engine_id" in _source(build_offloading_config)
    assert tier_link("same") is tier_link("same")
    assert isinstance(tier_link("other"), TierLink) and tier_link("other") is not \
        tier_link("same")


def test_the_host_tier_connector_is_known_by_name_for_the_multiconnectors_stats() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    assert KVConnectorFactory.get_connector_class_by_name("HostTierConnector") is \
        HostTierConnector
    rebuilt = MultiConnector.build_kv_connector_stats({"HostTierConnector": {}})
    assert rebuilt is not None and "HostTierConnector" in rebuilt.data


# Host reads: where a prefill reads a conversation in host memory (``_reads.py``).


def test_a_conversations_host_read_names_its_resident_rows_in_order(leases: Leases) -> None:
    m = manager(16, leases)
    request(m, "x1", keys("x", 2), "X")  # chunks 0 and 1
    request(m, "a1", keys("a", 3), "A")
    leases.lease("A")
    assert m.host_read("A", "a1") is None  # the worker has not reported its side channel yet
    m.read_port = 41000
    read = m.host_read("A", "a1")
    chunks = [m._policy.get(k).chunk_id for k in keys("a", 3)]  # type: ignore[union-attr]
    assert read == HostRead("127.0.0.1", 41000, tuple(chunks))
    assert m.host_read("nobody", "n1") is None
    assert m.host_read("A", "a0") is None  # the order lists another turn's blocks
    m.discard_keys(keys("a", 3)[1:2])  # a gap: only what a read could take from the start
    read = m.host_read("A", "a1")
    assert read is not None and read.rows == tuple(chunks[:1])


def test_a_host_read_stops_where_vllm_listed_a_block_out_of_place(leases: Leases) -> None:
    # B, sharing A's first two blocks (one system prompt), was still storing them when A
    # offered them: vLLM lists only what A stored or found ready, so A's list starts at its
    # third block, and a read taking it from the first would get blocks 2 and 3 as 0 and 1.
    m = manager(16, leases)
    m.read_port = 41000
    history = keys("a", 4)
    other = context("b1", "B")
    positions(m, other, history[:2])
    m.on_new_request(other)
    pending = m.prepare_store(history[:2], other)
    assert pending is not None
    request(m, "a1", history, "A")
    m.complete_store(pending.keys_to_store, other)
    m.on_request_finished(other)
    assert all(present(m, history))
    read = m.host_read("A", "a1")
    assert read is None  # A listed neither of B's blocks: nothing of its own from its first
    request(m, "a2", history, "A")  # the next turn finds all four ready
    read = m.host_read("A", "a2")
    chunks = [m._policy.get(k).chunk_id for k in history]  # type: ignore[union-attr]
    assert read is not None and read.rows == tuple(chunks)


def test_a_host_read_never_names_a_block_whose_store_is_in_flight(leases: Leases) -> None:
    m = manager(16, leases)
    m.read_port = 41000
    history = keys("a", 3)
    ctx = context("a1", "A")
    positions(m, ctx, history)
    m.on_new_request(ctx)
    out = m.prepare_store(history, ctx)
    assert out is not None
    m.complete_store([history[0], history[2]], ctx)  # the second block's copy is in flight
    m.on_request_finished(ctx)
    chunks = [m._policy.get(k).chunk_id for k in history]  # type: ignore[union-attr]
    read = m.host_read("A", "a1")
    assert read is not None and read.rows == tuple(chunks[:1])
    m.complete_store([history[1]], ctx)
    read = m.host_read("A", "a1")
    assert read is not None and read.rows == tuple(chunks)


def test_blocks_a_host_read_was_handed_stay_while_pinned_even_once_disowned(
        leases: Leases) -> None:
    m = manager(4, leases)
    m.read_port = 41000
    history = keys("a", 3)
    request(m, "a1", history, "A")
    leases.lease("A", Standing.PINNED)  # pinned for a prefill's read of a1's host rows
    assert m.host_read("A", "a1") is not None
    # A later turn of A, not retained, lists other blocks than a1's third: that one is owned
    # by nobody now, and would be the first to go.
    request(m, "a2", [*history[:2], key("b0")], "A")
    assert request(m, "y1", keys("y", 1)) is None  # no room: the read's blocks stay
    assert all(present(m, history))
    leases.lease("A")  # the pin went
    assert request(m, "y1", keys("y", 1)) == [history[2]]


def test_host_rows_count_every_device_block_of_a_chunk(leases: Leases) -> None:
    link = tier_link(f"engine-{uuid.uuid4().hex}")
    link.leases = leases
    m = HostTierManager(link=link, tokens_per_block=2 * TOKENS, num_chunks=8,
                        cache_policy="kvturn", blocks_per_chunk=2)
    request(m, "a1", keys("a", 2), "A")
    m.read_port = 41000
    chunks = [m._policy.get(k).chunk_id for k in keys("a", 2)]  # type: ignore[union-attr]
    read = m.host_read("A", "a1")
    assert read is not None
    assert read.rows == tuple(r for c in chunks for r in (2 * c, 2 * c + 1))


def test_a_host_pin_keeps_a_released_conversations_blocks_until_it_goes(
        leases: Leases) -> None:
    m = manager(8, leases)
    request(m, "a1", keys("a", 2), "A")
    leases.lease("A", Standing.PINNED)  # released while pinned: the table still says pinned
    assert m.discard(["A"]) == 0 and all(present(m, keys("a", 2)))
    del leases.live["A"]  # the last pin went
    assert m.discard(["A"]) == 2


def test_the_read_side_channel_reaches_the_scheduler_side_once() -> None:
    _, caches = kv_caches(4)
    worker = HostCopyWorker(caches, 1, num_chunks=2)
    assert worker.take_read_port() is None  # serves no reads
    worker.read_endpoint = SimpleNamespace(port=41000, drain=lambda: 0,  # type: ignore[assignment]
                                           close=lambda: None)
    assert worker.take_read_port() == 41000 and worker.take_read_port() is None
    one = HostWorkerMetadata(completed_jobs={}, read_port=41000)
    merged = HostWorkerMetadata(completed_jobs={}).aggregate(one)
    assert isinstance(merged, HostWorkerMetadata) and merged.read_port == 41000
