"""The statistics every benchmark reports with (and ``kvturn simulate``): one quantile
definition, a distribution's summary, ratios and their bootstrap intervals, the turn summary of
both agent benchmarks, and how a missing value prints."""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any, Protocol

MIB = 1024 * 1024


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``: the one definition every benchmark (and
    ``kvturn simulate``) reports with. The stdlib's ``statistics.quantiles(method="inclusive")``:
    linear interpolation between order statistics, numpy's default; ``q`` is taken as the
    nearest fraction with a denominator up to 10 000 (0.99 is 99/100). Raises ValueError for
    no values or ``q`` outside [0, 1]."""
    data = [float(v) for v in values]
    if not data:
        raise ValueError("no values")
    if not 0 <= q <= 1:
        raise ValueError(f"q must be within [0, 1], got {q}")
    cut = Fraction(q).limit_denominator(10_000)
    if len(data) == 1 or cut.numerator == 0:
        return min(data)
    if cut == 1:
        return max(data)
    return statistics.quantiles(data, n=cut.denominator, method="inclusive")[cut.numerator - 1]


def percentile(values: Iterable[float], q: float) -> float | None:
    """``quantile``, but None for no values (a summary of nothing)."""
    data = list(values)
    return quantile(data, q) if data else None


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    return {"n": len(values), "p50": rounded(percentile(values, 0.5)),
            "p90": rounded(percentile(values, 0.9)), "p99": rounded(percentile(values, 0.99)),
            "mean": rounded(statistics.fmean(values)) if values else None,
            "max": rounded(max(values)) if values else None}


def cdf_points(values: Sequence[float]) -> list[float | None]:
    """The 0th..100th percentiles: enough to draw a distribution without every value."""
    return [rounded(percentile(values, i / 100)) for i in range(101)]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def spread(values: Sequence[float | int | None]) -> dict[str, Any]:
    """min, median and max of the measured values (None: not measured), and all of them."""
    present = [v for v in values if v is not None]
    return {"min": min(present) if present else None,
            "median": rounded(statistics.median(present), 4) if present else None,
            "max": max(present) if present else None, "per_repeat": list(values)}


_DROP = object()


def median_tree(values: Sequence[Any]) -> Any:
    """The median over repeats of a summary, leaf by leaf: numbers become their median,
    dicts are merged key by key (a key missing from a repeat counts 0 where the dict holds
    only numbers, as a counter does, else it is left out), equal other values stay, differing
    ones (lists of load averages, say) are dropped; None values are left out."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, dict) for v in present):
        counter = all(_is_number(x) for v in present for x in v.values())
        keys = list(dict.fromkeys(k for v in present for k in v))
        merged = {}
        for key in keys:
            value = median_tree([v.get(key, 0 if counter else None) for v in present])
            if value is not _DROP:
                merged[key] = value
        return merged
    if all(_is_number(v) for v in present):
        median = statistics.median(present)
        return median if isinstance(median, int) else round(median, 4)
    if all(v == present[0] for v in present):
        return present[0]
    return _DROP


def at_path(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    """The value at ``path`` (keys, outermost first) of nested dicts; None where it is missing."""
    value: Any = tree
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def ratio(a: float | int | None, b: float | int | None) -> float | None:
    """``a / b`` to three decimals; None where either is missing or ``b`` is 0."""
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def lowest(values: dict[str, float | None]) -> str | None:
    """The key of the lowest measured value (the first of equal ones); None where nothing was
    measured."""
    measured = [(v, k) for k, v in values.items() if v is not None]
    return min(measured, key=lambda pair: pair[0])[1] if measured else None


def fmt(value: float | int | None, spec: str = ".0f") -> str:
    """``value`` formatted, or ``-`` where it was not measured."""
    return "-" if value is None else format(value, spec)


class Turn(Protocol):
    """What a turn summary reads of a turn record (both benchmarks' records have it)."""

    @property
    def ok(self) -> bool: ...

    @property
    def turn(self) -> int: ...

    @property
    def ttft_ms(self) -> float | None: ...


def turn_summary(records: Sequence[Turn], wall_s: float) -> dict[str, Any]:
    """A run's turns that succeeded and failed, its wall time, turns per second, and the TTFT
    of every turn, of first turns (a new conversation: nothing to reuse, the same work in
    every mode) and of turns 2+ (the ones that can reuse a previous turn's KV)."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    first = [r.ttft_ms for r in ok if r.ttft_ms is not None and r.turn == 1]
    later = [r.ttft_ms for r in ok if r.ttft_ms is not None and r.turn > 1]
    return {"turns_ok": len(ok), "errors": len(records) - len(ok), "wall_s": round(wall_s, 3),
            "turns_per_s": round(len(ok) / wall_s, 4) if wall_s > 0 else None,
            "ttft_ms": distribution(ttft), "ttft_ms_turn1": distribution(first),
            "ttft_ms_turn2plus": distribution(later)}


def bootstrap_ratio(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], q: float, *,
                    rounds: int = 2000, seed: int = 0) -> tuple[float | None, float | None]:
    """A 95 % percentile-bootstrap interval of ``quantile(a, q) / quantile(b, q)``, each side's
    values grouped by repeat (``a[r]``: repeat r's turns; both sides the same repeats, in the
    same order). Each round resamples the repeats with replacement, the same ones for both
    sides, then the turns of each drawn repeat (a two-stage, clustered bootstrap): turns of one
    run share its timing, so resampling turns alone would take the spread between repeats for
    signal (measured on this host: two identical stock modes differed by 0.83-1.84x between
    repeats, and by 1.38x pooled, while a turn-only interval excluded 1). One repeat gives the
    turn-only interval. Seeded, so a run's JSON is reproducible from its turns; (None, None)
    when either side has no value."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} repeats against {len(b)}")
    if not any(a) or not any(b):
        return None, None
    rng = random.Random(seed)
    repeats = range(len(a))
    ratios = []
    for _ in range(rounds):
        drawn = [rng.choice(repeats) for _ in repeats]
        num = percentile([x for r in drawn for x in rng.choices(a[r], k=len(a[r]))], q)
        den = percentile([x for r in drawn for x in rng.choices(b[r], k=len(b[r]))], q)
        if num is not None and den:
            ratios.append(num / den)
    return rounded(percentile(ratios, 0.025)), rounded(percentile(ratios, 0.975))


STRONGEST_RULE = ("the stock mode with the lowest TTFT p50 of later turns (turns 2+, every "
                  "repeat's turns pooled): the turns a baseline can serve from what it cached")
"""How every agent benchmark picks the stock mode it headlines kvturn against (one rule for
``kvturn bench agent``, ``fleet`` and ``trace``)."""


def strongest(later_ttfts: dict[str, Sequence[float]]) -> tuple[str | None,
                                                                 dict[str, float | None]]:
    """``STRONGEST_RULE`` over each stock mode's later-turn TTFTs (ms, every repeat pooled; a
    mode with none is reported unmeasured): the strongest mode (None: none measured) and every
    mode's pooled p50."""
    p50 = {mode: rounded(percentile(values, 0.5)) for mode, values in later_ttfts.items()}
    return lowest(p50), p50
