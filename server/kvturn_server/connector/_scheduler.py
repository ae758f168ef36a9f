"""Scheduler side: vLLM's NIXL pull scheduler plus content verification of decode -> prefill reads.

vLLM's bidirectional mode lets a prefill read the blocks a decode kept after the previous turn,
but it assumes the new prompt extends the decode's sequence block for block and reads the *tail*
of the decode's block list. When history was edited (a message removed, reasoning stripped, a
re-rendered assistant turn) that reads the wrong blocks and silently changes the answer
(vLLM issue #43094).

Here the decode publishes a chained content hash per full block of what it retains
(``kv_transfer_params["kvturn"]["block_hashes"]``), and the prefill reads only the blocks whose
hashes equal those of its own prompt, block by block from the start, beyond its local
prefix-cache hit. Everything after the first differing block is computed.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)

from kvturn_server.connector._hashing import block_hashes
from kvturn_server.connector._reuse import decide_reuse

log = logging.getLogger("kvturn.connector")

KVTURN_FIELD = "kvturn"
FORMAT = 1


class KVTurnPullScheduler(NixlPullConnectorScheduler):  # type: ignore[misc]
    """Publishes block hashes on the decode; verifies them on the prefill before any read."""

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished(request, block_ids)
        if delay_free and params is not None and params.get("do_remote_decode"):
            # This is a decode keeping its blocks for the next turn's prefill.
            num_tokens = int(params.get("remote_num_tokens") or 0)
            tokens = list(request.all_token_ids)[:num_tokens]
            params[KVTURN_FIELD] = {
                # format: bumps when the fields below change meaning
                "format": FORMAT,
                # block_size: tokens per hashed block; the prefill must use the same
                "block_size": self.block_size,
                # block_hashes: hex chained hashes of each full retained block, in order
                "block_hashes": [h.hex() for h in block_hashes(tokens, self.block_size)],
            }
        return delay_free, params

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and params.get("remote_block_ids"):
            self._restrict_to_verified_blocks(request, num_computed_tokens, params)
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens)
        return result

    def _restrict_to_verified_blocks(self, request: Any, num_computed_tokens: int,
                                     params: dict[str, Any]) -> None:
        """Rewrite the decode's params so that only verified blocks are read.

        Idempotent: vLLM may ask again in a later step, so the decode's original block list is
        kept in the kvturn field and every call starts from it. What to read is
        ``decide_reuse``'s answer; vLLM's own threshold check then sees exactly that range.
        """
        info = params.get(KVTURN_FIELD)
        params["remote_num_tokens"] = 0
        retained = _parse(info, self.block_size, params) if isinstance(info, dict) else None
        if retained is None or not isinstance(info, dict):
            # No (or unusable) hashes: nothing can be verified, so nothing is read.
            return
        retained_ids, retained_hashes = retained
        bs = self.block_size
        prompt = list(request.prompt_token_ids or [])
        try:
            decision = decide_reuse(
                # The prompt's last token is always computed here: it produces the logits.
                prompt_hashes=block_hashes(prompt[:-1], bs),
                local_hit_tokens=num_computed_tokens,
                retained_hashes=retained_hashes,
                retained_block_ids=retained_ids[:len(retained_hashes)],
                block_size=bs, threshold=self.kv_recompute_threshold,
                expired=False, engine_known=True, enabled=True)
        except ValueError as exc:
            log.warning("request %s: unusable retention, recomputing: %s",
                        request.request_id, exc)
            params["remote_block_ids"] = [[]]
            return
        info["decision"] = decision.reason.value
        params["remote_block_ids"] = [list(decision.remote_blocks)]
        if decision.num_tokens:
            params["remote_num_tokens"] = (
                (decision.first_block + len(decision.remote_blocks)) * bs)
        log.debug("request %s: reuse %s, %d tokens from the decode", request.request_id,
                  decision.reason.value, decision.num_tokens)


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
