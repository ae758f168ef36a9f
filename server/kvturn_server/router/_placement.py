"""Where a turn runs, decided from what each instance already holds of the conversation.

A conversation's KV lives in two caches: the decode that produced its last answer retains all
of it (prompt and reply, under a lease), and the prefill that computed its last prefill leg
still holds that prompt in its prefix cache unless other work pushed it out. Per turn:

1. **The decode continues the turn itself** when it holds the conversation, the request extends
   the history it holds, and the part it lacks is short (at most ``decode_continue_tokens``,
   estimated by ``_history.py``): no prefill leg, no transfer, no pin; the decode's own prefix
   cache supplies the rest, exactly. In agent loops almost every turn is short once the decode
   holds the conversation (a tool result, a user reply). The decode computes those tokens
   between its other requests' steps, so the estimated tokens of continued turns in progress
   on one decode are capped (``decode_continue_budget``); past it a turn takes the prefill
   path. Conditional disaggregation (Dynamo, llm-d) does this for short prompts; kvturn's
   retention makes the next turn of a conversation short. A longer turn continues there too
   when the decode keeps the history in its host tier alone (:func:`host_continuation`):
   a prefill could read none of it and would recompute it all.
2. Otherwise **a prefill** is chosen by policy (:func:`choose_prefill`), and the decode's
   retention is pinned for it only when the retention holds more than that prefill is known to
   hold (:func:`read_gain`): the prefill's connector then reads the verified blocks it lacks
   and computes the rest.

With ``kv_reuse`` off the router is stock P/D, and with ``conditional_disagg`` set it is the
stock baseline kvturn is measured against (:func:`conditional_decode`; on instances with vLLM's
CPU KV offloading, the strongest stock setup): conditional disaggregation as llm-d and Dynamo
ship it, with no retention behind it.

Nothing here changes an answer: every path computes or reads exactly the prompt's KV.
"""

from __future__ import annotations

from kvturn.wire import PrefillChoice
from kvturn_server.router._history import Transcript, new_tokens
from kvturn_server.router._legs import DecodeUsage
from kvturn_server.router._pool import READ_FLOOR_TTL, Backend, Pool
from kvturn_server.router._state import Placement


def choose_prefill(pool: Pool, policy: str, placement: Placement | None, *, slack: int,
                   exclude: Backend | None = None) -> tuple[Backend | None, PrefillChoice]:
    """The prefill for a turn and why (``X-KVTurn-Prefill-Choice``): ``holder`` (it computed
    the conversation's last prefill leg), ``affinity`` (the same, by session affinity),
    ``load`` (fewest requests in flight) or ``round-robin``."""
    if policy == "round-robin":
        return pool.pick_in_turn(exclude=exclude), PrefillChoice.ROUND_ROBIN
    holder = None
    if placement is not None and placement.prefill is not None \
            and policy in ("affinity", "kv-aware"):
        holder = pool.by_url(placement.prefill)
    if holder is not None and holder.healthy and holder is not exclude:
        if policy == "affinity":
            return holder, PrefillChoice.AFFINITY
        least = min(b.in_flight for b in pool.members if b.healthy and b is not exclude)
        if holder.in_flight <= least + slack:
            return holder, PrefillChoice.HOLDER
    return pool.pick(exclude=exclude), PrefillChoice.LOAD


def choose_decode(pool: Pool, holder: Backend | None, *, slack: int) -> Backend | None:
    """The decode for a turn's decode leg: the one retaining the conversation (its prefix cache
    holds it, so it reads least from the prefill) unless it has more than ``slack`` requests
    in flight beyond the least loaded decode; then the least loaded one (the conversation
    moves, and its old retention is released once the new one is recorded)."""
    if holder is not None and holder.healthy:
        # The holder may have left the pool (DNS discovery) while the turn's prefill ran.
        healthy = [b for b in pool.members if b.healthy]
        if holder.in_flight <= min((b.in_flight for b in healthy),
                                   default=holder.in_flight) + slack:
            return holder
        return pool.pick(exclude=holder) or holder
    return pool.pick()


def read_gain(placement: Placement, prefill: Backend) -> int:
    """Tokens of the retention beyond what ``prefill`` is known to hold in its prefix cache.

    The router knows only what it sent that prefill: the conversation's last prefill leg. The
    prefill's connector verifies and measures the real local hit; this only decides whether a
    pin is worth its round trip.
    """
    held = placement.prefill_tokens if placement.prefill == prefill.url else 0
    if placement.block_size > 0:
        held -= held % placement.block_size
    return max(0, placement.cached_tokens - held)


def read_floor(prefill: Backend, now: float) -> int:
    """The prefill's current floor (``Pool.read_reported`` learns it from its reports; 0
    once it is older than :data:`READ_FLOOR_TTL`)."""
    return prefill.read_floor if now - prefill.read_floor_at < READ_FLOOR_TTL else 0


def gone_from_lease(placement: Placement, now: float) -> str | None:
    """``lost`` when the decode said the conversation's retention is gone (evicted, expired),
    ``expired`` when its lease ran out by the router's clock, else None."""
    if placement.lost is not None:
        return "lost"
    if placement.retained and placement.expires_at <= now:
        return "expired"
    return None


def full_blocks(placement: Placement) -> int:
    """Tokens of the recorded history in full blocks: what a prefix cache can supply of it."""
    if placement.readable_tokens is not None:
        return placement.readable_tokens
    if placement.block_size > 0:
        return placement.num_tokens - placement.num_tokens % placement.block_size
    return placement.num_tokens


def continuation(*, placement: Placement, holder: Backend, transcript: Transcript | None,
                 now: float, max_tokens: int, budget: int,
                 held: int | None = None) -> tuple[int, str]:
    """Whether ``holder`` (the decode that served the conversation's last turn) should
    continue this turn alone.

    The decision is stock conditional disaggregation's (:func:`conditional_decode`: the same
    estimate of the new tokens, the same threshold), with what kvturn knows besides and a
    budget of continued tokens per decode. A turn the decode did not retain
    (``placement.retained`` false: over the budget, too short) still continues: the decode
    just computed it, and its plain prefix cache holds it as a stock router's decode would; its
    usage reports what it found.

    A retention known gone (:func:`gone_from_lease`) was only freed: vLLM keeps freed blocks
    in its prefix cache until an allocation takes them, least recently freed first, so the
    history may still be there, or little of it on a decode short of memory, where continuing
    would have the decode recompute it amid its other requests. ``held`` is what the decode
    said it still holds of the conversation from its start (the router asks:
    :func:`~kvturn_server.router._plan.plan_probe`); the turn continues when what the decode
    must compute, the history it lost and the new tokens, is within the threshold, and takes a
    prefill otherwise (or when the decode could not say).

    Returns ``(estimated tokens to compute, "")`` when it should, else ``(0, why not)`` with
    why one of ``off``, ``unhealthy``, ``stale``, ``expired``, ``lost``, ``no_history``,
    ``edited``, ``too_long``, ``busy``.
    """
    estimate, why = conditional_decode(placement=placement, holder=holder,
                                       transcript=transcript, max_tokens=max_tokens)
    if why:
        return 0, why
    gone = gone_from_lease(placement, now)
    if gone is not None:
        if held is None:
            return 0, gone
        # What a live retention would have supplied is the history's full blocks (the
        # partial last one is computed anyway, as for every continued turn).
        estimate += max(0, full_blocks(placement) - held)
        if estimate > max_tokens:
            return 0, gone
    if holder.continuing + estimate > budget:
        return 0, "busy"
    return estimate, ""


def host_continuation(*, placement: Placement, holder: Backend, transcript: Transcript | None,
                      host_tokens: int, max_tokens: int) -> tuple[int, str]:
    """Whether ``holder``, which keeps the conversation's retention in its host tier alone
    (``host_tokens`` of it from the start), should continue a turn that a prefill would
    otherwise serve by recomputing the whole history (no device blocks to read).

    The decode loads the host copy (vLLM's offloading connector, PCIe-fast next to a
    recompute) and computes what it lacks: the turn's new tokens and any history the host
    tier no longer holds. That is allowed up to ``max_tokens`` together with the estimated
    tokens of the decode's other continued turns in progress, so a few long continuations at
    once cannot stall its other requests' decoding. Returns ``(estimated tokens to compute,
    "")`` when it should, else ``(0, why not)`` (:func:`conditional_decode`'s words, or
    ``busy``).
    """
    if host_tokens <= 0:
        return 0, "lost"
    estimate, why = conditional_decode(placement=placement, holder=holder,
                                       transcript=transcript, max_tokens=max_tokens)
    if why:
        return 0, why
    estimate += max(0, full_blocks(placement) - host_tokens)
    if holder.continuing + estimate > max_tokens:
        return 0, "busy"
    return estimate, ""


def conditional_decode(*, placement: Placement, holder: Backend, transcript: Transcript | None,
                       max_tokens: int) -> tuple[int, str]:
    """Stock conditional disaggregation: whether ``holder``, the decode that served the
    conversation's last turn, runs this turn alone (no prefill leg, no transfer).

    This is the baseline a user who knows the field would pick over kvturn: llm-d's
    ``prefix-based-pd-decider`` (decode-only when the prompt tokens the chosen decode does not
    cache are at most ``nonCachedTokens``) and NVIDIA Dynamo's ``--router-conditional-disagg``
    (``isl_bounding``: the same against the decode's cached overlap, 2,048 tokens by default).
    Nothing holds the KV: the decode's plain prefix cache (LRU) supplies whatever it still
    has, and the rest is computed there. The router knows only what it sent and relayed
    (``placement.num_tokens``: the tokens of the last turn's prompt and reply, from the
    decode's usage; ``placement.history``: its messages); the reply coming back counts as
    cached, as a router fed by the decode's KV events (Dynamo) knows it is.

    Returns ``(estimated new tokens, "")`` to run it on ``holder``, else ``(0, why not)``
    with why one of ``off``, ``unhealthy``, ``stale``, ``no_history``, ``edited``,
    ``too_long``.
    """
    if max_tokens <= 0:
        return 0, "off"
    if not holder.healthy:
        return 0, "unhealthy"
    if holder.engine_id is not None and placement.engine_id is not None \
            and holder.engine_id != placement.engine_id:
        return 0, "stale"  # the decode restarted: its prefix cache is empty
    if placement.history is None or transcript is None or placement.num_tokens <= 0:
        return 0, "no_history"
    estimate = new_tokens(placement.history, transcript, known_tokens=placement.num_tokens)
    if estimate is None:
        return 0, "edited"
    if estimate > max_tokens:
        return 0, "too_long"
    return estimate, ""


def served_tokens(usage: DecodeUsage | None, prefill_tokens: int) -> int:
    """What the router knows a decode processed of a turn: its usage's prompt and reply
    tokens, else the prompt tokens its prefill reported (0: nothing known)."""
    if usage is not None and usage.prompt_tokens > 0:
        return usage.prompt_tokens + usage.completion_tokens
    return prefill_tokens
