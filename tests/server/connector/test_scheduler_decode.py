"""The decode side of the scheduler: retain finished turns, publish them, make room for live ones.

The scheduler is built with ``__new__`` and the attributes these paths read; its keeper is the
real one (built by ``make_keeper``) over :class:`~tests.fakes.keeper.FakeBlockPool`.
vLLM's own decode-side ``request_finished`` runs for real (with retention it returns at once);
its other hooks are stubbed where they would need a whole engine.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.v1.request import RequestStatus

from kvturn.wire import ReuseReason
from kvturn_server.connector._config import ConnectorConfig
from kvturn_server.connector._decode import DecodeSide, make_keeper
from kvturn_server.connector._hashing import DEFAULT_SEED, block_hashes
from kvturn_server.connector._keeper import RetentionKeeper
from kvturn_server.connector._params import FORMAT, KVTURN_FIELD, READ_PREFIX, read_params
from kvturn_server.connector._prefill import PrefillSide, ReadRules, ReuseRecord
from kvturn_server.connector._scheduler import KVTurnPullScheduler
from kvturn_server.connector._tiers import HostCounters, HostLoad, tier_link
from tests.fakes.keeper import BS, FakeBlockPool, FakeHostTier, coordinates, tokens

KEY = "3f2a9c0d1e4b5a67/conv:42"
CONTROL_URL = "http://127.0.0.1:8201"


def kv_cache_config(groups: int = 1, num_blocks: int = 33) -> Any:
    return SimpleNamespace(kv_cache_groups=[object()] * groups, num_blocks=num_blocks,
                           kv_cache_tensors=[SimpleNamespace(size=num_blocks * 2048)] * 2)


def rules(enabled: bool = False) -> ReadRules:
    # kvturn keeps vLLM's bidirectional reads off on decodes.
    return ReadRules(engine_id="decode-engine", block_size=BS, hash_seed=DEFAULT_SEED,
                     threshold=0, enabled=enabled)


def base_scheduler(keeper: RetentionKeeper | None = None, **config: Any) -> KVTurnPullScheduler:
    """The adapter over a decode side, with the vLLM state its NIXL hooks read."""
    sched = KVTurnPullScheduler.__new__(KVTurnPullScheduler)
    sched.block_size = BS
    sched.engine_id = "decode-engine"
    sched.kvturn_config = cfg = ConnectorConfig(**config)
    sched.is_bidirectional_kv_xfer_enabled = False
    sched.kv_recompute_threshold = 0
    sched._heartbeat_req_engine = {}
    sched._heartbeat_by_engine = {}
    sched.is_decode = True
    sched.control = None
    sched.side = DecodeSide(keeper, coordinates(control_url=CONTROL_URL), PrefillSide(rules()),
                            progress_thread=cfg.progress_thread(decode=True))
    return sched


def decode_scheduler(pool: FakeBlockPool | None, **config: Any) -> KVTurnPullScheduler:
    keeper = make_keeper(ConnectorConfig(**config), kv_cache_config(), DEFAULT_SEED)
    sched = base_scheduler(keeper, **config)
    if pool is not None:
        sched.bind_block_pool(pool)
    return sched


def side(sched: KVTurnPullScheduler) -> DecodeSide:
    assert isinstance(sched.side, DecodeSide)
    return sched.side


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    status: RequestStatus = RequestStatus.FINISHED_STOPPED
    prompt_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 1
    # What vLLM's prefix cache keys on besides token ids: none of it here (plain text).
    lora_request: Any = None
    mm_features: list[Any] = field(default_factory=list)
    cache_salt: str | None = None
    prompt_embeds: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def decode_leg(key: str | None = KEY) -> dict[str, Any]:
    """A decode leg's params once vLLM consumed the P->D transfer."""
    params: dict[str, Any] = {"do_remote_prefill": False, "do_remote_decode": False,
                              "remote_engine_id": "prefill-engine",
                              "_remote_blocks_processed": True}
    if key is not None:
        params[KVTURN_FIELD] = {"conversation": key}
    return params


def finish(sched: KVTurnPullScheduler, pool: FakeBlockPool, *, n_blocks: int = 4,
           computed: int = 14, request_id: str = "req-7", groups: int = 1,
           status: RequestStatus = RequestStatus.FINISHED_STOPPED,
           params: dict[str, Any] | None = None, outputs: int = 1,
           known: int | None = None) -> tuple[list[int], Any]:
    ids = pool.allocate(n_blocks)
    request = FakeRequest(request_id, tokens(computed + 1 if known is None else known),
                          computed, decode_leg() if params is None else params, status,
                          num_output_tokens=outputs)
    block_ids = tuple([list(ids)] * groups)
    try:
        delay, out = sched.request_finished(request, block_ids)
    finally:
        pool.release(ids)
    assert delay is False  # the decode never delays vLLM's free: the keeper holds instead
    return ids, out


@pytest.fixture
def pool() -> FakeBlockPool:
    return FakeBlockPool(33)


@pytest.fixture
def sched(pool: FakeBlockPool) -> KVTurnPullScheduler:
    return decode_scheduler(pool)


# Building the keeper.


def test_the_keeper_gets_the_blocks_size_in_bytes_and_the_configured_leases() -> None:
    config = ConnectorConfig(retention_budget=0.25, decoder_kv_blocks_ttl=30.0,
                             retention_max_hold=90.0, retention_max_pin=7.0)
    keeper = make_keeper(config, kv_cache_config(num_blocks=33), DEFAULT_SEED)
    assert isinstance(keeper, RetentionKeeper)
    assert keeper.block_bytes == 2 * 2048
    assert keeper.budget == 0.25
    assert (keeper._ttl, keeper._max_hold, keeper._max_pin) == (30.0, 90.0, 7.0)
    keeper.bind(FakeBlockPool(33), coordinates())
    assert keeper.stats()["budget_blocks"] == 8


def test_no_keeper_with_a_zero_budget_or_several_kv_cache_groups(
        caplog: pytest.LogCaptureFixture) -> None:
    zero = ConnectorConfig(retention_budget=0.0)
    assert make_keeper(zero, kv_cache_config(), DEFAULT_SEED) is None
    with caplog.at_level(logging.WARNING, logger="kvturn.connector"):
        assert make_keeper(ConnectorConfig(), kv_cache_config(groups=2), DEFAULT_SEED) is None
    assert "2 KV-cache groups" in caplog.text


def test_binding_without_an_engine_on_the_stack_starts_no_housekeeper(
        pool: FakeBlockPool) -> None:
    decode = side(decode_scheduler(pool))
    assert decode.keeper is not None and decode.keeper.bound
    assert decode._housekeeper is None


# Retaining a finished turn.


def test_a_finished_turn_is_retained_and_answers_with_the_params_to_read_it(
        sched: KVTurnPullScheduler, pool: FakeBlockPool) -> None:
    ids, out = finish(sched, pool, n_blocks=4, computed=14)
    assert pool.refs(ids) == [1, 1, 1, 0]  # three full blocks kept, the partial one freed
    assert out is not None
    assert out["remote_block_ids"] == [ids[:3]]
    assert out["remote_request_id"] == READ_PREFIX + "req-7"
    assert out["remote_num_tokens"] == 12
    assert out[KVTURN_FIELD]["retained"] is True
    assert out[KVTURN_FIELD]["conversation"] == KEY
    assert out[KVTURN_FIELD]["block_hashes"] == [
        h.hex() for h in block_hashes(tokens(12), BS)]


@pytest.mark.parametrize(("status", "outputs"), [(RequestStatus.FINISHED_ABORTED, 0),
                                                 (RequestStatus.FINISHED_ERROR, 1),
                                                 (RequestStatus.FINISHED_IGNORED, 0)])
def test_a_turn_whose_kv_may_be_incomplete_is_not_retained(
        sched: KVTurnPullScheduler, pool: FakeBlockPool, status: RequestStatus,
        outputs: int) -> None:
    # An abort before the first token: the prompt may still have been loading from the
    # prefill, and vLLM counts those tokens as computed already.
    ids, out = finish(sched, pool, status=status, outputs=outputs)
    assert out == {KVTURN_FIELD: {"conversation": KEY, "retained": False,
                                  "engine_id": "decode-engine"}}
    assert pool.refs(ids) == [0] * 4


def test_an_aborted_turn_that_generated_is_retained(
        sched: KVTurnPullScheduler, pool: FakeBlockPool) -> None:
    # A stop string ends a request as an abort in vLLM's engine; so does a client that left.
    # Its KV is complete up to what it computed, and the next turn verifies what it reads.
    ids, out = finish(sched, pool, status=RequestStatus.FINISHED_ABORTED, outputs=3)
    assert pool.refs(ids) == [1, 1, 1, 0]
    assert out[KVTURN_FIELD]["retained"] is True and out["remote_num_tokens"] == 12


def test_only_blocks_whose_token_ids_are_known_are_retained(
        sched: KVTurnPullScheduler, pool: FakeBlockPool) -> None:
    # Async scheduling counts a step in flight as computed before its token id is known.
    ids, out = finish(sched, pool, computed=12, known=11)
    assert pool.refs(ids) == [1, 1, 0, 0]
    assert out["remote_num_tokens"] == 8
    assert out[KVTURN_FIELD]["block_hashes"] == [h.hex() for h in block_hashes(tokens(8), BS)]


def test_a_model_with_several_kv_cache_groups_is_not_retained(
        sched: KVTurnPullScheduler, pool: FakeBlockPool) -> None:
    ids, out = finish(sched, pool, groups=2)
    assert out == {KVTURN_FIELD: {"conversation": KEY, "retained": False,
                                  "engine_id": "decode-engine"}}
    assert pool.refs(ids) == [0] * 4


def test_without_retention_a_conversation_turn_says_not_retained(pool: FakeBlockPool) -> None:
    for sched in (base_scheduler(), decode_scheduler(None)):  # no keeper; keeper not bound
        _, out = finish(sched, pool)
        assert out == {KVTURN_FIELD: {"conversation": KEY, "retained": False,
                                  "engine_id": "decode-engine"}}
    assert pool.refs() == [0] * pool.usable


def test_block_ids_the_keeper_refuses_are_logged_and_not_retained(
        sched: KVTurnPullScheduler, pool: FakeBlockPool,
        caplog: pytest.LogCaptureFixture) -> None:
    request = FakeRequest("req-9", tokens(13), 12, decode_leg())
    with caplog.at_level(logging.WARNING, logger="kvturn.connector"):
        _, out = sched.request_finished(request, ([0, 1, 2],))  # block 0 is the null block
    assert out == {KVTURN_FIELD: {"conversation": KEY, "retained": False,
                                  "engine_id": "decode-engine"}}
    assert "not retained" in caplog.text
    assert pool.refs() == [0] * pool.usable


@pytest.mark.parametrize("params", [decode_leg(None), {**decode_leg(None), KVTURN_FIELD: {}},
                                    {**decode_leg(None), KVTURN_FIELD: {"conversation": ""}},
                                    {**decode_leg(None), KVTURN_FIELD: "t/k"}],
                         ids=["no field", "no key", "empty key", "not an object"])
def test_a_turn_without_a_conversation_is_left_to_vllm(
        sched: KVTurnPullScheduler, pool: FakeBlockPool, params: dict[str, Any]) -> None:
    ids, out = finish(sched, pool, params=params)
    assert out is None
    assert pool.refs(ids) == [0] * 4


# What a prefill needs to read a retention.


def test_read_params_give_exactly_the_fields_a_prefill_leg_needs(
        sched: KVTurnPullScheduler, pool: FakeBlockPool) -> None:
    decode = side(sched)
    assert decode.keeper is not None
    ids = pool.allocate(3)
    retention = decode.keeper.retain(KEY, "req-7", ids, tokens(12), 11)  # 2 full blocks
    assert retention is not None
    assert read_params(decode.at, retention, 1234.5) == {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [ids[:2]],
        "remote_engine_id": "decode-engine",
        "remote_request_id": "kvturn-read/req-7",
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 8,
        "remote_blocks_expiry_time": 1234.5,
        "transfer_mode": "pull",
        KVTURN_FIELD: {
            "format": FORMAT,
            "block_size": BS,
            "block_hashes": [h.hex() for h in block_hashes(tokens(8), BS)],
            "conversation": KEY,
            "control": CONTROL_URL,
        },
    }


def test_published_params_read_back_on_a_prefill_as_verified_blocks(
        sched: KVTurnPullScheduler, pool: FakeBlockPool) -> None:
    ids, _ = finish(sched, pool, n_blocks=4, computed=15)
    assert side(sched).keeper is not None
    view = side(sched).keeper.pin(KEY, 10)  # what the router does before the prefill leg
    assert isinstance(view, dict)
    params = view["params"]
    assert params["remote_blocks_expiry_time"] == pytest.approx(time.perf_counter() + 10,
                                                                abs=5)
    prefill = PrefillSide(rules(enabled=True))
    prompt = [*tokens(16), 555, 556, 557]  # the next turn extends the retained sequence
    prefill.plan(FakeRequest("p-1", [], 0, params, prompt_token_ids=prompt), 0, params)
    assert prefill.records["p-1"] == ReuseRecord(ReuseReason.PARTIAL, 12, 0)
    assert params["remote_block_ids"] == [ids[:3]]


# Hooks vLLM calls on the decode.


def test_a_waiting_request_makes_room_before_vllm_allocates(
        pool: FakeBlockPool, monkeypatch: pytest.MonkeyPatch) -> None:
    sched = decode_scheduler(pool, retention_budget=1.0)
    monkeypatch.setattr(NixlPullConnectorScheduler, "get_num_new_matched_tokens",
                        lambda self, request, num_computed: (0, False))
    for i in range(3):
        finish(sched, pool, n_blocks=9, computed=36, request_id=f"r{i}",
               params=decode_leg(f"t/k{i}"))
    assert pool.get_num_free_blocks() == 5
    waiting = FakeRequest("w", tokens(30), 0, None)  # 8 blocks, and 1 to grow into
    assert sched.get_num_new_matched_tokens(waiting, 0) == (0, False)
    assert side(sched).keeper is not None
    assert side(sched).keeper.stats()["retentions"] == 2
    assert pool.get_num_free_blocks() >= 9


def test_a_request_still_waiting_after_an_ask_takes_one_more_retention_per_step(
        pool: FakeBlockPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """make_room trusts the local hit; vLLM's admission can need more (it takes the hit's cached
    blocks out of the free pool, and reserves for in-flight loads). A request asked again
    without having been scheduled is short: a retention goes each step while the pool could not
    hold it whole, instead of it waiting out a lease (seen as stalls of one lease TTL under
    memory pressure in bench trace)."""
    sched = decode_scheduler(pool, retention_budget=1.0)
    monkeypatch.setattr(NixlPullConnectorScheduler, "get_num_new_matched_tokens",
                        lambda self, request, num_computed: (0, False))
    for i in range(3):
        finish(sched, pool, n_blocks=9, computed=36, request_id=f"r{i}",
               params=decode_leg(f"t/k{i}"))
    keeper = side(sched).keeper
    assert keeper is not None and pool.get_num_free_blocks() == 5
    waiting = FakeRequest("w", tokens(30), 0, None)  # 8 blocks, 6 of them a local hit
    sched.get_num_new_matched_tokens(waiting, 24)
    assert keeper.stats()["retentions"] == 3  # 3 blocks needed beyond the hit: 5 are free
    sched.get_num_new_matched_tokens(waiting, 24)  # not admitted: asked again
    assert keeper.stats()["retentions"] == 2
    side(sched).step_scheduled(SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="w")]))
    again = FakeRequest("w", tokens(30), 0, None)  # asked anew after being scheduled
    sched.get_num_new_matched_tokens(again, 24)
    assert keeper.stats()["retentions"] == 2


def test_a_request_whose_load_finished_and_was_not_scheduled_takes_a_retention_per_step(
        pool: FakeBlockPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM schedules a request whose KV load finished ahead of all others without asking the
    connector again, and admits nothing while it cannot get its remaining blocks: a retention
    goes each step it was left out while the pool could not hold it whole (seen as stalls of a
    lease TTL in bench agent with a host tier: Running 0, "KV fetch: 1 completed waiting")."""
    sched = decode_scheduler(pool, retention_budget=1.0)
    monkeypatch.setattr(NixlPullConnectorScheduler, "get_num_new_matched_tokens",
                        lambda self, request, num_computed: (24, True))
    monkeypatch.setattr(NixlPullConnectorScheduler, "build_connector_meta",
                        lambda self, scheduler_output: "meta")
    monkeypatch.setattr(NixlPullConnectorScheduler, "update_connector_output",
                        lambda self, connector_output: None)
    for i in range(3):
        finish(sched, pool, n_blocks=9, computed=36, request_id=f"r{i}",
               params=decode_leg(f"t/k{i}"))
    keeper = side(sched).keeper
    assert keeper is not None and pool.get_num_free_blocks() == 5
    loading = FakeRequest("w", tokens(30), 0, None)  # 8 blocks, and 1 to grow into
    sched.get_num_new_matched_tokens(loading, 0)
    assert keeper.stats()["retentions"] == 2  # made room for the whole request
    pool.allocate(6)  # the load's blocks, and another admission's (free: 14 - 6 - 6 = 2)
    nothing = SimpleNamespace(scheduled_new_reqs=[])
    sched.build_connector_meta(nothing)  # still loading: it may not be scheduled yet
    assert keeper.stats()["retentions"] == 2
    sched.update_connector_output(SimpleNamespace(finished_recving={"w", "other"},
                                                  finished_sending=None))
    sched.build_connector_meta(nothing)  # loaded and left out: short of blocks
    assert keeper.stats()["retentions"] == 1
    sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="w")]))
    sched.build_connector_meta(nothing)
    assert keeper.stats()["retentions"] == 1  # scheduled: nothing more goes


def test_vllm_asks_before_preempting_and_a_retention_goes_instead(
        sched: KVTurnPullScheduler, pool: FakeBlockPool) -> None:
    assert sched.has_pending_block_frees() is False
    finish(sched, pool)
    assert sched.has_pending_block_frees() is True
    assert sched.has_pending_block_frees() is False
    assert pool.refs() == [0] * pool.usable


def test_with_nixl_progress_thread_a_pin_never_keeps_the_engine_stepping(
        sched: KVTurnPullScheduler, pool: FakeBlockPool) -> None:
    # The default on a decode: the progress thread serves reads while the engine idles.
    finish(sched, pool)
    assert side(sched).keeper is not None
    view = side(sched).keeper.pin(KEY, 10)
    assert isinstance(view, dict)
    assert sched.has_pending_push_work() is False


def test_without_a_progress_thread_the_engine_steps_exactly_while_a_retention_is_pinned(
        pool: FakeBlockPool) -> None:
    sched = decode_scheduler(pool, nixl_progress_thread=False)
    finish(sched, pool)
    assert side(sched).keeper is not None
    assert sched.has_pending_push_work() is False
    view = side(sched).keeper.pin(KEY, 10)
    assert isinstance(view, dict)
    assert sched.has_pending_push_work() is True
    side(sched).keeper.unpin(view["pin_id"])
    assert sched.has_pending_push_work() is False
    assert base_scheduler().has_pending_push_work() is False


def test_each_step_frees_what_control_requests_released(
        sched: KVTurnPullScheduler, pool: FakeBlockPool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NixlPullConnectorScheduler, "build_connector_meta",
                        lambda self, scheduler_output: "meta")
    ids, _ = finish(sched, pool)
    assert side(sched).keeper is not None
    side(sched).keeper.release(KEY)
    assert pool.refs(ids[:3]) == [1, 1, 1]
    assert sched.build_connector_meta(object()) == "meta"
    assert pool.refs() == [0] * pool.usable


def test_take_stats_reports_events_and_gauges_only_when_they_change(
        sched: KVTurnPullScheduler, pool: FakeBlockPool) -> None:
    finish(sched, pool, n_blocks=4, computed=14)
    stats = sched.take_stats()
    assert stats is not None
    assert stats.data["kvturn_retention_events"] == ["created"]
    assert stats.data["kvturn_retentions"] == [1]
    assert stats.data["kvturn_retained_blocks"] == [3]
    assert stats.data["kvturn_retained_bytes"] == [3 * 4096]
    assert sched.take_stats() is None  # nothing changed since
    assert side(sched).keeper is not None
    side(sched).keeper.release(KEY)
    side(sched).keeper.service()
    stats = sched.take_stats()
    assert stats is not None
    assert stats.data["kvturn_retention_events"] == ["released"]
    assert stats.data["kvturn_retentions"] == [0]


# A decode leg that computes its own prompt reports its local prefix-cache hit.


def own_prompt_leg(key: str | None = KEY) -> dict[str, Any]:
    """The router's decode leg without a prefill: "decode continues the turn", or the
    fallback after a failed prefill."""
    params: dict[str, Any] = {"do_remote_prefill": False}
    if key is not None:
        params[KVTURN_FIELD] = {"conversation": key}
    return params


def run_own_prompt(sched: KVTurnPullScheduler, pool: FakeBlockPool, prompt_len: int,
                   local_hits: list[int], params: dict[str, Any] | None = None,
                   request_id: str = "own") -> Any:
    """vLLM asks for each local hit in turn (more than one: re-admission after preemption),
    then the request finishes with the prompt and one generated token computed."""
    ids = pool.allocate(-(-(prompt_len + 1) // BS))
    request = FakeRequest(request_id, tokens(prompt_len + 1), prompt_len,
                          own_prompt_leg() if params is None else params,
                          prompt_token_ids=tokens(prompt_len))
    for local in local_hits:
        assert sched.get_num_new_matched_tokens(request, local) == (0, False)
    try:
        _, out = sched.request_finished(request, (list(ids),))
    finally:
        pool.release(ids)
    return out


@pytest.mark.parametrize(("prompt_len", "local", "reason"), [
    (13, 12, "hit"),  # every full block of the first 12 tokens came from the local cache
    (12, 8, "hit"),  # all but the last token: 11 tokens, 2 full blocks
    (17, 8, "partial"),
    (17, 0, "miss"),
    (3, 0, "miss"),  # no full block to hit
])
def test_a_decode_leg_without_remote_prefill_reports_its_local_hit(
        sched: KVTurnPullScheduler, pool: FakeBlockPool, prompt_len: int, local: int,
        reason: str) -> None:
    out = run_own_prompt(sched, pool, prompt_len, [local])
    assert out[KVTURN_FIELD]["reuse"] == {"reason": reason, "reused_tokens": local,
                                          "local_tokens": local}
    assert side(sched)._local_hits == {}


def test_only_the_first_ask_counts(sched: KVTurnPullScheduler, pool: FakeBlockPool) -> None:
    # After a preemption vLLM asks again with whatever the request had computed meanwhile.
    out = run_own_prompt(sched, pool, 17, [4, 16])
    assert out[KVTURN_FIELD]["reuse"]["reused_tokens"] == 4


def test_a_not_retained_turn_still_reports_its_local_hit(pool: FakeBlockPool) -> None:
    out = run_own_prompt(base_scheduler(), pool, 13, [8])  # no keeper: nothing retained
    assert out == {KVTURN_FIELD: {"conversation": KEY, "retained": False,
                                  "engine_id": "decode-engine",
                                  "reuse": {"reason": "partial", "reused_tokens": 8,
                                            "local_tokens": 8}}}


def test_a_leg_that_loads_its_prompt_from_a_prefill_reports_no_local_hit(
        sched: KVTurnPullScheduler, pool: FakeBlockPool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NixlPullConnectorScheduler, "get_num_new_matched_tokens",
                        lambda self, request, num_computed: (0, False))
    params = {**decode_leg(), "do_remote_prefill": True}
    del params["_remote_blocks_processed"]
    request = FakeRequest("pd", tokens(13), 12, params, prompt_token_ids=tokens(12))
    sched.get_num_new_matched_tokens(request, 8)
    params.update(do_remote_prefill=False, _remote_blocks_processed=True)  # vLLM, on alloc
    sched.get_num_new_matched_tokens(request, 12)  # asked again (preempted)
    assert side(sched)._local_hits == {}
    _, out = finish(sched, pool, request_id="pd", params=params)
    assert "reuse" not in out[KVTURN_FIELD]


def test_a_request_without_a_conversation_records_nothing(
        sched: KVTurnPullScheduler, pool: FakeBlockPool) -> None:
    assert run_own_prompt(sched, pool, 13, [8], params=own_prompt_leg(None)) is None
    plain = FakeRequest("plain", tokens(13), 12, None)
    sched.get_num_new_matched_tokens(plain, 8)
    assert side(sched)._local_hits == {}


def test_a_prefill_reports_no_local_hit_for_its_own_legs() -> None:
    prefill = PrefillSide(rules(enabled=True))
    request = FakeRequest("p", [], 0, own_prompt_leg(), prompt_token_ids=tokens(13))
    prefill.before_match(request, 8)
    assert prefill.finished(request, None) == {
        KVTURN_FIELD: {"conversation": KEY, "retained": False, "engine_id": "decode-engine"}}
    assert prefill.records == {}


# With a host tier, a decode leg that computes its own prompt counts what it loaded from there.


@pytest.fixture
def host_sched(pool: FakeBlockPool) -> tuple[KVTurnPullScheduler, FakeHostTier]:
    host = FakeHostTier()
    engine = f"decode-engine-{uuid.uuid4().hex}"
    tier_link(engine).host = host
    keeper = make_keeper(ConnectorConfig(), kv_cache_config(), DEFAULT_SEED)
    sched = base_scheduler(keeper)
    side(sched).at = dataclasses.replace(side(sched).at, engine_id=engine)
    sched.bind_block_pool(pool)
    return sched, host


@pytest.mark.parametrize(("prompt_len", "local", "host_tokens", "reason"), [
    (17, 0, 16, "hit"),  # nothing left on the device: all of it from host memory
    (17, 8, 8, "hit"),  # the head still in the device's prefix cache, the rest from host
    (21, 0, 8, "partial"),
    (17, 4, 0, "partial"),  # nothing loaded from host: 0, said
])
def test_a_decode_leg_counts_what_it_loaded_from_the_host_tier(
        host_sched: tuple[KVTurnPullScheduler, FakeHostTier], pool: FakeBlockPool,
        prompt_len: int, local: int, host_tokens: int, reason: str) -> None:
    sched, host = host_sched
    if host_tokens:
        host.loads["own"] = HostLoad(host_tokens)
    out = run_own_prompt(sched, pool, prompt_len, [local])
    assert out[KVTURN_FIELD]["reuse"] == {"reason": reason, "reused_tokens": local + host_tokens,
                                          "local_tokens": local, "host_tokens": host_tokens}
    stats = sched.take_stats()
    assert stats is not None
    assert stats.data["kvturn_host_loaded_tokens"] == ([host_tokens] if host_tokens else [])


def test_a_failed_host_load_reports_nothing_loaded_and_says_so(
        host_sched: tuple[KVTurnPullScheduler, FakeHostTier], pool: FakeBlockPool) -> None:
    sched, host = host_sched
    host.loads["own"] = HostLoad(0, failed=True)
    out = run_own_prompt(sched, pool, 17, [4])
    assert out[KVTURN_FIELD]["reuse"] == {"reason": "partial", "reused_tokens": 4,
                                          "local_tokens": 4, "host_tokens": 0,
                                          "host_failed": True}


def test_the_keeper_is_bound_to_the_engines_host_tier_and_stats_carry_its_counters(
        host_sched: tuple[KVTurnPullScheduler, FakeHostTier], pool: FakeBlockPool) -> None:
    sched, host = host_sched
    keeper = side(sched).keeper
    assert keeper is not None and keeper._host is host and side(sched).host is host
    host.counters = HostCounters(evicted={"none": 3, "leased": 1}, discarded=2, load_failures=1)
    stats = sched.take_stats()
    assert stats is not None
    assert stats.data["kvturn_host_evictions"] == [[["leased", 1], ["none", 3]]]
    assert stats.data["kvturn_host_discarded"] == [2]
    assert stats.data["kvturn_host_load_failures"] == [1]

