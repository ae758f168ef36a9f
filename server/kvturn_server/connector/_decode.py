"""Decode side of the scheduler: retain finished turns, make room for live ones, report hits.

A finished request whose params name a conversation (``kvturn.conversation``) is retained
under that key by the :class:`~kvturn_server.connector._keeper.RetentionKeeper`, which also
makes room for live requests and serves the control endpoint. vLLM's own bidirectional pinning
stays off on decodes: it would pin every finished request, single-use, with a fixed TTL.
A decode leg that computes its own prompt (no remote prefill) reports its local prefix-cache hit
in the same shape as a prefill's ``kvturn.reuse``, plus what it loaded from the decode's host
tier when it has one (``host_tokens``; ``_tiers.py``, ``kvturn_server.offload``).

:class:`DecodeSide` holds no vLLM state: the scheduler adapter (``_scheduler.py``) calls it
before vLLM's own hook and hands it vLLM's answer after. The keeper learns where prefills read
it (:class:`~kvturn_server.connector._params.ReadCoordinates`) when it is bound, and hands what
it publishes back as return values (views, events); nothing calls up into the adapter.
"""

from __future__ import annotations

import logging
from typing import Any

from kvturn.wire import ReuseReason
from kvturn_server.connector._config import ConnectorConfig
from kvturn_server.connector._engine import EngineWaker, Housekeeper
from kvturn_server.connector._extra_keys import block_extras
from kvturn_server.connector._keeper import RetentionKeeper
from kvturn_server.connector._lease import Retention
from kvturn_server.connector._params import (
    KVTURN_FIELD,
    ReadCoordinates,
    conversation_key,
    not_retained,
)
from kvturn_server.connector._prefill import PrefillSide
from kvturn_server.connector._stats import KVTurnStats
from kvturn_server.connector._tiers import HostLoad, HostTier, tier_link

log = logging.getLogger("kvturn.connector")

_GAUGE_KEYS = ("kvturn_retentions", "kvturn_retained_blocks", "kvturn_retained_bytes",
               "kvturn_host_retentions")


class DecodeSide:
    """Retains finished conversation turns and keeps retention out of live requests' way.

    ``keeper`` is None when this decode retains nothing (no control endpoint, a zero budget,
    a model with several KV-cache groups). ``legs`` plans a prefill leg sent here by mistake
    the way a prefill would, so that vLLM never reads unverified blocks on a decode either.
    """

    def __init__(self, keeper: RetentionKeeper | None, at: ReadCoordinates, legs: PrefillSide,
                 *, progress_thread: bool) -> None:
        self.keeper = keeper
        self.at = at
        self.legs = legs
        self._progress_thread = progress_thread
        self._local_hits: dict[str, int] = {}
        # Waiting requests asked about and not yet scheduled, with every block each needs
        # (see before_match), and those of them whose KV load finished (see step_scheduled).
        self._asked: dict[str, int] = {}
        self._loaded: set[str] = set()
        self._gauges: tuple[int, ...] = (0, 0, 0, 0)
        self._housekeeper: Housekeeper | None = None
        self.host: HostTier | None = None
        self._host_loaded: list[int] = []  # per turn since take_stats

    # Wiring done once the engine's cache manager exists.

    def bind_block_pool(self, pool: Any) -> None:
        # Both connectors of the MultiConnector exist by now: the host tier, if any, is linked.
        self.host = tier_link(self.at.engine_id).host
        if self.host is not None:
            log.info("kvturn: this decode has a host tier (%s); retentions evicted from its "
                     "KV cache keep their lease there", self.host.usage())
        if self.keeper is None:
            return
        self.keeper.bind(pool, self.at, self.host)
        waker = EngineWaker.from_stack(self.keeper.service)
        self.keeper.set_waker(waker.wake)
        if waker.attached:
            self._housekeeper = Housekeeper(self.keeper.due, waker).start()

    def shutdown(self) -> None:
        if self._housekeeper is not None:
            self._housekeeper.stop()

    # vLLM hooks, forwarded by the adapter.

    def before_match(self, request: Any, num_computed_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self.legs.plan(request, num_computed_tokens, params)
            return
        self._note_local_hit(request, num_computed_tokens, params)
        if self.keeper is not None:
            # A waiting request is about to ask for blocks: retentions make way first.
            bs = self.at.block_size
            whole = -(-request.num_tokens // bs) + 1  # every block, and 1 to grow into
            needed = whole - num_computed_tokens // bs
            if request.request_id in self._asked and self.keeper.free_blocks() < whole:
                # Asked before and still waiting: vLLM's admission needed more than the free
                # blocks make_room counts (it also takes the hit's cached blocks out of the
                # free pool and reserves what in-flight prefills and async loads still need).
                # While the pool could not hold the whole request, one more retention goes
                # per step until it fits, instead of the request waiting for a lease to expire.
                self.keeper.relieve()
            self._asked[request.request_id] = whole
            self.keeper.make_room(needed)

    def finished(self, request: Any, block_ids: Any,
                 out: dict[str, Any] | None) -> dict[str, Any] | None:
        """vLLM's answer for a finished request; a conversation turn's says if it is retained."""
        params = request.kv_transfer_params
        self._asked.pop(request.request_id, None)
        self._loaded.discard(request.request_id)
        local_hit = self._local_hits.pop(request.request_id, None)
        load = self.host.take_loaded(request.request_id) if self.host is not None else None
        if isinstance(params, dict) and params.get("do_remote_decode"):
            return self.legs.finished(request, out)
        key = conversation_key(params) if isinstance(params, dict) else None
        if key is None:
            return out
        result = self._retain(request, key, block_ids, out)
        if local_hit is not None:
            result[KVTURN_FIELD]["reuse"] = self._local_report(request, local_hit, load)
        return result

    def has_pending_block_frees(self) -> bool:
        """vLLM asks before preempting a running request that could not get blocks."""
        return self.keeper is not None and self.keeper.relieve()

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a retention is pinned, unless NIXL's progress thread
        runs on this decode.

        A prefill's read of retained blocks is one-sided, but UCX over TCP still needs this
        side's worker to make progress; without a progress thread only engine steps poll NIXL,
        an idle engine polls nothing and the read would stall until its deadline. Pins bracket
        reads, so then the engine steps exactly while one may be in flight. Those steps are
        costly (vLLM's workers spin on their message queue for a second after each one: about
        a core for the whole prefill leg), which is why decodes run the thread by default.
        """
        return (self.keeper is not None and not self._progress_thread
                and self.keeper.has_pins())

    def step_scheduled(self, scheduler_output: Any) -> None:
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
            self._asked.pop(new.req_id, None)
            self._loaded.discard(new.req_id)
        if self.keeper is not None:
            self._relieve_loaded(self.keeper)
            self.keeper.service()

    def step_reported(self, connector_output: Any) -> None:
        for request_id in getattr(connector_output, "finished_recving", None) or ():
            if request_id in self._asked:
                self._loaded.add(request_id)
        self.legs.step_reported(connector_output)

    def _relieve_loaded(self, keeper: RetentionKeeper) -> None:
        """One more retention goes when a request whose KV load finished was not scheduled.

        Once its load (from a prefill or the host tier) finished, vLLM schedules a request
        ahead of every other waiting one, without asking the connector again, and stops
        admitting anything while it cannot get the blocks of its prompt's remainder. Nothing
        running frees blocks then, so without this the decode would wait for a lease to
        expire (seen in bench agent with a host tier: Running 0, "1 completed waiting").
        """
        if self._loaded and keeper.free_blocks() < max(self._asked[r] for r in self._loaded) \
                and keeper.relieve():
            log.info("kvturn: %s finished loading its KV and waits for blocks: a retention "
                     "made way", ", ".join(sorted(self._loaded)))

    def take_stats(self) -> KVTurnStats | None:
        """kvturn's stats since the last call: the keeper's events, gauges when they moved."""
        stats = self.legs.take_stats() or KVTurnStats()
        for tokens in self._host_loaded:
            stats.record("kvturn_host_loaded_tokens", tokens)
        self._host_loaded = []
        if self.host is not None:
            counters = self.host.take_counters()
            if counters.evicted:
                stats.record("kvturn_host_evictions",
                             [[standing, n] for standing, n in sorted(counters.evicted.items())])
            if counters.discarded:
                stats.record("kvturn_host_discarded", counters.discarded)
            if counters.load_failures:
                stats.record("kvturn_host_load_failures", counters.load_failures)
        if self.keeper is not None:
            for event in self.keeper.take_events():
                stats.record("kvturn_retention_events", event)
            gauges = self.keeper.gauges()
            if gauges != self._gauges:
                self._gauges = gauges
                for key, value in zip(_GAUGE_KEYS, gauges, strict=True):
                    stats.record(key, value)
        return None if stats.is_empty() else stats

    # Local hits.

    def _note_local_hit(self, request: Any, num_computed_tokens: int, params: Any) -> None:
        """Remember a decode leg's local prefix-cache hit when it computes its own prompt.

        Only the first ask counts: vLLM asks again after a preemption, by then with whatever the
        request had computed. A leg that loads its prompt from a prefill is not recorded, also
        after its one transfer (vLLM then clears ``do_remote_prefill``).
        """
        if not isinstance(params, dict) or params.get("do_remote_prefill") \
                or params.get("_remote_blocks_processed"):
            return
        if conversation_key(params) is not None:
            self._local_hits.setdefault(request.request_id, num_computed_tokens)

    def _local_report(self, request: Any, local_hit: int,
                      load: HostLoad | None) -> dict[str, Any]:
        """A decode leg's ``kvturn.reuse``: its own caches are where the history came from, the
        device's prefix cache (``local_tokens``) and, with a host tier, host memory
        (``host_tokens``; 0 and ``host_failed`` when that copy failed and was recomputed)."""
        host = load.tokens if load is not None and not load.failed else 0
        reused = local_hit + host
        # As on a prefill: the full blocks of all but the last prompt token can be reused.
        bs = self.at.block_size
        full_tokens = max(len(request.prompt_token_ids or ()) - 1, 0) // bs * bs
        if reused <= 0 or full_tokens == 0:
            reason = ReuseReason.MISS
        elif reused >= full_tokens:
            reason = ReuseReason.HIT
        else:
            reason = ReuseReason.PARTIAL
        report: dict[str, Any] = {"reason": reason.value, "reused_tokens": reused,
                                  "local_tokens": local_hit}
        if self.host is not None:
            report["host_tokens"] = host
            if load is not None and load.failed:
                report["host_failed"] = True
            if host:
                self._host_loaded.append(host)
        return report

    # Retaining.

    def _retain(self, request: Any, key: str, block_ids: Any,
                out: dict[str, Any] | None) -> dict[str, Any]:
        keeper = self.keeper
        retention: Retention | None = None
        if keeper is not None and keeper.bound and _kv_complete(request) \
                and len(block_ids) == 1:
            try:
                tokens = request.all_token_ids
                # A block's hash covers what vLLM's prefix cache keys on besides its tokens;
                # a request whose inputs cannot be covered is not retained (UncoverableInput).
                bs = self.at.block_size
                extras = block_extras(request, len(tokens) // bs, bs)
                retention = keeper.retain(key, request.request_id, block_ids[0], tokens,
                                          request.num_computed_tokens, extras=extras)
            except ValueError as exc:
                log.warning("request %s: not retained: %s", request.request_id, exc)
        view = keeper.describe(key) if keeper is not None and retention is not None else None
        # None: not retained; not a dict: expired at once (a TTL shorter than a step).
        if retention is None or not isinstance(view, dict):
            return not_retained(out, key, self.at.engine_id)
        params: dict[str, Any] = view["params"]
        # What the router records without asking the control endpoint (non-streaming turns).
        params[KVTURN_FIELD].update(retained=True, engine_id=self.at.engine_id,
                                    num_tokens=retention.num_tokens,
                                    expires_in=view["expires_in"])
        return params


def make_keeper(config: ConnectorConfig, kv_cache_config: Any,
                hash_seed: bytes) -> RetentionKeeper | None:
    """The decode's retention keeper, or None when this decode cannot or may not retain."""
    if config.retention_budget == 0:
        log.info("kvturn: retention_budget is 0, so this decode retains nothing")
        return None
    if len(kv_cache_config.kv_cache_groups) != 1:
        log.warning("kvturn: this model has %d KV-cache groups; retention supports "
                    "models with one (full attention), so it is off",
                    len(kv_cache_config.kv_cache_groups))
        return None
    total = sum(t.size for t in kv_cache_config.kv_cache_tensors)
    return RetentionKeeper(
        block_bytes=total // max(kv_cache_config.num_blocks, 1),
        budget=config.retention_budget, ttl=config.decoder_kv_blocks_ttl,
        max_hold=config.retention_max_hold, max_pin=config.retention_max_pin,
        hash_seed=hash_seed)


def _kv_complete(request: Any) -> bool:
    """Whether the KV of ``request``'s computed tokens is all in its blocks.

    A stop token or the length cap: yes. An abort (a client that went away, and also a stop
    string, which vLLM's front end enforces by aborting the request in the engine): only once
    the request has generated a token, because before that a decode may still be loading its
    prompt from the prefill, and vLLM counts tokens being loaded as computed. Errors: never.
    """
    from vllm.v1.request import RequestStatus

    if request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
        return True
    return bool(request.status == RequestStatus.FINISHED_ABORTED
                and request.num_output_tokens > 0)
