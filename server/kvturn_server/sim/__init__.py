"""A trace-driven fleet simulator that runs kvturn's own retention, reuse and placement code.

``kvturn simulate`` is its command line; ``docs/simulate.md`` says what it models.
"""

from kvturn_server.sim._cli import add_simulate_parser
from kvturn_server.sim._config import (
    PROFILES,
    THIS_MACHINE,
    CostProfile,
    FleetSpec,
    Policy,
    RouterSpec,
    SimSettings,
    standard_policies,
)
from kvturn_server.sim._engine import Simulation, simulate
from kvturn_server.sim._metrics import GAP_BUCKETS, Recorder
from kvturn_server.sim._report import compare, sweep
from kvturn_server.sim._workload import (
    Conversation,
    WorkloadSpec,
    from_agent_bench,
    load_trace,
    synthetic,
)

__all__ = [
    "GAP_BUCKETS",
    "PROFILES",
    "THIS_MACHINE",
    "Conversation",
    "CostProfile",
    "FleetSpec",
    "Policy",
    "Recorder",
    "RouterSpec",
    "SimSettings",
    "Simulation",
    "WorkloadSpec",
    "add_simulate_parser",
    "compare",
    "from_agent_bench",
    "load_trace",
    "simulate",
    "standard_policies",
    "sweep",
    "synthetic",
]
