"""Scheduler side: vLLM's NIXL pull scheduler plus kvturn's reuse, retention and control.

On a **prefill** (``kv_producer``), a prefill leg may carry a decode's retention (pinned by the
router, see docs/http-api.md). vLLM's bidirectional mode would read the *tail* of the decode's
block list, assuming the new prompt extends the decode's sequence block for block; after an edit
(a message removed, reasoning stripped, a re-rendered assistant turn) that reads the wrong
blocks and silently changes the answer (vLLM issue #43094). Here the decode publishes a chained
content hash per full block it retains, and the prefill reads only the blocks whose hashes equal
those of its own prompt, block by block from the start, beyond its local prefix-cache hit; the
rest is computed, and so is a range the cost model (``_cost.py``, calibrated from this
prefill's own steps and reads) expects to compute faster than to read. The outcome goes back in
the response's ``kvturn.reuse``.

On a **decode** (``kv_consumer``), a finished request whose params name a conversation
(``kvturn.conversation``) is retained under that key by the :class:`RetentionKeeper`, which also
makes room for live requests and serves the control endpoint. vLLM's own bidirectional pinning
stays off on decodes: it would pin every finished request, single-use, with a fixed TTL.
A decode leg that computes its own prompt (no remote prefill) reports its local prefix-cache hit
in the same shape as a prefill's ``kvturn.reuse``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)

from kvturn_server._control_secret import ControlSecretError, resolve_secret
from kvturn_server.connector._calibration import Calibration
from kvturn_server.connector._config import ConnectorConfig, ConnectorConfigError
from kvturn_server.connector._control import ControlServer
from kvturn_server.connector._cost import CostModel, ReadCost
from kvturn_server.connector._engine import EngineWaker, Housekeeper
from kvturn_server.connector._extra_keys import UncoverableInput, block_extras, engine_seed
from kvturn_server.connector._hashing import DEFAULT_SEED, block_hashes
from kvturn_server.connector._keeper import RetentionKeeper
from kvturn_server.connector._retention import Retention
from kvturn_server.connector._reuse import ReuseReason, decide_reuse
from kvturn_server.connector._stats import COST_GAUGES, KVTurnStats

log = logging.getLogger("kvturn.connector")

KVTURN_FIELD = "kvturn"
FORMAT = 1
READ_PREFIX = "kvturn-read/"
"""``remote_request_id`` of a retention: the prefill's read-done notification carries it back,
and the decode's worker recognises (and drops) it instead of freeing a vLLM request."""

# Outcomes where a retention was offered and the prefill computed instead.
_FALLBACKS = frozenset({ReuseReason.EXPIRED, ReuseReason.STALE, ReuseReason.UNVERIFIED,
                        ReuseReason.BELOW_THRESHOLD})
CHEAPER_TO_COMPUTE = "cheaper-to-compute"
"""The fallback reason (metrics only) of a range the cost model declined; on the wire it is
``below-threshold``, whose threshold is then the break-even length."""
COST_GAUGE_INTERVAL = 1.0
"""Seconds between samples of the cost model's gauges (they change with every step)."""


@dataclass
class ReuseRecord:
    """What a prefill leg did with the retention it was given (reported at finish)."""

    reason: ReuseReason
    reused_tokens: int
    local_tokens: int
    read_failed: bool = False
    cost: ReadCost | None = None
    """The cost model's estimate, when it weighed a read (see ``ReuseDecision.cost``)."""

    @property
    def cheaper_to_compute(self) -> bool:
        return self.cost is not None and not self.cost.worth_reading

    def report(self) -> dict[str, Any]:
        if self.read_failed:
            # The read was planned and failed (NIXL error, timeout, decode gone): vLLM's
            # recompute policy computed those blocks, so nothing was reused.
            report: dict[str, Any] = {"reason": ReuseReason.STALE.value, "reused_tokens": 0,
                                      "local_tokens": self.local_tokens, "read_failed": True}
        else:
            report = {"reason": self.reason.value, "reused_tokens": self.reused_tokens,
                      "local_tokens": self.local_tokens}
        if self.cost is not None:
            report["cost"] = self.cost.report()
        return report


class KVTurnPullScheduler(NixlPullConnectorScheduler):  # type: ignore[misc]
    """Verifies reads on prefills; retains, makes room and serves control on decodes."""

    hash_seed: bytes = DEFAULT_SEED
    """Start of every verification chain (``engine_seed``: the model's identity)."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any, *,
                 config: ConnectorConfig | None = None) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.kvturn_config = config = config or ConnectorConfig()
        self.is_decode = vllm_config.kv_transfer_config.kv_role == "kv_consumer"
        self.hash_seed = engine_seed(vllm_config)
        # The workers (other processes) run NIXL's progress thread by the same rule.
        self._progress_thread = config.progress_thread(self.is_decode)
        self._reuse: dict[str, ReuseRecord] = {}
        self._local_hits: dict[str, int] = {}
        self._stats = KVTurnStats()
        self._gauges: tuple[int, int, int] = (0, 0, 0)
        self._cost_gauges_at = -COST_GAUGE_INTERVAL
        self.calibration = None if self.is_decode else self._make_calibration(
            vllm_config, kv_cache_config)
        self.keeper: RetentionKeeper | None = None
        self.control: ControlServer | None = None
        self._housekeeper: Housekeeper | None = None
        role = "decode" if self.is_decode else "prefill"
        if config.control_port is None:
            if self.is_decode:
                log.warning("kvturn: no control_port in kv_connector_extra_config, so this "
                            "decode retains no KV for the next turn's prefill")
            return
        if self.is_decode:
            self.keeper = self._make_keeper(kv_cache_config)
        port = config.control_port + vllm_config.parallel_config.data_parallel_index
        try:
            secret = resolve_secret(os.environ, config.control_secret_file)
        except ControlSecretError as exc:
            raise ConnectorConfigError(str(exc)) from exc
        self.control = ControlServer(config.control_host, port, engine_id=engine_id, role=role,
                                     keeper=self.keeper, extra_stats=self._control_stats,
                                     secret=secret,
                                     # vLLM's NIXL side-channel host: the address this
                                     # instance advertises to its peers
                                     advertise=self.side_channel_host).start()

    def _make_calibration(self, vllm_config: Any, kv_cache_config: Any) -> Calibration | None:
        cfg = self.kvturn_config
        if cfg.reuse_cost_model == "off":
            return None
        # One worker's KV per token, the way _make_keeper sizes a block.
        total = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        per_token = total / max(kv_cache_config.num_blocks, 1) / self.block_size
        try:
            model = CostModel(cfg.cost_settings, bytes_per_token=per_token,
                              hidden_size=vllm_config.model_config.get_hidden_size())
        except ValueError as exc:
            log.warning("kvturn: no reuse cost model, the recompute threshold alone decides: %s",
                        exc)
            return None
        return Calibration(model)

    def _control_stats(self) -> dict[str, Any]:
        if self.calibration is None:
            return {}
        return {"cost_model": self.calibration.model.snapshot()}

    def _make_keeper(self, kv_cache_config: Any) -> RetentionKeeper | None:
        cfg = self.kvturn_config
        if cfg.retention_budget == 0:
            log.info("kvturn: retention_budget is 0, so this decode retains nothing")
            return None
        if len(kv_cache_config.kv_cache_groups) != 1:
            log.warning("kvturn: this model has %d KV-cache groups; retention supports "
                        "models with one (full attention), so it is off",
                        len(kv_cache_config.kv_cache_groups))
            return None
        total = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        return RetentionKeeper(
            engine_id=self.engine_id, block_size=self.block_size,
            block_bytes=total // max(kv_cache_config.num_blocks, 1),
            budget=cfg.retention_budget, ttl=cfg.decoder_kv_blocks_ttl,
            max_hold=cfg.retention_max_hold, max_pin=cfg.retention_max_pin,
            publish=self._publish, hash_seed=self.hash_seed)

    # Wiring done by the connector once the engine's cache manager exists.

    def bind_block_pool(self, pool: Any) -> None:
        if self.keeper is None:
            return
        self.keeper.bind(pool)
        waker = EngineWaker.from_stack(self.keeper.service)
        self.keeper.set_waker(waker.wake)
        if waker.attached:
            self._housekeeper = Housekeeper(self.keeper.due, waker).start()

    def shutdown(self) -> None:
        if self._housekeeper is not None:
            self._housekeeper.stop()
        if self.control is not None:
            self.control.stop()
        super().shutdown()

    # vLLM hooks.

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        delay_free, out = super().request_finished(request, block_ids)
        if self.calibration is not None:
            self.calibration.forget(request.request_id)
        local_hit = self._local_hits.pop(request.request_id, None)
        if not isinstance(params, dict):
            return delay_free, out
        if params.get("do_remote_decode"):
            record = self._reuse.pop(request.request_id, None)
            if record is not None:
                self._record_outcome(record)
                if out is not None:
                    out[KVTURN_FIELD] = {"reuse": record.report()}
            return delay_free, out
        info = params.get(KVTURN_FIELD)
        key = info.get("conversation") if isinstance(info, dict) else None
        if not isinstance(key, str) or not key:
            return delay_free, out
        result = self._retain(request, key, block_ids, out)
        if local_hit is not None and result is not None:
            result[KVTURN_FIELD]["reuse"] = self._local_report(request, local_hit)
        return delay_free, result

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self._plan_reuse(request, num_computed_tokens, params)
            return self._matched(request, num_computed_tokens)
        if self.is_decode:
            self._note_local_hit(request, num_computed_tokens, params)
        if self.keeper is not None:
            # A waiting request is about to ask for blocks: retentions make way first.
            bs = self.block_size
            needed = -(-request.num_tokens // bs) - num_computed_tokens // bs + 1
            self.keeper.make_room(needed)
        return self._matched(request, num_computed_tokens)

    def _matched(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens)
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

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if self.keeper is not None:
            self.keeper.service()
        if self.calibration is not None:
            self.calibration.step_scheduled(_chunks(scheduler_output))
        return super().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for req_id in failed:
            record = self._reuse.get(req_id)
            if record is not None and record.reused_tokens:
                record.read_failed = True
        if self.calibration is not None:
            self._calibrate(connector_output, failed)

    def _calibrate(self, connector_output: Any, failed: set[str]) -> None:
        calibration = self.calibration
        assert calibration is not None
        calibration.step_reported()
        # The workers' NIXL stats ride on this output; reading them leaves them for vLLM.
        # Bandwidth first: a read's fixed cost is what its transfer does not explain.
        data = getattr(getattr(connector_output, "kv_connector_stats", None), "data", None)
        if isinstance(data, dict):
            calibration.transfers(data.get("bytes_transferred") or (),
                                  data.get("transfer_duration") or ())
        calibration.read_finished(getattr(connector_output, "finished_recving", None) or (),
                                  failed)

    def take_stats(self) -> KVTurnStats | None:
        """kvturn's stats since the last call (vLLM calls this every step)."""
        stats = self._stats
        if self.keeper is not None:
            for event in self.keeper.take_events():
                stats.record("kvturn_retention_events", event)
            gauges = self.keeper.gauges()
            if gauges != self._gauges:
                self._gauges = gauges
                for key, value in zip(("kvturn_retentions", "kvturn_retained_blocks",
                                       "kvturn_retained_bytes"), gauges, strict=True):
                    stats.record(key, value)
        if self.calibration is not None:
            now = time.monotonic()
            if now - self._cost_gauges_at >= COST_GAUGE_INTERVAL:
                self._cost_gauges_at = now
                for key, estimate in zip(COST_GAUGES, self.calibration.model.gauges(),
                                         strict=True):
                    stats.record(key, estimate)
        if stats.is_empty():
            return None
        self._stats = KVTurnStats()
        return stats

    # Prefill side.

    def _plan_reuse(self, request: Any, num_computed_tokens: int,
                    params: dict[str, Any]) -> None:
        if params.get("_remote_blocks_processed"):
            # vLLM's one transfer per request is used up: this is a retry after a failed
            # read, or a re-admission after preemption. vLLM would wait for a read it never
            # posts again, so nothing is loaded now; the prefill computes (or finds in its
            # own cache) the rest.
            params["remote_block_ids"] = [[]]
            params["remote_num_tokens"] = 0
            return
        record = ReuseRecord(ReuseReason.MISS, 0, num_computed_tokens)
        if params.get("remote_block_ids"):
            record = self._restrict_to_verified_blocks(request, num_computed_tokens, params)
        self._reuse[request.request_id] = record
        if self.calibration is not None:
            if record.reused_tokens:
                # The request waits for the read from now (vLLM parks it once allocated).
                self.calibration.read_planned(request.request_id, record.reused_tokens,
                                              str(params.get("remote_engine_id")))
            else:
                self.calibration.forget(request.request_id)

    def _restrict_to_verified_blocks(self, request: Any, num_computed_tokens: int,
                                     params: dict[str, Any]) -> ReuseRecord:
        """Rewrite the decode's params so that only verified blocks are read.

        Idempotent: vLLM may ask again in a later step, so the decode's original block list is
        kept in the kvturn field and every call starts from it. What to read is
        ``decide_reuse``'s answer; vLLM's own threshold check then sees exactly that range.
        With the cost model on, a range that passes the threshold is read only if reading it is
        expected to be faster than computing it; the estimate is asked anew on every call, so
        the last call (the one whose answer vLLM allocates for) decides.
        """
        info = params.get(KVTURN_FIELD)
        params["remote_num_tokens"] = 0
        retained = _parse(info, self.block_size, params) if isinstance(info, dict) else None
        if retained is None or not isinstance(info, dict):
            # No (or unusable) hashes: nothing can be verified, so nothing is read.
            params["remote_block_ids"] = [[]]
            return ReuseRecord(ReuseReason.UNVERIFIED, 0, num_computed_tokens)
        retained_ids, retained_hashes = retained
        bs = self.block_size
        # The prompt's last token is always computed here: it produces the logits.
        prompt = list(request.prompt_token_ids or [])[:-1]
        try:
            # What vLLM's prefix cache keys on besides token ids (adapter, images, salt).
            extras = block_extras(request, len(prompt) // bs, bs)
        except UncoverableInput as exc:
            log.warning("request %s: reading nothing: %s", request.request_id, exc)
            params["remote_block_ids"] = [[]]
            info["decision"] = ReuseReason.UNVERIFIED.value
            return ReuseRecord(ReuseReason.UNVERIFIED, 0, num_computed_tokens)
        try:
            decision = decide_reuse(
                prompt_hashes=block_hashes(prompt, bs, self.hash_seed, extras),
                local_hit_tokens=num_computed_tokens,
                retained_hashes=retained_hashes,
                retained_block_ids=retained_ids[:len(retained_hashes)],
                block_size=bs, threshold=self.kv_recompute_threshold,
                expired=False, engine_known=True,
                # vLLM loads nothing external for a request that skips reading the prefix
                # cache (prompt logprobs), whatever the connector answers.
                enabled=bool(self.is_bidirectional_kv_xfer_enabled)
                and not getattr(request, "skip_reading_prefix_cache", False),
                cost=self.calibration.model.estimate if self.calibration is not None else None)
        except ValueError as exc:
            log.warning("request %s: unusable retention, recomputing: %s",
                        request.request_id, exc)
            params["remote_block_ids"] = [[]]
            return ReuseRecord(ReuseReason.UNVERIFIED, 0, num_computed_tokens)
        info["decision"] = decision.reason.value
        params["remote_block_ids"] = [list(decision.remote_blocks)]
        if decision.num_tokens:
            params["remote_num_tokens"] = (
                (decision.first_block + len(decision.remote_blocks)) * bs)
        log.debug("request %s: reuse %s, %d tokens from the decode%s", request.request_id,
                  decision.reason.value, decision.num_tokens,
                  f" ({decision.cost})" if decision.cost is not None else "")
        return ReuseRecord(decision.reason, decision.num_tokens, num_computed_tokens,
                           cost=decision.cost)

    def _record_outcome(self, record: ReuseRecord) -> None:
        report = record.report()
        self._stats.record("kvturn_reuse", report["reason"])
        self._stats.record("kvturn_reused_tokens", report["reused_tokens"])
        if record.read_failed:
            self._stats.record("kvturn_fallbacks", "read-failed")
        elif record.cheaper_to_compute:
            self._stats.record("kvturn_fallbacks", CHEAPER_TO_COMPUTE)
        elif record.reason in _FALLBACKS:
            self._stats.record("kvturn_fallbacks", record.reason.value)

    # Decode side.

    def _note_local_hit(self, request: Any, num_computed_tokens: int, params: Any) -> None:
        """Remember a decode leg's local prefix-cache hit when it computes its own prompt.

        Only the first ask counts: vLLM asks again after a preemption, by then with whatever the
        request had computed. A leg that loads its prompt from a prefill is not recorded, also
        after its one transfer (vLLM then clears ``do_remote_prefill``).
        """
        if not isinstance(params, dict) or params.get("do_remote_prefill") \
                or params.get("_remote_blocks_processed"):
            return
        info = params.get(KVTURN_FIELD)
        key = info.get("conversation") if isinstance(info, dict) else None
        if isinstance(key, str) and key:
            self._local_hits.setdefault(request.request_id, num_computed_tokens)

    def _local_report(self, request: Any, local_hit: int) -> dict[str, Any]:
        """A decode leg's ``kvturn.reuse``: its own cache is where the history came from."""
        # As on a prefill: the full blocks of all but the last prompt token can be reused.
        full_tokens = max(len(request.prompt_token_ids or ()) - 1, 0) // self.block_size \
            * self.block_size
        if local_hit <= 0 or full_tokens == 0:
            reason = ReuseReason.MISS
        elif local_hit >= full_tokens:
            reason = ReuseReason.HIT
        else:
            reason = ReuseReason.PARTIAL
        return {"reason": reason.value, "reused_tokens": local_hit, "local_tokens": local_hit}

    def _retain(self, request: Any, key: str, block_ids: Any,
                out: dict[str, Any] | None) -> dict[str, Any] | None:
        keeper = self.keeper
        retention: Retention | None = None
        if keeper is not None and keeper.bound and _kv_complete(request) \
                and len(block_ids) == 1:
            try:
                tokens = request.all_token_ids
                # A block's hash covers what vLLM's prefix cache keys on besides its tokens;
                # a request whose inputs cannot be covered is not retained (UncoverableInput).
                extras = block_extras(request, len(tokens) // self.block_size,
                                      self.block_size)
                retention = keeper.retain(key, request.request_id, block_ids[0], tokens,
                                          request.num_computed_tokens, extras=extras)
            except ValueError as exc:
                log.warning("request %s: not retained: %s", request.request_id, exc)
        # Every answer names this engine: the router ties the control endpoint (which names
        # it too) to the engine behind this HTTP endpoint, and distrusts it when they differ.
        if retention is None:
            result = dict(out or {})
            result[KVTURN_FIELD] = {"conversation": key, "retained": False,
                                    "engine_id": self.engine_id}
            return result
        view = keeper.describe(key) if keeper is not None else None
        if not isinstance(view, dict):  # expired at once (a TTL shorter than a step)
            result = dict(out or {})
            result[KVTURN_FIELD] = {"conversation": key, "retained": False,
                                    "engine_id": self.engine_id}
            return result
        params: dict[str, Any] = view["params"]
        # What the router records without asking the control endpoint (non-streaming turns).
        params[KVTURN_FIELD].update(retained=True, engine_id=self.engine_id,
                                    num_tokens=retention.num_tokens,
                                    expires_in=view["expires_in"])
        return params

    def _publish(self, retention: Retention, deadline: float) -> dict[str, Any]:
        """The ``kv_transfer_params`` a prefill leg needs to read ``retention``."""
        parallel = self.vllm_config.parallel_config
        return {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            # The readable (full, hashed) blocks, one KV-cache group.
            "remote_block_ids": [list(retention.readable_block_ids)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": READ_PREFIX + retention.request_id,
            "remote_host": self.side_channel_host,
            "remote_port": self.side_channel_port,
            "tp_size": self.transfer_tp_size,
            "dcp_size": parallel.decode_context_parallel_size,
            "pp_size": parallel.pipeline_parallel_size,
            "remote_num_tokens": retention.num_tokens,
            # On this process's perf_counter; the prefill rebases it with the NIXL handshake's
            # clock offset and declines a read that would end too close to it.
            "remote_blocks_expiry_time": deadline,
            "transfer_mode": self._TRANSFER_MODE,
            KVTURN_FIELD: {
                # format: bumps when the fields below change meaning
                "format": FORMAT,
                # block_size: tokens per hashed block; the prefill must use the same
                "block_size": self.block_size,
                # block_hashes: hex chained hashes of each retained block, in order
                "block_hashes": [h.hex() for h in retention.block_hashes],
                # conversation: the (tenant-scoped) key this retention is kept under
                "conversation": retention.key,
                # control: this decode's control endpoint (pin, keepalive, release)
                "control": self.control.url if self.control is not None else None,
            },
        }


def _chunks(scheduler_output: Any) -> list[tuple[int, int]]:
    """``(tokens, context)`` of each request in a step: what it computes, after how many."""
    scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
    chunks = [(scheduled.get(req.req_id, 0), req.num_computed_tokens)
              for req in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    chunks.extend((scheduled.get(req_id, 0), computed)
                  for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens,
                                              strict=False))
    return chunks


def _parse(info: dict[str, Any], block_size: int,
           params: dict[str, Any]) -> tuple[list[int], list[bytes]] | None:
    """The decode's original block ids and hashes, or None if the field is missing or not in
    the shape a kvturn decode writes (single KV-cache group, hex hashes).

    The router is the only writer of these params, but they cross the network: anything that is
    not what a kvturn decode produces disables the read instead of steering it.
    ``decide_reuse`` checks the rest (lengths, duplicates, hash sizes).
    """
    if info.get("format") != FORMAT:
        return None
    if info.get("block_size") != block_size:
        return None
    original = info.setdefault("retained_block_ids", params.get("remote_block_ids"))
    if (not isinstance(original, list) or len(original) != 1
            or not isinstance(original[0], list)):
        return None
    raw = info.get("block_hashes")
    if not isinstance(raw, list):
        return None
    try:
        hashes = [bytes.fromhex(h) for h in raw]
    except (TypeError, ValueError):
        return None
    return list(original[0]), hashes


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
