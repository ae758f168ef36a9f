"""Prefill side of the scheduler: verified reads of a decode's retention, and their reports.

A prefill leg may carry a decode's retention (pinned by the router, see docs/http-api.md).
vLLM's bidirectional mode would read the *tail* of the decode's block list, assuming the new
prompt extends the decode's sequence block for block; after an edit (a message removed,
reasoning stripped, a re-rendered assistant turn) that reads the wrong blocks and silently
changes the answer (vLLM issue #43094). Here the decode publishes a chained content hash per
full block it retains, and the prefill reads only the blocks whose hashes equal those of its own
prompt, block by block from the start, beyond its local prefix-cache hit; the rest is computed,
and so is a range the cost model (``_cost.py``, calibrated from this prefill's own steps and
reads) expects to compute faster than to read. The outcome goes back in the response's
``kvturn.reuse``.

:class:`PrefillSide` holds no vLLM state: the scheduler adapter (``_scheduler.py``) calls it
before vLLM's own hook and hands it vLLM's answer after.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kvturn.wire import ReuseReason
from kvturn_server.connector._calibration import Calibration
from kvturn_server.connector._config import ConnectorConfig
from kvturn_server.connector._cost import CostModel, ReadCost
from kvturn_server.connector._extra_keys import UncoverableInput, block_extras
from kvturn_server.connector._hashing import block_hashes
from kvturn_server.connector._params import (
    KVTURN_FIELD,
    conversation_key,
    not_retained,
    parse_retained,
)
from kvturn_server.connector._reuse import decide_reuse
from kvturn_server.connector._stats import COST_GAUGES, KVTurnStats

log = logging.getLogger("kvturn.connector")

# Outcomes where a retention was offered and the prefill computed instead.
_FALLBACKS = frozenset({ReuseReason.EXPIRED, ReuseReason.STALE, ReuseReason.UNVERIFIED,
                        ReuseReason.BELOW_THRESHOLD})
CHEAPER_TO_COMPUTE = "cheaper_to_compute"
"""The fallback reason (metrics only) of a range the cost model declined; on the wire it is
``below-threshold``, whose threshold is then the break-even length."""
READ_FAILED = "read_failed"
"""The fallback reason (metrics only) of a read that failed or timed out; on the wire it is
``stale`` with ``read_failed: true``."""
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


@dataclass(frozen=True)
class ReadRules:
    """What bounds a prefill's reads of retained KV, fixed when the engine starts.

    Attributes:
        engine_id: this instance's engine id (named in a not-retained answer).
        block_size: tokens per KV block (and per hashed block).
        hash_seed: start of every verification chain (``engine_seed``: the model's identity).
        threshold: vLLM's ``kv_recompute_threshold``: a shorter remote range is computed.
        enabled: vLLM's bidirectional reads are on; off, nothing is read.
    """

    engine_id: str
    block_size: int
    hash_seed: bytes
    threshold: int
    enabled: bool


class PrefillSide:
    """Plans each prefill leg's read of a retention, reports the outcome, calibrates costs."""

    def __init__(self, rules: ReadRules, calibration: Calibration | None = None) -> None:
        self.rules = rules
        self.calibration = calibration
        self.records: dict[str, ReuseRecord] = {}
        self._stats = KVTurnStats()
        self._cost_gauges_at = -COST_GAUGE_INTERVAL

    # vLLM hooks, forwarded by the adapter.

    def before_match(self, request: Any, num_computed_tokens: int) -> None:
        """A prefill leg is about to be matched: restrict its read to verified blocks."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self.plan(request, num_computed_tokens, params)

    def finished(self, request: Any,
                 out: dict[str, Any] | None) -> dict[str, Any] | None:
        """vLLM's answer for a finished request, with the leg's reuse report added."""
        params = request.kv_transfer_params
        if self.calibration is not None:
            self.calibration.forget(request.request_id)
        if not isinstance(params, dict):
            return out
        if params.get("do_remote_decode"):
            record = self.records.pop(request.request_id, None)
            if record is not None:
                self.record_outcome(record)
                if out is not None:
                    out[KVTURN_FIELD] = {"reuse": record.report()}
            return out
        key = conversation_key(params)
        return out if key is None else not_retained(out, key, self.rules.engine_id)

    def step_scheduled(self, scheduler_output: Any) -> None:
        if self.calibration is not None:
            self.calibration.step_scheduled(_chunks(scheduler_output))

    def step_reported(self, connector_output: Any) -> None:
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for req_id in failed:
            record = self.records.get(req_id)
            if record is not None and record.reused_tokens:
                record.read_failed = True
        if self.calibration is not None:
            self._calibrate(self.calibration, connector_output, failed)

    def take_stats(self) -> KVTurnStats | None:
        """kvturn's stats since the last call."""
        stats = self._stats
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

    def control_stats(self) -> dict[str, Any]:
        if self.calibration is None:
            return {}
        return {"cost_model": self.calibration.model.snapshot()}

    # Planning a read.

    def plan(self, request: Any, num_computed_tokens: int, params: dict[str, Any]) -> None:
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
        self.records[request.request_id] = record
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
        rules = self.rules
        info = params.get(KVTURN_FIELD)
        params["remote_num_tokens"] = 0
        retained = parse_retained(info, rules.block_size, params) \
            if isinstance(info, dict) else None
        if retained is None or not isinstance(info, dict):
            # No (or unusable) hashes: nothing can be verified, so nothing is read.
            params["remote_block_ids"] = [[]]
            return ReuseRecord(ReuseReason.UNVERIFIED, 0, num_computed_tokens)
        retained_ids, retained_hashes = retained
        bs = rules.block_size
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
                prompt_hashes=block_hashes(prompt, bs, rules.hash_seed, extras),
                local_hit_tokens=num_computed_tokens,
                retained_hashes=retained_hashes,
                retained_block_ids=retained_ids[:len(retained_hashes)],
                block_size=bs, threshold=rules.threshold,
                expired=False, engine_known=True,
                # vLLM loads nothing external for a request that skips reading the prefix
                # cache (prompt logprobs), whatever the connector answers.
                enabled=rules.enabled
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

    def record_outcome(self, record: ReuseRecord) -> None:
        report = record.report()
        self._stats.record("kvturn_reuse", report["reason"])
        self._stats.record("kvturn_reused_tokens", report["reused_tokens"])
        if record.read_failed:
            self._stats.record("kvturn_fallbacks", READ_FAILED)
        elif record.cheaper_to_compute:
            self._stats.record("kvturn_fallbacks", CHEAPER_TO_COMPUTE)
        elif record.reason in _FALLBACKS:
            self._stats.record("kvturn_fallbacks", record.reason.value)

    @staticmethod
    def _calibrate(calibration: Calibration, connector_output: Any, failed: set[str]) -> None:
        calibration.step_reported()
        # The workers' NIXL stats ride on this output; reading them leaves them for vLLM.
        # Bandwidth first: a read's fixed cost is what its transfer does not explain.
        data = getattr(getattr(connector_output, "kv_connector_stats", None), "data", None)
        if isinstance(data, dict):
            calibration.transfers(data.get("bytes_transferred") or (),
                                  data.get("transfer_duration") or ())
        calibration.read_finished(getattr(connector_output, "finished_recving", None) or (),
                                  failed)


def make_calibration(config: ConnectorConfig, vllm_config: Any, kv_cache_config: Any,
                     block_size: int) -> Calibration | None:
    """The prefill's cost model and its calibration; None when the cost model is off."""
    if config.reuse_cost_model == "off":
        return None
    # One worker's KV per token, the way make_keeper sizes a block.
    total = sum(t.size for t in kv_cache_config.kv_cache_tensors)
    per_token = total / max(kv_cache_config.num_blocks, 1) / block_size
    try:
        model = CostModel(config.cost_settings, bytes_per_token=per_token,
                          hidden_size=vllm_config.model_config.get_hidden_size())
    except ValueError as exc:
        log.warning("kvturn: no reuse cost model, the recompute threshold alone decides: %s",
                    exc)
        return None
    return Calibration(model)


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
