"""``kvturn bench sdk``: the JSON it writes and its CLI registration (timings are not asserted)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvturn_server.bench._sdk_run import (
    DEFAULT_ROUNDS,
    _round_in_child,
    add_sdk_bench_parser,
    run_sdk_bench,
)


def test_a_tiny_run_writes_every_mode(tmp_path: Path) -> None:
    lines: list[str] = []
    path = tmp_path / "out" / "sdk.json"
    data = run_sdk_bench(3, path, say=lines.append, rounds=1)
    assert json.loads(path.read_text()) == data
    assert data["calls_per_mode"] == 3 and data["target_us"] == 50.0 and data["rounds"] == 1
    assert [(m["mode"], m["stream"]) for m in data["modes"]] == [
        ("sync", False), ("sync", True), ("async", False), ("async", True)]
    for mode in data["modes"]:
        assert set(mode) == {"mode", "stream", "plain_us", "kvturn_us", "overhead_us", "own_us",
                             "overhead_pct", "extra_bytecodes"}
        assert mode["plain_us"] > 0 and mode["kvturn_us"] > 0 and mode["own_us"] > 0
        # kvturn's hooks run on every call: a kvturn call executes more instructions
        assert mode["extra_bytecodes"] > 0
    for mode, spread in zip(data["modes"], data["spread"], strict=True):
        assert spread["rounds_us"] == [mode["overhead_us"]]
        assert spread["overhead_p25_us"] <= spread["overhead_p75_us"]
    assert isinstance(data["within_target"], bool)
    assert data["machine"]["cpus"] >= 1 and len(data["machine"]["load_average_before"]) == 3
    assert "overhead us" in lines[0]


def test_rounds_run_in_fresh_processes_and_report_the_median_and_each(tmp_path: Path) -> None:
    lines: list[str] = []
    data = run_sdk_bench(2, tmp_path / "sdk.json", say=lines.append, rounds=3)
    assert lines[:3] == [f"round {n}/3: 2 calls per mode ..." for n in (1, 2, 3)]
    assert data["rounds"] == 3
    for mode, spread in zip(data["modes"], data["spread"], strict=True):
        assert len(spread["rounds_us"]) == 3
        assert mode["overhead_us"] == round(sorted(spread["rounds_us"])[1], 1)
    assert "median of 3 round(s)" in lines[-1]


def test_a_round_that_fails_says_why(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="calls must be at least 1"):
        run_sdk_bench(0, tmp_path / "sdk.json")
    with pytest.raises(RuntimeError, match="a bench sdk round failed"):
        _round_in_child(-1)


def test_the_parser_registers_sdk(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="kvturn")
    bench = parser.add_subparsers(dest="command").add_parser("bench")
    add_sdk_bench_parser(bench.add_subparsers(dest="bench_command"))
    args = parser.parse_args(["bench", "sdk", "--calls", "7", "--json", str(tmp_path / "x.json")])
    assert args.calls == 7 and args.json == tmp_path / "x.json" and callable(args.func)
    defaults = parser.parse_args(["bench", "sdk"])
    assert defaults.json == Path(".kvturn/bench/sdk.json") and defaults.rounds == DEFAULT_ROUNDS
