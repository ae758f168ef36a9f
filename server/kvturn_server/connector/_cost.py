"""Whether reading a range of retained KV is cheaper than computing it, on this instance.

A prefill that finds ``n`` verified tokens on a decode beyond its own prefix-cache hit can read
them over NIXL or compute them. Both cost time before the first token:

- **read**: ``read_fixed + n * bytes_per_token / bandwidth``. The fixed part is everything a read
  costs whatever its size: NIXL read setup, the request parked in ``WAITING_FOR_REMOTE_KVS``
  for at least one more engine step, the completion notification. ``bytes_per_token`` is one
  worker's KV cache per token (each worker reads its own slice, in parallel with the others).
- **compute**: ``n`` more prompt tokens in the prefill's step, at context ``L`` (the tokens
  before them, here the local hit). A token at context ``c`` costs ``1 + c / A`` units, the
  dense layers (1) plus attention over ``c`` earlier tokens; ``A`` is the context at which
  attention costs as much as the dense layers. Per layer and token the dense layers cost about
  ``24 d^2`` FLOPs and attention ``4 c d`` (hidden size ``d``), so ``A = 6 d`` by default. The
  ``n`` tokens sit at contexts ``L .. L + n - 1``, so they cost
  ``n * (1 + (L + (n - 1) / 2) / A)`` units, at ``1 / compute_tokens_per_s`` seconds each.

The prefill reads only when the read is expected to be faster. Each parameter is either
configured (``kv_connector_extra_config``), calibrated from this instance's own timings once
enough of them exist, or a default until then. The defaults are deliberately kind to reads (a
slow compute rate, a small fixed cost), so that an uncalibrated instance reads what it read
before this model existed, except ranges of a few tokens.

Plain Python, no vLLM: the scheduler feeds observations (:mod:`._calibration` times them) and
asks :meth:`CostModel.estimate`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

DEFAULT_READ_FIXED_MS = 2.0
DEFAULT_READ_GBPS = 10.0
DEFAULT_COMPUTE_TOKENS_PER_S = 2000.0
ATTENTION_TOKENS_PER_HIDDEN = 6
"""``A = 6 d``: see the module docstring."""
DEFAULT_HIDDEN_SIZE = 4096

# Observations before an estimate replaces the default. Compute steps are many and cheap to
# get; reads are fewer, and the first of each kind says the most about start-up effects.
COMPUTE_WARMUP = 4
READ_WARMUP = 3
ALPHA = 0.1
"""Weight of a new observation once warmed up: about the last 20 observations count."""


class CostSource(StrEnum):
    """Where the numbers of an estimate came from, least informed wins (see :class:`ReadCost`)."""

    CALIBRATED = "calibrated"
    CONFIGURED = "configured"
    DEFAULT = "default"


class RunningMean:
    """An exponentially weighted mean that starts as a plain mean.

    Observation ``k`` weighs ``max(1/k, alpha)``: the first ``1/alpha`` are averaged with equal
    weight (so the first one, often a start-up outlier, does not dominate until many others
    outvote it), later ones each weigh ``alpha``. :attr:`value` is None until ``warmup``
    observations exist.
    """

    def __init__(self, *, warmup: int, alpha: float = ALPHA) -> None:
        if warmup < 1 or not 0 < alpha <= 1:
            raise ValueError(f"warmup must be >= 1 and alpha in (0, 1], got {warmup}, {alpha}")
        self.warmup = warmup
        self.alpha = alpha
        self.samples = 0
        self._mean = 0.0

    def observe(self, x: float) -> None:
        self.samples += 1
        weight = max(1.0 / self.samples, self.alpha)
        self._mean += weight * (x - self._mean)

    @property
    def value(self) -> float | None:
        return self._mean if self.samples >= self.warmup else None


@dataclass(frozen=True, slots=True)
class ReadCost:
    """The expected cost of reading ``tokens`` tokens against computing them.

    ``source`` is ``default`` if any number used is still a default, else ``configured`` if any
    was configured, else ``calibrated``.
    """

    tokens: int
    read_ms: float
    compute_ms: float
    source: CostSource

    @property
    def worth_reading(self) -> bool:
        return self.read_ms < self.compute_ms

    def report(self) -> dict[str, Any]:
        """The ``cost`` object of the prefill's ``kvturn.reuse`` report."""
        return {"tokens": self.tokens, "read_ms": round(self.read_ms, 3),
                "compute_ms": round(self.compute_ms, 3), "source": self.source.value}


@dataclass(frozen=True, slots=True)
class CostSettings:
    """Configured parameters; None means calibrate (and use the default until calibrated)."""

    read_fixed_ms: float | None = None
    read_gbps: float | None = None
    compute_tokens_per_s: float | None = None
    compute_attention_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class _Param:
    value: float
    source: CostSource


class CostModel:
    """Expected read and compute times for one instance, calibrated from its observations.

    Internally in seconds: ``read_fixed`` (s per read), ``read_s_per_byte``, ``compute_s_per_unit``
    (s per token at context 0). Configured values are never overwritten by calibration, but the
    calibrated ones are still tracked (see :meth:`snapshot`).
    """

    def __init__(self, settings: CostSettings, *, bytes_per_token: float,
                 hidden_size: int | None = None) -> None:
        if not bytes_per_token > 0:
            raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
        self.settings = settings
        self.bytes_per_token = float(bytes_per_token)
        self.attention_tokens = float(
            settings.compute_attention_tokens
            or ATTENTION_TOKENS_PER_HIDDEN * (hidden_size or DEFAULT_HIDDEN_SIZE))
        self._read_fixed = RunningMean(warmup=READ_WARMUP)
        self._read_s_per_byte = RunningMean(warmup=READ_WARMUP)
        self._compute_s_per_unit = RunningMean(warmup=COMPUTE_WARMUP)

    # The decision.

    def work(self, tokens: int, context: int) -> float:
        """Compute units of ``tokens`` prompt tokens after ``context`` earlier ones."""
        if tokens <= 0:
            return 0.0
        return tokens * (1.0 + (context + (tokens - 1) / 2.0) / self.attention_tokens)

    def estimate(self, tokens: int, context: int) -> ReadCost:
        """Expected time to read ``tokens`` retained tokens, and to compute them at ``context``."""
        fixed, per_byte, per_unit = self._fixed(), self._per_byte(), self._per_unit()
        read_s = fixed.value + tokens * self.bytes_per_token * per_byte.value
        compute_s = self.work(tokens, context) * per_unit.value
        sources = {fixed.source, per_byte.source, per_unit.source}
        source = next(s for s in (CostSource.DEFAULT, CostSource.CONFIGURED,
                                  CostSource.CALIBRATED) if s in sources)
        return ReadCost(tokens, read_s * 1e3, compute_s * 1e3, source)

    def _fixed(self) -> _Param:
        return _pick(self.settings.read_fixed_ms, 1e-3, self._read_fixed.value,
                     DEFAULT_READ_FIXED_MS * 1e-3)

    def _per_byte(self) -> _Param:
        gbps = self.settings.read_gbps
        return _pick(None if gbps is None else 1.0 / gbps, 1e-9, self._read_s_per_byte.value,
                     1e-9 / DEFAULT_READ_GBPS)

    def _per_unit(self) -> _Param:
        rate = self.settings.compute_tokens_per_s
        return _pick(None if rate is None else 1.0 / rate, 1.0, self._compute_s_per_unit.value,
                     1.0 / DEFAULT_COMPUTE_TOKENS_PER_S)

    # Calibration.

    def observe_step(self, chunks: Iterable[tuple[int, int]], seconds: float) -> None:
        """An engine step computed these ``(tokens, context)`` chunks in ``seconds``.

        The step's whole time is charged to its tokens, per-step overhead included, so the
        estimate errs towards compute being dearer (towards reading) for small steps; the
        caller passes only steps with enough tokens for that overhead to be small.
        """
        units = sum(self.work(n, c) for n, c in chunks)
        if units > 0 and seconds > 0:
            self._compute_s_per_unit.observe(seconds / units)

    def observe_transfer(self, num_bytes: float, seconds: float) -> None:
        """NIXL moved ``num_bytes`` in ``seconds`` of transfer time (its own telemetry)."""
        if num_bytes > 0 and seconds > 0:
            self._read_s_per_byte.observe(seconds / num_bytes)

    def observe_read(self, tokens: int, seconds: float) -> None:
        """A read of ``tokens`` tokens kept its request waiting ``seconds``, from the decision to
        read to the scheduler learning it finished. What the transfer itself does not explain
        (at the bandwidth in use) is the fixed cost."""
        if tokens <= 0 or seconds < 0:
            return
        transfer = tokens * self.bytes_per_token * self._per_byte().value
        self._read_fixed.observe(max(0.0, seconds - transfer))

    # Reporting.

    def snapshot(self) -> dict[str, Any]:
        """Every parameter in the config's units: in use, its source, the calibration."""
        fixed = self._read_fixed.value
        per_byte = self._read_s_per_byte.value
        per_unit = self._compute_s_per_unit.value
        return {
            "read_fixed_ms": _describe(self._fixed(), 1e3,
                                       None if fixed is None else fixed * 1e3,
                                       self._read_fixed.samples),
            "read_gbps": _describe(_inverse(self._per_byte(), 1e-9), 1.0,
                                   None if per_byte is None else 1e-9 / per_byte,
                                   self._read_s_per_byte.samples),
            "compute_tokens_per_s": _describe(_inverse(self._per_unit(), 1.0), 1.0,
                                              None if per_unit is None else 1.0 / per_unit,
                                              self._compute_s_per_unit.samples),
            "compute_attention_tokens": self.attention_tokens,
            "kv_bytes_per_token": self.bytes_per_token,
        }

    def gauges(self) -> tuple[float, float, float]:
        """In use now: fixed read cost (s), read bandwidth (bytes/s), compute (tokens/s)."""
        return (self._fixed().value, 1.0 / self._per_byte().value, 1.0 / self._per_unit().value)


def _pick(configured: float | None, scale: float, calibrated: float | None,
          default: float) -> _Param:
    if configured is not None:
        return _Param(configured * scale, CostSource.CONFIGURED)
    if calibrated is not None:
        return _Param(calibrated, CostSource.CALIBRATED)
    return _Param(default, CostSource.DEFAULT)


def _inverse(param: _Param, scale: float) -> _Param:
    return _Param(scale / param.value, param.source)


def _describe(param: _Param, scale: float, calibrated: float | None,
              samples: int) -> dict[str, Any]:
    return {"value": param.value * scale, "source": param.source.value,
            "calibrated": calibrated, "samples": samples}
