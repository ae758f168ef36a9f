"""What a prefill reads from a decode's retained KV for one request, and why.

The decision is plain data over plain inputs so that every outcome can be tested without vLLM:
the scheduler adapter gathers the inputs (its own prompt hashes and local prefix-cache hit, the
retention the router passed in ``kv_transfer_params``), calls :func:`decide_reuse`, and turns the
decision into a NIXL read of ``remote_blocks`` into the prompt's blocks ``first_block ..``.

Coverage is counted in *full* blocks of the prompt. A trailing partial block is never reused (it
has no hash and its KV is incomplete), so it never stops a prompt from being a "hit". When a hit
covers every prompt token, vLLM itself recomputes the final prompt token after the load to get the
logits it samples from, so a hit never leaves the prefill with nothing to compute.

The outcome is a ``ReuseReason`` (``kvturn.wire``), the value ``X-KVTurn-Reuse`` reports.

Checked in this order, the first that applies wins:

- ``disabled``: reuse is turned off for this deployment or request (also: the request asks
  for prompt logprobs, for which vLLM reads no cached KV).
- ``miss``: nothing to reuse: no retention was passed, or the prompt has no full block.
- ``expired``: the retention's lease ran out before this request arrived.
- ``stale``: the retention belongs to a decode engine this prefill does not know (restarted,
  replaced, or never registered), so its block ids mean nothing.
- ``unverified``: the retention exists but its first block differs from the prompt's: the
  history diverged at block 0 (another system prompt, template or tokenizer, or another
  adapter, salt, image or model: the hashes cover them, ``_extra_keys.py``). The scheduler
  also reports it, without asking here, for params or inputs it cannot verify at all.
- ``below-threshold``: a verified remote range exists but is shorter than the recompute
  threshold, or the cost model expects computing it to be faster than reading it (then
  :attr:`ReuseDecision.cost` says why): the effective threshold is the larger of the two.
- ``hit``: every full block of the prompt is covered by the local prefix-cache hit plus the
  verified remote range.
- ``partial``: some but not all full blocks are covered (edited or stripped history, or new
  suffix tokens beyond the retention).

``hit`` and ``partial`` describe coverage, not bytes moved: when the local cache already
covers every verified block there is nothing to read (``num_tokens == 0``) and the reason is
still ``hit`` or ``partial``. :attr:`ReuseDecision.reused` says whether a read happens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvturn.wire import ReuseReason
from kvturn_server.connector._cost import ReadCost
from kvturn_server.connector._hashing import HASH_SIZE, verified_prefix_blocks


@dataclass(frozen=True, slots=True)
class ReuseDecision:
    """What to read from the retention for one request.

    Attributes:
        reason: why this is the decision (see :class:`ReuseReason`).
        remote_blocks: the retention's block ids to read, in prompt order; empty when nothing is
            read.
        first_block: index of the prompt block that ``remote_blocks[0]`` fills. Always equals the
            number of blocks covered by the local prefix-cache hit, so the remote range is
            ``first_block .. first_block + len(remote_blocks)`` even when it is empty.
        num_tokens: tokens that will be read (``len(remote_blocks) * block_size``).
        cost: the cost model's estimate, when it was asked: a verified range at least the
            recompute threshold long was weighed (read or declined). None otherwise.
    """

    reason: ReuseReason
    remote_blocks: tuple[int, ...]
    first_block: int
    num_tokens: int
    cost: ReadCost | None = None

    @property
    def reused(self) -> bool:
        """True when the prefill reads at least one block from the retention."""
        return self.num_tokens > 0

    @property
    def cheaper_to_compute(self) -> bool:
        """The range passed the recompute threshold and the cost model declined it."""
        return self.cost is not None and not self.cost.worth_reading


def decide_reuse(
    *,
    prompt_hashes: Sequence[bytes],
    local_hit_tokens: int,
    retained_hashes: Sequence[bytes],
    retained_block_ids: Sequence[int],
    block_size: int,
    threshold: int,
    expired: bool,
    engine_known: bool,
    enabled: bool,
    cost: Callable[[int, int], ReadCost] | None = None,
) -> ReuseDecision:
    """Decide which retained blocks a prefill reads for one request.

    Args:
        prompt_hashes: :func:`~kvturn_server.connector._hashing.block_hashes` of the prompt
            (one per full block), computed by the prefill itself.
        local_hit_tokens: tokens the prefill's own prefix cache already holds; block aligned, as
            vLLM's prefix cache only hits whole blocks.
        retained_hashes: the retention's block hashes, in order.
        retained_block_ids: the decode's block ids holding those blocks, one per hash.
        block_size: tokens per KV block (the same on both sides; the hashes encode it).
        threshold: the recompute threshold in tokens: a remote range shorter than this is
            recomputed instead of read. 0 reads any non-empty range.
        expired: the retention's lease has run out.
        engine_known: the retention's decode engine is one this prefill can read from.
        enabled: reuse is on for this request.
        cost: the cost model (:meth:`~kvturn_server.connector._cost.CostModel.estimate`),
            asked ``cost(tokens, context)`` for a range that passed the threshold, with the
            local hit as its context; the range is read only if reading is expected to be
            faster. None: the threshold alone decides.

    All inputs are validated before any rule applies, so malformed input fails the same way
    whatever the flags say. The retention fields arrive over the network, and a wrong block id
    would load another conversation's KV, so they are checked strictly.

    Raises:
        ValueError: malformed input; the caller should treat it as "recompute everything".
    """
    _check_int("block_size", block_size, minimum=1)
    _check_int("threshold", threshold, minimum=0)
    _check_int("local_hit_tokens", local_hit_tokens, minimum=0)
    if local_hit_tokens % block_size:
        raise ValueError(
            f"local_hit_tokens ({local_hit_tokens}) is not a multiple of block_size "
            f"({block_size})")
    local_blocks = local_hit_tokens // block_size
    if local_blocks > len(prompt_hashes):
        raise ValueError(
            f"local hit of {local_blocks} blocks exceeds the prompt's {len(prompt_hashes)} "
            f"full blocks")
    _check_retention(retained_hashes, retained_block_ids)

    def nothing(reason: ReuseReason) -> ReuseDecision:
        return ReuseDecision(reason, (), local_blocks, 0)

    if not enabled:
        return nothing(ReuseReason.DISABLED)
    if not retained_hashes or not prompt_hashes:
        return nothing(ReuseReason.MISS)
    if expired:
        return nothing(ReuseReason.EXPIRED)
    if not engine_known:
        return nothing(ReuseReason.STALE)

    verified = verified_prefix_blocks(prompt_hashes, retained_hashes)
    if verified == 0:
        # Even with a local hit this is reported: it is the signal that the router paired the
        # request with a retention of a different history, which a hit would otherwise hide.
        return nothing(ReuseReason.UNVERIFIED)

    # Blocks the local cache holds are not read again: a local hit is free, a read is not.
    remote_count = max(0, verified - local_blocks)
    remote_tokens = remote_count * block_size
    if 0 < remote_tokens < threshold:
        return nothing(ReuseReason.BELOW_THRESHOLD)
    estimate = cost(remote_tokens, local_hit_tokens) if cost and remote_tokens else None
    if estimate is not None and not estimate.worth_reading:
        return ReuseDecision(ReuseReason.BELOW_THRESHOLD, (), local_blocks, 0, estimate)

    covered = max(local_blocks, verified)
    reason = ReuseReason.HIT if covered == len(prompt_hashes) else ReuseReason.PARTIAL
    remote = tuple(retained_block_ids[local_blocks:local_blocks + remote_count])
    return ReuseDecision(reason, remote, local_blocks, remote_tokens, estimate)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    # bool is an int subclass; True as a block size is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_retention(hashes: Sequence[bytes], block_ids: Sequence[int]) -> None:
    if len(hashes) != len(block_ids):
        raise ValueError(
            f"retention has {len(hashes)} block hashes but {len(block_ids)} block ids; "
            f"they must pair one to one")
    for index, digest in enumerate(hashes):
        if not isinstance(digest, bytes) or len(digest) != HASH_SIZE:
            raise ValueError(
                f"retained block hash {index} must be {HASH_SIZE} bytes, got {digest!r:.60}")
    seen: set[int] = set()
    for index, block_id in enumerate(block_ids):
        if isinstance(block_id, bool) or not isinstance(block_id, int) or block_id < 0:
            raise ValueError(
                f"retained block id {index} must be a non-negative int, got {block_id!r:.60}")
        if block_id in seen:
            # One sequence never holds a physical block twice; a repeat means the record is
            # corrupt, and reading it would put one block's KV at two positions.
            raise ValueError(f"retained block id {block_id} appears more than once")
        seen.add(block_id)
