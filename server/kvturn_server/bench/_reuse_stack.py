"""``kvturn bench reuse``'s view of the stack: what the benchmark does to the prefill and the
decode (``Backend``; tests swap in a fake) and the real one over a started stack's HTTP
endpoints (``StackBackend``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvturn.wire import retention_path
from kvturn_server.local import (
    DirectConversation,
    PromptSources,
    Samples,
    StackConfig,
    control,
    post_json,
    scrape,
    sources,
    total,
)


@dataclass(frozen=True)
class Snapshot:
    """Both instances at one moment: idle or not, and their prompt-token counters."""

    idle: bool
    prefill: PromptSources
    decode: PromptSources


@dataclass(frozen=True)
class TurnReply:
    """What a P/D turn reports back: the decode's block size, the prefill's reuse report and
    the milliseconds each step took (``pin``, ``prefill``, ``unpin``, ``decode``; a step that
    did not happen is absent)."""

    block_size: int
    reuse: dict[str, Any]
    steps_ms: dict[str, float] = field(default_factory=dict)


class Backend(Protocol):
    """The five things the benchmark does to the stack (tests swap in a fake)."""

    def turn(self, prompt: Sequence[int], key: str, *, read_retention: bool) -> TurnReply:
        """A router's turn: pin ``key``'s retention if reading, prefill leg, unpin, decode leg
        (first token), retained under ``key``."""

    def hold(self, prompt: Sequence[int], key: str) -> None:
        """The decode computes what it lacks of ``prompt`` and retains it under ``key``."""

    def warm(self, prompt: Sequence[int]) -> None:
        """The prefill computes what it lacks of ``prompt`` into its prefix cache."""

    def release(self, key: str) -> None: ...

    def snapshot(self) -> Snapshot: ...


def _running(samples: Samples) -> float:
    return (total(samples, "vllm:num_requests_running")
            + total(samples, "vllm:num_requests_waiting"))


class StackBackend:
    """:class:`Backend` over a started stack's prefill and decode (completions API)."""

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg

    def _conversation(self, key: str, reuse: bool) -> DirectConversation:
        cfg = self.cfg
        return DirectConversation(cfg.prefill_url, cfg.decode_url, cfg.decode_control_url,
                                  cfg.served_model_name, key=key, reuse=reuse)

    def turn(self, prompt: Sequence[int], key: str, *, read_retention: bool) -> TurnReply:
        leg = self._conversation(key, read_retention).turn(list(prompt), 1)
        if read_retention and leg.pin is None:
            raise RuntimeError(f"the benchmark's retention {key!r} could not be pinned "
                               f"({leg.gone}); its mode would measure a recompute")
        return TurnReply(_retained_block_size(leg.decode, key), leg.reuse,
                         {step: s * 1000 for step, s in leg.steps.items()})

    def hold(self, prompt: Sequence[int], key: str) -> None:
        conv = self._conversation(key, False)
        reply = post_json(f"{self.cfg.decode_url}/v1/completions",
                          conv.body(list(prompt), 1, {"kvturn": {"conversation": key}}),
                          timeout=conv.timeout)
        _retained_block_size(reply, key)

    def warm(self, prompt: Sequence[int]) -> None:
        conv = self._conversation("", False)
        post_json(f"{self.cfg.prefill_url}/v1/completions", conv.body(list(prompt), 1, None),
                  timeout=conv.timeout)

    def release(self, key: str) -> None:
        control(self.cfg.decode_control_url, "DELETE", retention_path(key))

    def snapshot(self) -> Snapshot:
        p, d = scrape(self.cfg.prefill_url), scrape(self.cfg.decode_url)
        return Snapshot(_running(p) + _running(d) == 0, sources(p), sources(d))


def _retained_block_size(reply: dict[str, Any], key: str) -> int:
    info = (reply.get("kv_transfer_params") or {}).get("kvturn") or {}
    if not info.get("retained"):
        raise RuntimeError(f"the decode did not retain {key!r} (retention off or over budget?); "
                           "the benchmark's modes need it")
    return int(info["block_size"])
