"""What the agent benchmarks' commands (``kvturn bench agent``, ``fleet``, ``trace``) share: the
options of their agents, the offload modes' host tier, the client they measure through, and the
table, plot and line that follow the JSON. (What every measuring command shares is in
``kvturn_server._cli_common``.)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvturn_server._cli_common import add_output_args, plot_path, say_written
from kvturn_server._defaults import KEEPALIVES_PER_TTL, RETENTION_TTL

if TYPE_CHECKING:
    import kvturn
    from kvturn_server.bench._fleet_plan import FleetBenchSettings
    from kvturn_server.bench.agent._workload import AgentBenchSettings


def add_agents_args(p: argparse.ArgumentParser, d: AgentBenchSettings | FleetBenchSettings,
                    *, seeded: str, state: str) -> None:
    """``--json``, ``--plot``, ``--agents``, ``--time-scale``, ``--seed``, ``--stagger``,
    ``--size``, ``--state-dir`` and ``--retention-ttl``, their defaults from ``d``; ``seeded``:
    what the seed draws, ``state``: what the state directory holds."""
    from kvturn_server.local import SIZES

    add_output_args(p)

    p.add_argument("--agents", type=int, default=d.agents,
                   help="concurrent agents (default: %(default)s)")
    p.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="factor on the traces' tool gaps (p50 2 s, p90 24 s) and on the "
                        f"{RETENTION_TTL:g} s lease; 0.1 gives gaps of p50 0.2 s (default: "
                        "%(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"seed of {seeded} (default: %(default)s)")
    p.add_argument("--stagger", type=float, default=d.stagger_s,
                   help="seconds between two agents' starts (default: %(default)s)")
    p.add_argument("--size", choices=sorted(SIZES), default=d.size,
                   help="model (default: %(default)s)")
    p.add_argument("--state-dir", type=Path, default=d.state_dir,
                   help=f"{state} (default: %(default)s)")
    p.add_argument("--retention-ttl", type=float, default=None,
                   help=f"the decodes' lease in seconds (default: {RETENTION_TTL:g} x "
                        "--time-scale, at least 30); the SDK renews every "
                        f"1/{KEEPALIVES_PER_TTL} of it during a tool gap")


def add_host_tier_arg(p: argparse.ArgumentParser, default: float) -> None:
    """``--host-tier``: the offload modes' host tier, a multiple of each instance's KV."""
    p.add_argument("--host-tier", type=float, default=default, metavar="X",
                   help="the offload modes' host tier on each of their instances (vLLM's CPU "
                        "offloading, replies stored too): X times that instance's device KV. "
                        "The default stands for an H200 with ~70 GB of KV beside llm-d's "
                        "100-150 GiB of CPU tier per rank (default: %(default)s)")


def bench_client(url: str, timeout_s: float, max_retries: int) -> kvturn.AsyncOpenAI:
    """The client the agents send through: the router at ``url``, one HTTP pool for all."""
    import httpx2

    import kvturn

    http = httpx2.AsyncClient(timeout=timeout_s)
    return kvturn.AsyncOpenAI(base_url=f"{url}/v1", api_key="kvturn-bench",
                              max_retries=max_retries, timeout=timeout_s, http_client=http)


def say_results(results: dict[str, Any], table: Callable[[dict[str, Any]], str],
                json_path: Path | None, plot: Path | None,
                write_plot: Callable[[dict[str, Any], Path], bool],
                say: Callable[[str], None]) -> None:
    """Say the table; where the JSON was written (``json_path``), draw the plot next to it
    unless ``plot`` says where, and say what was written."""
    say(table(results))
    if json_path is not None:
        path = plot_path(json_path, plot)
        say_written(json_path, path, write_plot(results, path), say)
