"""What kvturn's commands that measure (``kvturn bench ...``, ``kvturn simulate``) share: the
argument types of their lists and ranges, the ``--json`` and ``--plot`` options (and the
``--gpu`` and ``--vllm-arg`` of those that start vLLM), writing the JSON, saying what was
written, and turning a bad setting into one line.

A leaf module (standard library only): every benchmark and the simulator import it, and it
imports none of them."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
N = TypeVar("N", int, float)


def int_range(text: str) -> tuple[int, int]:
    """``MIN,MAX`` (or one number for both) as a pair of integers."""
    try:
        low, _, high = text.partition(",")
        return int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}") from None


def number_list(kind: Callable[[str], N], *, empty: bool = False
                ) -> Callable[[str], tuple[N, ...]]:
    """A parser of a comma list of ``kind`` numbers; an empty list only where ``empty``."""
    def parse(text: str) -> tuple[N, ...]:
        try:
            values = tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected numbers separated by commas, got {text!r}") from None
        if not values and not empty:
            raise argparse.ArgumentTypeError("at least one value is needed")
        return values
    return parse


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


def add_output_args(p: Any, *, json_default: Path | None = None, plot: bool = True) -> None:
    """``--json`` (required unless ``json_default``) and, where ``plot``, ``--plot``."""
    if json_default is None:
        p.add_argument("--json", type=Path, required=True, help="where to write the results")
    else:
        p.add_argument("--json", type=Path, default=json_default,
                       help="results (default: %(default)s)")
    if plot:
        p.add_argument("--plot", type=Path, default=None,
                       help="PNG path (default: the JSON path with .png)")


def add_device_args(p: Any, *, instances: str, example: str) -> None:
    """``--gpu`` and ``--vllm-arg``, for a benchmark that starts its own vLLM instances:
    ``instances`` says which of them a ``--vllm-arg`` goes to, ``example`` is its e.g."""
    p.add_argument("--gpu", action="store_true",
                   help="run on a GPU: KV in its memory (vLLM's default) instead of the CPU "
                        "build's host buffer")
    p.add_argument("--vllm-arg", action="append", default=None, metavar="FLAG",
                   help=f"another vllm serve flag for {instances}, as one argument "
                        f"(repeatable), e.g. --vllm-arg={example}")


def write_json(results: dict[str, Any], path: Path, *, indent: int = 2) -> None:
    """``results`` as JSON at ``path`` (its folder made); values JSON lacks (paths) as text."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=indent, default=str) + "\n", encoding="utf-8")


def plot_path(json_path: Path, plot: Path | None) -> Path:
    """Where the plot goes: ``plot``, else next to the JSON."""
    return plot or json_path.with_suffix(".png")


def say_written(json_path: Path, plot: Path, plotted: bool,
                say: Callable[[str], None]) -> None:
    if plotted:
        say(f"wrote {json_path} and {plot}")
    else:
        say(f"wrote {json_path}; no plot: matplotlib is not installed (extra [bench])")


def settings_or_exit(command: str, build: Callable[[], T]) -> T:
    """``build()``, or exit with ``kvturn <command>: <why>`` where a setting cannot run."""
    try:
        return build()
    except (ValueError, argparse.ArgumentTypeError) as error:
        raise SystemExit(f"kvturn {command}: {error}") from None
