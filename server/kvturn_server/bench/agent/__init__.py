"""``kvturn bench agent``: concurrent tool-using agents through a router, in every mode of the
mode table: stock P/D ("off"), stock conditional disaggregation ("stock-cond" at kvturn's own
threshold, "stock-cond-2k" at Dynamo's, "stock-cond-offload" with vLLM's CPU offloading) and
kvturn conversations ("on", and "kvturn-offload" on the offloading instances).

The modules, in the order a run goes through them: ``_modes`` (the mode table: router flags,
client, what each mode stands for), ``_workload`` (settings, tool gaps, the agents' scripts),
``_loop`` (one agent's turns as one kind of client; shared with ``kvturn bench fleet``),
``_run`` (the instances of each profile, a router per run, the modes, the repeats),
``_records`` (what a run records), ``_summary`` (summaries, comparisons with every stock mode,
verdicts), ``_results`` (the headline against the strongest, the JSON document), ``_report``
(the table), ``_plot`` (the PNG), ``_cli`` (the command line)."""

from kvturn_server.bench.agent._cli import (
    add_agent_bench_parser,
    cmd_bench_agent,
    settings_from_args,
)
from kvturn_server.bench.agent._modes import (
    DEFAULT_MODES,
    KVTURN_MODES,
    MODE_TABLE,
    MODES,
    MODES_BY_NAME,
    STOCK_MODES,
    AgentMode,
)
from kvturn_server.bench.agent._plot import write_plot
from kvturn_server.bench.agent._records import AgentOutcome, ModeRun, Sample, TurnRecord
from kvturn_server.bench.agent._report import table
from kvturn_server.bench.agent._results import build_results, headline, strongest_stock
from kvturn_server.bench.agent._run import (
    Connect,
    FleetRouters,
    HttpProbe,
    Probe,
    Sampler,
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
    compare,
    decode_turns,
    never_slower_checks,
    pooled_comparison,
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
    agent_fleet_config,
    agent_shape,
    build_scripts,
    instance_profiles,
    mode_order,
)

__all__ = ["DEFAULT_MODES", "FRAMING_TOKENS", "KVTURN_MODES", "MIN_RETENTION_TTL_S", "MODES",
           "MODES_BY_NAME", "MODE_TABLE", "STOCK_MODES", "TRACE_KEEPALIVE_PER_TTL",
           "TRACE_RETENTION_TTL_S", "AgentBenchSettings", "AgentMode", "AgentOutcome",
           "AgentScript", "Connect", "FleetRouters", "GapDistribution", "HistoryCut", "HttpProbe",
           "Message", "ModeRun", "Probe", "Sample", "Sampler", "TurnRecord",
           "add_agent_bench_parser", "against", "agent_fleet_config", "agent_shape",
           "aggregate_comparison", "build_results", "build_scripts", "cmd_bench_agent", "compare",
           "decode_turns", "headline", "instance_profiles", "measure", "mode_order",
           "never_slower_checks", "pooled_comparison", "router_args", "run_agent",
           "run_agent_bench", "run_mode", "settings_from_args", "strongest_stock", "summarize",
           "table", "tail_makeup", "verdict", "warm_up", "write_plot"]
