"""kvturn's benchmarks: each prints its numbers and writes them as JSON (and a plot)."""

from kvturn_server.bench._reuse import (
    SizeResult,
    bench_config,
    run_reuse_bench,
    write_json,
    write_plot,
)

__all__ = ["SizeResult", "bench_config", "run_reuse_bench", "write_json", "write_plot"]
