"""``kvturn bench agent``: concurrent tool-using agents through the router, with kvturn
conversations ("on") and without ("off").

The modules, in the order a run goes through them: ``_workload`` (settings, tool gaps, the
agents' scripts), ``_loop`` (one agent's turns as one kind of client; shared with ``kvturn bench
fleet``), ``_run`` (the stack, the modes, the repeats), ``_records`` (what a run records),
``_summary`` (summaries, comparison, verdict, the JSON document), ``_report`` (the table),
``_plot`` (the PNG), ``_cli`` (the command line)."""

from kvturn_server.bench.agent._cli import (
    add_agent_bench_parser,
    cmd_bench_agent,
    settings_from_args,
)
from kvturn_server.bench.agent._plot import write_plot
from kvturn_server.bench.agent._records import AgentOutcome, ModeRun, Sample, TurnRecord
from kvturn_server.bench.agent._report import table
from kvturn_server.bench.agent._run import (
    HttpProbe,
    Probe,
    Sampler,
    agent_stack_config,
    measure,
    run_agent,
    run_agent_bench,
    run_mode,
    warm_up,
)
from kvturn_server.bench.agent._summary import (
    aggregate_comparison,
    build_results,
    compare,
    pooled_comparison,
    summarize,
    tail_makeup,
    verdict,
)
from kvturn_server.bench.agent._workload import (
    FRAMING_TOKENS,
    MIN_RETENTION_TTL_S,
    MODES,
    TRACE_KEEPALIVE_PER_TTL,
    TRACE_RETENTION_TTL_S,
    AgentBenchSettings,
    AgentScript,
    GapDistribution,
    HistoryCut,
    Message,
    build_scripts,
    mode_order,
)

__all__ = ["FRAMING_TOKENS", "MIN_RETENTION_TTL_S", "MODES", "TRACE_KEEPALIVE_PER_TTL",
           "TRACE_RETENTION_TTL_S", "AgentBenchSettings", "AgentOutcome", "AgentScript",
           "GapDistribution", "HistoryCut", "HttpProbe", "Message", "ModeRun", "Probe",
           "Sample", "Sampler",
           "TurnRecord", "add_agent_bench_parser", "agent_stack_config", "aggregate_comparison",
           "build_results", "build_scripts", "cmd_bench_agent", "compare", "measure",
           "mode_order", "pooled_comparison", "run_agent", "run_agent_bench", "run_mode",
           "settings_from_args", "summarize", "table", "tail_makeup", "verdict", "warm_up",
           "write_plot"]
