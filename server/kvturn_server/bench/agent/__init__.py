"""``kvturn bench agent``: concurrent tool-using agents through a router, in every mode of the
mode table: stock P/D ("off"), stock conditional disaggregation ("stock-cond" at kvturn's own
threshold, "stock-cond-2k" at Dynamo's) and kvturn conversations ("on").

The modules, in the order a run goes through them: ``_modes`` (the mode table: router flags,
client, what each mode stands for), ``_workload`` (settings, tool gaps, the agents' scripts),
``_loop`` (one agent's turns as one kind of client; shared with ``kvturn bench fleet``),
``_run`` (the instances, a router per run, the modes, the repeats), ``_records`` (what a run
records), ``_summary`` (summaries, comparisons with every stock mode, verdicts, the headline,
the JSON document), ``_report`` (the table), ``_plot`` (the PNG), ``_cli`` (the command line)."""

from kvturn_server.bench.agent._cli import (
    add_agent_bench_parser,
    cmd_bench_agent,
    settings_from_args,
)
from kvturn_server.bench.agent._modes import (
    DEFAULT_MODES,
    MODE_TABLE,
    MODES,
    MODES_BY_NAME,
    STOCK_MODES,
    AgentMode,
)
from kvturn_server.bench.agent._plot import write_plot
from kvturn_server.bench.agent._records import AgentOutcome, ModeRun, Sample, TurnRecord
from kvturn_server.bench.agent._report import table
from kvturn_server.bench.agent._run import (
    Connect,
    FleetRouters,
    HttpProbe,
    Probe,
    Sampler,
    agent_fleet_config,
    measure,
    router_args,
    run_agent,
    run_agent_bench,
    run_mode,
    warm_up,
)
from kvturn_server.bench.agent._summary import (
    against,
    aggregate_comparison,
    build_results,
    compare,
    decode_turns,
    headline,
    never_slower_checks,
    pooled_comparison,
    strongest_stock,
    summarize,
    tail_makeup,
    verdict,
)
from kvturn_server.bench.agent._workload import (
    FRAMING_TOKENS,
    MIN_RETENTION_TTL_S,
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

__all__ = ["DEFAULT_MODES", "FRAMING_TOKENS", "MIN_RETENTION_TTL_S", "MODES", "MODES_BY_NAME",
           "MODE_TABLE", "STOCK_MODES", "TRACE_KEEPALIVE_PER_TTL", "TRACE_RETENTION_TTL_S",
           "AgentBenchSettings", "AgentMode", "AgentOutcome", "AgentScript", "Connect",
           "FleetRouters", "GapDistribution", "HistoryCut", "HttpProbe", "Message", "ModeRun",
           "Probe", "Sample", "Sampler", "TurnRecord", "add_agent_bench_parser", "against",
           "agent_fleet_config", "aggregate_comparison", "build_results", "build_scripts",
           "cmd_bench_agent", "compare", "decode_turns", "headline", "measure", "mode_order",
           "never_slower_checks", "pooled_comparison", "router_args", "run_agent",
           "run_agent_bench", "run_mode", "settings_from_args", "strongest_stock", "summarize",
           "table", "tail_makeup", "verdict", "warm_up", "write_plot"]
