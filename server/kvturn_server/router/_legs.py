"""Request bodies of a turn's legs and what their replies report (pure functions, no I/O).

Field names follow vLLM's NIXL connector for the P->D hand-off; everything of kvturn's own lives
in one namespaced object, ``kv_transfer_params["kvturn"]``. docs/http-api.md, section B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvturn.wire import REUSE_REASONS, ReuseReason

KVTURN_FIELD = "kvturn"

# The prefill leg when there is no retention to read: compute the prompt, keep its blocks for
# the decode to read (do_remote_decode) and answer with their coordinates.
NO_RETENTION_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# Where vLLM 0.32 takes transfer params from a request: the top-level fields, and the same
# names inside ``vllm_xargs``, which become the engine request's ``extra_args`` (the top-level
# field overrides, but only when it is set and non-empty; on a leg where the router sets none,
# a client's ``vllm_xargs.kv_transfer_params`` would reach the connector). ``ec_`` is the
# encoder-cache connector's equivalent: no client steers either.
TRANSFER_FIELDS = frozenset({"kv_transfer_params", "ec_transfer_params"})
_ROUTER_FIELDS = frozenset({"conversation_id", *TRANSFER_FIELDS})


def client_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request without the fields only the router may set.

    ``conversation_id`` is the router's (vLLM would reject an unknown field), transfer params
    must never come from a client, in any spelling (they would steer the connectors to
    arbitrary blocks or hosts, and a malformed one fails inside the engine), and ``kvturn*``
    is kvturn's namespace. ``session_id`` is vLLM's and passes on.
    """
    out = {k: v for k, v in body.items()
           if k not in _ROUTER_FIELDS and not k.startswith(KVTURN_FIELD)}
    xargs = out.get("vllm_xargs")
    if isinstance(xargs, dict) and not TRANSFER_FIELDS.isdisjoint(xargs):
        out["vllm_xargs"] = {k: v for k, v in xargs.items() if k not in TRANSFER_FIELDS}
    return out


def without_transfer_params(value: Any) -> tuple[Any, bool]:
    """``value`` (a parsed reply or stream event) with every ``kv_transfer_params`` key
    removed, at any depth, and whether there was one. The decode's block ids and hosts are
    the router's business, not the client's; a key of that name cannot come from generated
    text (that is always a string value)."""
    if isinstance(value, dict):
        found = False
        out: dict[str, Any] = {}
        for k, v in value.items():
            if k == "kv_transfer_params":
                found = True
                continue
            v, inner = without_transfer_params(v)
            found = found or inner
            out[k] = v
        return (out, True) if found else (value, False)
    if isinstance(value, list):
        items = [without_transfer_params(v) for v in value]
        if any(found for _, found in items):
            return [v for v, _ in items], True
    return value, False


def prefill_body(body: dict[str, Any], retention_params: dict[str, Any] | None) -> dict[str, Any]:
    """The prefill leg: compute the prompt's KV and stop after one token, non-streaming.

    ``retention_params`` are the params of a retention the router has just pinned (never older
    ones): the prefill's connector verifies their block hashes against its prompt and reads the
    verified blocks from the decode. Without them the prefill computes everything.
    """
    leg = dict(body)
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    # min_tokens > 1 would contradict max_tokens=1; one completion is enough for the KV.
    leg.pop("min_tokens", None)
    leg.pop("best_of", None)
    leg["n"] = 1
    leg["kv_transfer_params"] = retention_leg_params(retention_params)
    return leg


def retention_leg_params(retention_params: dict[str, Any] | None) -> dict[str, Any]:
    """A prefill leg's ``kv_transfer_params`` (every API's): the pinned retention's params
    to verify and read, or none to read; either way the prefill keeps its blocks for the
    decode (``do_remote_decode``)."""
    if retention_params is None:
        return dict(NO_RETENTION_PARAMS)
    return {**retention_params, "do_remote_decode": True, "do_remote_prefill": False}


def decode_body(body: dict[str, Any], prefill_params: dict[str, Any] | None,
                key: str | None) -> dict[str, Any]:
    """The decode leg: the client's request plus the prefill's transfer params.

    The prefill's ``kvturn`` object (its reuse report) is replaced by ``{"conversation": key}``,
    which tells the decode to retain the finished sequence under ``key``. Without prefill params
    (the decode continues the turn itself, or both prefill attempts failed) the decode computes
    what its prefix cache lacks and, given a key, still retains: ``do_remote_prefill: false``
    means there is nothing to read.
    """
    leg = dict(body)
    if prefill_params is not None:
        params = {k: v for k, v in prefill_params.items() if k != KVTURN_FIELD}
    elif key is not None:
        params = {"do_remote_prefill": False}
    else:
        return leg
    if key is not None:
        params[KVTURN_FIELD] = {"conversation": key}
    leg["kv_transfer_params"] = params
    return leg


@dataclass(frozen=True, slots=True)
class ReuseReport:
    """What the prefill says it reused: ``reason`` is an X-KVTurn-Reuse value."""

    reason: ReuseReason
    reused_tokens: int = 0
    local_tokens: int = 0
    declined_tokens: int = 0
    """Tokens of a verified range the prefill's cost model declined to read (computing them
    was expected to be faster); 0 when it read, or weighed nothing."""


def reuse_report(prefill_params: dict[str, Any]) -> ReuseReport | None:
    """The prefill's ``kvturn.reuse`` report, or None when it sent none (or nonsense)."""
    info = prefill_params.get(KVTURN_FIELD)
    reuse = info.get("reuse") if isinstance(info, dict) else None
    if not isinstance(reuse, dict) or reuse.get("reason") not in REUSE_REASONS:
        return None
    cost = reuse.get("cost")
    declined = 0
    if isinstance(cost, dict) and _is_number(cost.get("read_ms")) \
            and _is_number(cost.get("compute_ms")) and cost["read_ms"] >= cost["compute_ms"] \
            and not _count(reuse.get("reused_tokens")):
        declined = _count(cost.get("tokens"))
    return ReuseReport(ReuseReason(reuse["reason"]), _count(reuse.get("reused_tokens")),
                       _count(reuse.get("local_tokens")), declined)


def coverage(cached_tokens: int, prompt_tokens: int, block_size: int) -> ReuseReason:
    """The reuse value of a prompt of which an instance's own cache supplied
    ``cached_tokens``: ``hit`` when they cover every full block of the prompt (all but the last
    token, which is always computed), ``partial`` when some, ``miss`` when none. Without a
    block size a hit cannot be told from a partial one: ``partial``."""
    if cached_tokens <= 0:
        return ReuseReason.MISS
    if block_size > 0 and prompt_tokens > 0 \
            and cached_tokens >= (prompt_tokens - 1) // block_size * block_size:
        return ReuseReason.HIT
    return ReuseReason.PARTIAL


def local_coverage(report: ReuseReport | None, prompt_tokens: int,
                   block_size: int) -> ReuseReason:
    """The reuse value of a turn whose prefill held everything the retention offered: its
    own cache's ``coverage`` of the prompt."""
    return coverage(report.local_tokens if report is not None else 0, prompt_tokens,
                    block_size)


def continued_reuse(usage: DecodeUsage | None, connector: ReuseReport | None,
                    block_size: int) -> ReuseReport | None:
    """What a turn the decode continued alone really reused: its usage's cached tokens (what
    its own prefix cache supplied; it read nothing), else the connector's own count in a
    non-streamed reply; None when neither says."""
    if usage is not None and usage.cached_tokens is not None:
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        return ReuseReport(coverage(cached, usage.prompt_tokens, block_size), cached, cached)
    return connector


def readable_tokens(params: dict[str, Any]) -> tuple[int | None, int]:
    """Of a retention's params (as the decode publishes them), the tokens in its readable full
    blocks and the block size; ``(None, 0)`` when they do not say."""
    info = params.get(KVTURN_FIELD)
    block_size = info.get("block_size") if isinstance(info, dict) else None
    ids = params.get("remote_block_ids")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        return None, 0
    if not (isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list)):
        return None, block_size
    return len(ids[0]) * block_size, block_size


@dataclass(frozen=True, slots=True)
class RetainedReport:
    """What a non-streaming decode reply says about the retention it made (and, for a turn
    the decode continued itself, what its own prefix cache supplied: ``reuse``)."""

    retained: bool
    engine_id: str | None = None
    num_tokens: int | None = None
    expires_in: float | None = None
    readable_tokens: int | None = None
    block_size: int = 0
    reuse: ReuseReport | None = None
    read_id: str | None = None


def read_id_of(params: dict[str, Any]) -> str | None:
    """A retention's read id in its params (vLLM's ``remote_request_id``): what tells it from
    a newer retention under the same key, in the decode's lost log (``_lost.py``)."""
    value = params.get("remote_request_id")
    return value if isinstance(value, str) else None


def retained_report(response: Any) -> RetainedReport | None:
    """Read ``kv_transfer_params.kvturn`` of a decode reply; None when the reply has none.

    ``engine_id``/``num_tokens`` fall back to vLLM's own ``remote_engine_id``/
    ``remote_num_tokens`` (the decode's coordinates for a later read).
    """
    if not isinstance(response, dict):
        return None
    params = response.get("kv_transfer_params")
    info = params.get(KVTURN_FIELD) if isinstance(params, dict) else None
    if not isinstance(info, dict) or "retained" not in info:
        return None
    assert isinstance(params, dict)
    engine_id = info.get("engine_id", params.get("remote_engine_id"))
    num_tokens = info.get("num_tokens", params.get("remote_num_tokens"))
    expires_in = info.get("expires_in")
    readable, block_size = readable_tokens(params)
    return RetainedReport(
        retained=info.get("retained") is True,
        engine_id=str(engine_id) if isinstance(engine_id, str | int) else None,
        num_tokens=_count(num_tokens) if num_tokens is not None else None,
        expires_in=_seconds(expires_in), readable_tokens=readable, block_size=block_size,
        reuse=reuse_report(params), read_id=read_id_of(params))


@dataclass(frozen=True, slots=True)
class DecodeUsage:
    """What a decode leg's ``usage`` says (any API's, read by ``_apis.py``).

    Attributes:
        prompt_tokens: the prompt's tokens.
        completion_tokens: the tokens the decode generated.
        cached_tokens: the prompt tokens the decode did not compute (vLLM's
            ``prompt_tokens_details.cached_tokens``: its own prefix-cache hit plus, on a P/D
            leg, what it loaded from the prefill); None when the decode does not say (served
            without ``--enable-prompt-tokens-details``).
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        """The sequence the decode holds once the turn is over (prompt and reply)."""
        return self.prompt_tokens + self.completion_tokens


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _seconds(value: Any) -> float | None:
    return float(value) if _is_number(value) else None


def _count(value: Any) -> int:
    return int(value) if _is_number(value) and value >= 0 else 0
