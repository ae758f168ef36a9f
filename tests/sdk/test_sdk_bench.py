"""``kvturn bench sdk``: the JSON it writes and its CLI registration (timings are not asserted)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvturn_server.bench._sdk import add_sdk_bench_parser, run_sdk_bench


def test_a_tiny_run_writes_every_mode(tmp_path: Path) -> None:
    lines: list[str] = []
    path = tmp_path / "out" / "sdk.json"
    data = run_sdk_bench(3, path, say=lines.append)
    assert json.loads(path.read_text()) == data
    assert data["calls_per_mode"] == 3 and data["target_us"] == 50.0
    assert [(m["mode"], m["stream"]) for m in data["modes"]] == [
        ("sync", False), ("sync", True), ("async", False), ("async", True)]
    for mode in data["modes"]:
        assert set(mode) == {"mode", "stream", "plain_us", "kvturn_us", "overhead_us", "own_us",
                             "overhead_pct", "extra_bytecodes"}
        assert mode["plain_us"] > 0 and mode["kvturn_us"] > 0 and mode["own_us"] > 0
        # kvturn's hooks run on every call: a kvturn call executes more instructions
        assert mode["extra_bytecodes"] > 0
    assert isinstance(data["within_target"], bool)
    assert data["machine"]["cpus"] >= 1 and len(data["machine"]["load_average_before"]) == 3
    assert "overhead us" in lines[0]


def test_the_parser_registers_sdk(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="kvturn")
    bench = parser.add_subparsers(dest="command").add_parser("bench")
    add_sdk_bench_parser(bench.add_subparsers(dest="bench_command"))
    args = parser.parse_args(["bench", "sdk", "--calls", "7", "--json", str(tmp_path / "x.json")])
    assert args.calls == 7 and args.json == tmp_path / "x.json" and callable(args.func)
    assert parser.parse_args(["bench", "sdk"]).json == Path(".kvturn/bench/sdk.json")
