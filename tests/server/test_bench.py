"""The reuse benchmark's outputs: the JSON the issue specifies, and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from kvturn_server.bench import SizeResult, bench_config, write_json, write_plot

RESULTS = [SizeResult(2048, 330.0, 80.0, 53.0, 2048.0, 97.0),
           SizeResult(16384, 4139.0, 180.0, 157.0, 16384.0, 97.0)]


def test_json_has_one_entry_per_size_with_the_specified_keys(tmp_path: Path) -> None:
    path = tmp_path / "out" / "reuse.json"
    write_json(RESULTS, path, runs=5)
    data = json.loads(path.read_text())
    assert data["runs_per_size"] == 5
    assert [s["tokens"] for s in data["sizes"]] == [2048, 16384]
    assert set(data["sizes"][0]) == {"tokens", "ttft_recompute_ms", "ttft_reuse_ms",
                                     "ttft_local_hit_ms", "reused_tokens", "computed_tokens"}


def test_ratios() -> None:
    assert round(RESULTS[1].speedup, 1) == 23.0
    assert round(RESULTS[1].reuse_over_local, 2) == 1.15


def test_plot_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "reuse.png"
    assert write_plot(RESULTS, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_benchmark_stack_reuses_on_the_bench_model(tmp_path: Path) -> None:
    cfg = bench_config(tmp_path, {"router_port": 9000})
    assert cfg.model_size == "bench" and cfg.max_model_len >= 16384 + 1024
    assert not cfg.prefill_prefix_caching and cfg.with_reference
    assert cfg.router_port == 9000
