"""``kvturn bench trace``: recorded agent traces (``kvturn_server.traces``) replayed on the local
instances at stated scale factors, every routing mode side by side.

The modules, in the order a run goes through them: ``_scale`` (the factors and the plan of every
conversation and request: sizes, cuts, gaps, starts), ``_text`` (the words, from the hash ids),
``_plan`` (the modes, the settings, the instances' KV sizing and the real deployment it stands
for, the order of the runs), ``_run`` (the instances of each profile, the warm-up, the runs),
``_summary`` (per run, per mode, the comparison with the strongest stock mode and every other,
the JSON document), ``_report`` (the table), ``_plot`` (the PNG), ``_cli`` (the command line).
The agents are the agent benchmarks' loop (``bench/agent/_loop.py``) through
``bench/_fleet_agents.run_mode``.
"""

from kvturn_server.bench.trace._cli import add_trace_bench_parser, cmd_bench_trace
from kvturn_server.bench.trace._plan import MODE_TABLE, MODES, TraceBenchSettings
from kvturn_server.bench.trace._run import run_trace_bench
from kvturn_server.bench.trace._scale import (
    ReplayConversation,
    ReplayPlan,
    ReplayRequest,
    Scaling,
    plan_replay,
)

__all__ = ["MODES", "MODE_TABLE", "ReplayConversation", "ReplayPlan", "ReplayRequest",
           "Scaling", "TraceBenchSettings", "add_trace_bench_parser", "cmd_bench_trace",
           "plan_replay", "run_trace_bench"]
