"""What the two agent benchmarks' commands (``kvturn bench agent``, ``kvturn bench fleet``)
share: their argument parsers, the ``--json`` and ``--plot`` options, the client they measure
through, and the line that says what they wrote."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import kvturn


def token_range(text: str) -> tuple[int, int]:
    """``MIN,MAX`` (or one number for both) as a pair of token counts."""
    try:
        low, _, high = text.partition(",")
        return int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX token counts, got {text!r}") from None


def comma_choices(known: Collection[str], what: str) -> Callable[[str], tuple[str, ...]]:
    """A parser of a comma list of distinct values of ``known`` (``what`` they are, for the
    error)."""
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        if not values or any(v not in known for v in values) or len(set(values)) != len(
                values):
            raise argparse.ArgumentTypeError(
                f"expected a comma list of distinct {what} ({', '.join(known)}), got {text!r}")
        return values
    return parse


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, help="where to write the results")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG path (default: the JSON path with .png)")


def bench_client(url: str, timeout_s: float, max_retries: int) -> kvturn.AsyncOpenAI:
    """The client the agents send through: the router at ``url``, one HTTP pool for all."""
    import httpx2

    import kvturn

    http = httpx2.AsyncClient(timeout=timeout_s)
    return kvturn.AsyncOpenAI(base_url=f"{url}/v1", api_key="kvturn-bench",
                              max_retries=max_retries, timeout=timeout_s, http_client=http)


def write_plot_and_say(results: dict[str, Any], json_path: Path, plot_path: Path | None,
                       write_plot: Callable[[dict[str, Any], Path], bool],
                       say: Callable[[str], None]) -> None:
    """Draw the plot next to the JSON (already written) unless ``plot_path`` says where; say
    what was written."""
    plot = plot_path or json_path.with_suffix(".png")
    if write_plot(results, plot):
        say(f"wrote {json_path} and {plot}")
    else:
        say(f"wrote {json_path}; no plot: matplotlib is not installed (extra [bench])")
