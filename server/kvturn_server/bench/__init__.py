"""kvturn's benchmarks: each prints its numbers and writes them as JSON (and a plot).

``quantile`` (and ``percentile``, the same but None for no values) is the one quantile
definition every benchmark and ``kvturn simulate`` reports with.
"""

from kvturn_server.bench._fleet import add_fleet_bench_parser, run_fleet_bench
from kvturn_server.bench._fleet_plan import FleetBenchSettings
from kvturn_server.bench._reuse import ReuseBenchSettings, bench_config, run_reuse_bench
from kvturn_server.bench._reuse_cli import add_reuse_bench_parser
from kvturn_server.bench._router import (
    RouterBenchSettings,
    add_router_bench_parser,
    run_router_bench,
)
from kvturn_server.bench._sdk_run import add_sdk_bench_parser, run_sdk_bench
from kvturn_server.bench._stats import percentile, quantile
from kvturn_server.bench.agent import (
    AgentBenchSettings,
    add_agent_bench_parser,
    run_agent_bench,
)

__all__ = ["AgentBenchSettings", "FleetBenchSettings", "ReuseBenchSettings",
           "RouterBenchSettings", "add_agent_bench_parser", "add_fleet_bench_parser",
           "add_reuse_bench_parser", "add_router_bench_parser", "add_sdk_bench_parser",
           "bench_config", "percentile", "quantile", "run_agent_bench", "run_fleet_bench",
           "run_reuse_bench", "run_router_bench", "run_sdk_bench"]
