"""A trace-driven fleet simulator that runs kvturn's own retention, reuse and placement code.

``kvturn simulate`` is its command line; ``docs/simulate.md`` says what it models.
"""

from kvturn_server.sim._cli import add_simulate_parser
from kvturn_server.sim._config import (
    PROFILES,
    QWEN3_32B_H100,
    QWEN3_32B_H200,
    THIS_MACHINE,
    CostProfile,
    FleetSpec,
    Policy,
    RouterSpec,
    SimSettings,
    roofline_profile,
    standard_policies,
)
from kvturn_server.sim._engine import Simulation, simulate
from kvturn_server.sim._metrics import GAP_BUCKETS, Recorder
from kvturn_server.sim._report import compare, sweep
from kvturn_server.sim._roofline import (
    CHECKS,
    H100_SXM,
    H200,
    QWEN3_32B,
    Accelerator,
    Check,
    Efficiency,
    ModelShape,
    itl_seconds,
    prefill_seconds,
)
from kvturn_server.sim._traces import from_traces, load_conversations, replicate
from kvturn_server.sim._workload import (
    Conversation,
    WorkloadSpec,
    from_agent_bench,
    load_trace,
    synthetic,
)

__all__ = [
    "CHECKS",
    "GAP_BUCKETS",
    "H100_SXM",
    "H200",
    "PROFILES",
    "QWEN3_32B",
    "QWEN3_32B_H100",
    "QWEN3_32B_H200",
    "THIS_MACHINE",
    "Accelerator",
    "Check",
    "Conversation",
    "CostProfile",
    "Efficiency",
    "FleetSpec",
    "ModelShape",
    "Policy",
    "Recorder",
    "RouterSpec",
    "SimSettings",
    "Simulation",
    "WorkloadSpec",
    "add_simulate_parser",
    "compare",
    "from_agent_bench",
    "from_traces",
    "itl_seconds",
    "load_conversations",
    "load_trace",
    "prefill_seconds",
    "replicate",
    "roofline_profile",
    "simulate",
    "standard_policies",
    "sweep",
    "synthetic",
]
