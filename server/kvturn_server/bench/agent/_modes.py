"""``kvturn bench agent``'s modes, one data table: each mode's router flags, what its client
sends, the peer configuration it stands for and where that configuration is documented.

Every mode runs through a router of its own, started for its run, on the instances of its
profile (``bench/_profiles.py``): ``plain`` (the kvturn connector alone) or ``offload`` (the same
beside vLLM's CPU KV offloading, a host tier on each instance); one prefill and one decode per
profile that ran, kept up side by side. The stock modes are what a user who knows the field
would run instead of kvturn (the survey is ``notes/baselines.md`` of the project's shared
notes): plain P/D, and conditional disaggregation as llm-d and NVIDIA Dynamo ship it, where a
follow-up turn whose uncached part is short runs on the decode alone and finds its history in
that decode's plain (LRU) prefix cache, and the same with vLLM's CPU offloading keeping evicted
history in host memory. Each kvturn mode
(``on``, and ``kvturn-offload`` on the offload instances) is compared with each stock mode that
ran, and headlined against the strongest.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvturn_server.bench._profiles import HOST_TIER as HOST_TIER_PROFILE
from kvturn_server.bench._profiles import HOST_TIER_PEERS, HOST_TIER_SOURCES
from kvturn_server.bench._profiles import OFFLOAD as OFFLOAD_PROFILE
from kvturn_server.bench._profiles import PLAIN as PLAIN_PROFILE
from kvturn_server.bench.agent._kinds import IDS, KVTURN, PLAIN

# llm-d's prefix-based-pd-decider at the nonCachedTokens its docs use (8 or 512): stock-cond.
LLMD_CONDITIONAL_TOKENS = 512
# NVIDIA Dynamo's isl_bounding default (docs/components/router/router-disaggregated-serving.md).
DYNAMO_CONDITIONAL_TOKENS = 2048


@dataclass(frozen=True)
class AgentMode:
    """One way to run the agents.

    ``name``: what ``--modes`` takes and the JSON keys by; ``label``: the benchmarks' shared
    name for the setup (``stock-pd``, ``stock-cond``, ``stock-cond-2k``, ``stock-cond-offload``,
    ``kvturn``, ``kvturn-offload``); ``client``: one of ``_loop``'s client kinds (``plain`` sends
    no conversation id, ``ids`` sends ``X-Conversation-ID`` and nothing else, ``kvturn`` is an
    SDK conversation paused during tool gaps and released at the end); ``profile``: the
    instances it runs on (``bench/_profiles.py``: ``plain`` or ``offload``)."""

    name: str
    label: str
    router_args: tuple[str, ...]
    client: str
    stands_for: str
    sources: tuple[str, ...]
    profile: str = PLAIN_PROFILE

    @property
    def kvturn(self) -> bool:
        return self.client == KVTURN

    @property
    def title(self) -> str:
        """The name, with the shared label where it differs (``off (stock-pd)``)."""
        return titled(self.name, self.label)

    def describe(self, extra_router_args: tuple[str, ...] = ()) -> dict[str, object]:
        """The mode as the JSON's mode table states it (``extra_router_args``: ``--router-arg``
        values, which every mode's router gets)."""
        return {"mode": self.name, "label": self.label,
                "router_args": [*self.router_args, *extra_router_args], "client": self.client,
                "profile": self.profile, "stands_for": self.stands_for,
                "sources": list(self.sources)}


def titled(name: str, label: str | None) -> str:
    return name if label in (None, name) else f"{name} ({label})"


_STOCK_COND_ARGS = ("--no-kv-reuse", "--conditional-disagg", str(LLMD_CONDITIONAL_TOKENS))
_STOCK_COND_SOURCES = (
    "llm-d-router pkg/epp/framework/plugins/scheduling/profilehandler/disagg/"
    "prefix_based_pd_decider.go (nonCachedTokens; PRs #2560, #1288, #2335)",
    "NVIDIA Dynamo --router-conditional-disagg (isl_bounding)")
_KVTURN = (
    "kvturn: every agent a kvturn SDK conversation, its lease renewed through tool gaps and "
    "released at the end; the router continues a short follow-up on the decode that retains "
    "the conversation, and otherwise a prefill reads the retained history from that decode")
_STOCK_COND = (
    "stock conditional disaggregation: a follow-up whose new messages are estimated at most "
    "{n} tokens runs on the decode that served the conversation, alone (no prefill leg, no "
    "transfer), where the decode's plain prefix cache (LRU, nothing held through tool gaps) "
    "supplies whatever history it still has; any other turn is stock P/D; the router knows "
    "only what it sent and relayed; the client sends X-Conversation-ID only")

MODE_TABLE: tuple[AgentMode, ...] = (
    AgentMode(
        "off", "stock-pd", ("--no-kv-reuse",), PLAIN,
        "stock P/D: every turn a prefill leg, then a decode leg that reads the prompt's KV "
        "from the prefill; no conversation ids; prefix caching on both instances (vLLM's "
        "default)",
        ("vLLM examples/online_serving/disaggregated_serving/disagg_proxy_multiturn.py "
         "(prefill then decode for every request)",
         "llm-d's published P/D guides (always-disagg-pd-decider)")),
    AgentMode(
        "stock-cond", "stock-cond", _STOCK_COND_ARGS, IDS,
        _STOCK_COND.format(n=LLMD_CONDITIONAL_TOKENS) + " (llm-d's prefix-based-pd-decider "
        f"with nonCachedTokens {LLMD_CONDITIONAL_TOKENS}, the value its docs use, "
        "and the approximate prefix index)", _STOCK_COND_SOURCES),
    AgentMode(
        "stock-cond-2k", "stock-cond-2k",
        ("--no-kv-reuse", "--conditional-disagg", str(DYNAMO_CONDITIONAL_TOKENS)), IDS,
        _STOCK_COND.format(n=DYNAMO_CONDITIONAL_TOKENS) + " (NVIDIA Dynamo's "
        "--router-conditional-disagg, isl_bounding policy at its default 2,048 tokens)",
        ("NVIDIA Dynamo docs/components/router/router-disaggregated-serving.md "
         "(PRs #11718, #11719, #11723, #11725)",)),
    AgentMode(
        "stock-cond-offload", "stock-cond-offload", _STOCK_COND_ARGS, IDS,
        "stock-cond on instances with " + HOST_TIER_PEERS
        + "; a follow-up the decode serves alone loads from its host tier whatever its device "
        "cache lost (llm-d's prefix-based-pd-decider beside its CPU offloading tier)",
        (*_STOCK_COND_SOURCES, *HOST_TIER_SOURCES), OFFLOAD_PROFILE),
    AgentMode("on", "kvturn", (), KVTURN, _KVTURN, ("docs/http-api.md B, Placement",)),
    AgentMode(
        "kvturn-offload", "kvturn-offload", (), KVTURN,
        _KVTURN + ", with its host tier (the same size as stock-cond-offload's, on instances of "
        "its own): an evicted retention keeps its lease in host memory, evicted there in the "
        "leases' order, and the decode loads it back for the next turn",
        ("docs/http-api.md B, Placement", "docs/connector.md \"The host tier\""),
        HOST_TIER_PROFILE),
)
MODES_BY_NAME: dict[str, AgentMode] = {m.name: m for m in MODE_TABLE}
MODES = tuple(MODES_BY_NAME)
"""Every mode's name, in the table's order."""
DEFAULT_MODES = ("off", "stock-cond", "on")
"""What runs unless ``--modes`` says otherwise (``stock-cond-2k`` and the offload modes on
request: these start a second prefill and decode)."""
STOCK_MODES = tuple(m.name for m in MODE_TABLE if not m.kvturn)
KVTURN_MODES = tuple(m.name for m in MODE_TABLE if m.kvturn)
KVTURN_MODE = "on"
"""The kvturn mode the JSON's ``comparisons`` and ``comparison`` have always been about."""
