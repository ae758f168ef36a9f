"""The demo's per-turn accounting and its comparison (local/_demo_report.py): where each turn's
prompt KV came from, one table row per turn and mode, and each stock mode against kvturn."""

from __future__ import annotations

import re

from kvturn_server.local._demo_report import (
    LEGEND,
    MODES,
    STOCK_ROUTER_ARGS,
    TurnReport,
    format_table,
    summarise,
    summary,
)
from kvturn_server.local._metrics import PromptSources

NONE = PromptSources(0, 0, 0)


def _turn(mode: str, turn: int, prefill: PromptSources, decode: PromptSources,
          ttft: float, reuse: str = "-") -> TurnReport:
    return TurnReport(mode, turn, "search", 5000, ttft, ttft + 50, reuse, prefill, decode)


def test_the_modes_are_the_benchmarks_stock_baselines_and_kvturn() -> None:
    assert [(m.name, m.router, m.client) for m in MODES] == [
        ("stock-pd", "stock", "plain"), ("stock-cond", "stock", "ids"),
        ("kvturn", "kvturn", "kvturn")]
    # The stock router is kvturn bench agent's stock-cond router, at kvturn's own threshold.
    assert STOCK_ROUTER_ARGS == ("--no-kv-reuse", "--conditional-disagg", "512")
    assert "--conditional-disagg 512" in LEGEND


def test_a_turn_the_decode_continued_counts_its_own_cache_and_computation() -> None:
    continued = _turn("stock-cond", 2, NONE, PromptSources(90, 4864, 0), 200)
    assert continued.route == "decode"
    assert continued.from_decode == 4864 and continued.computed == 90
    pd = _turn("kvturn", 3, PromptSources(150, 4608, 256), PromptSources(1, 4864, 150), 300)
    assert pd.route == "prefill"
    assert pd.from_decode == 256 and pd.computed == 151


REPORTS = [
    _turn("stock-pd", 1, PromptSources(4700, 0, 0), PromptSources(1, 0, 4700), 700),
    _turn("stock-pd", 2, PromptSources(300, 4608, 0), PromptSources(1, 4608, 300), 400),
    _turn("stock-pd", 3, PromptSources(200, 4736, 0), PromptSources(1, 4736, 200), 380),
    _turn("stock-cond", 1, PromptSources(4700, 0, 0), PromptSources(1, 0, 4700), 700),
    _turn("stock-cond", 2, NONE, PromptSources(110, 4864, 0), 220),
    _turn("stock-cond", 3, NONE, PromptSources(90, 4992, 0), 180),
    _turn("kvturn", 1, PromptSources(4700, 0, 0), PromptSources(1, 0, 4700), 700, "miss"),
    _turn("kvturn", 2, NONE, PromptSources(100, 4864, 0), 250, "hit"),
    _turn("kvturn", 3, NONE, PromptSources(100, 4992, 0), 150, "hit"),
]


def test_the_table_has_a_row_per_turn_and_mode_in_the_modes_order() -> None:
    lines = format_table(REPORTS).splitlines()
    assert lines[0].split() == ["mode", "turn", "model", "call", "prompt", "TTFT", "ms",
                                "route", "P", "cache", "from", "D", "computed", "reuse"]
    rows = [line.split() for line in lines[2:] if line]
    assert [(r[0], r[1]) for r in rows] == [(r.mode, str(r.turn)) for r in REPORTS]
    assert lines.count("") == 2  # a blank line between modes
    # stock-cond's second turn: on the decode alone, 4,864 tokens from its cache, 110 computed.
    assert rows[4] == ["stock-cond", "2", "search", "5000", "220", "decode", "0", "4864", "110",
                       "-"]
    assert rows[7][-1] == "hit"


def test_the_summary_puts_each_stock_mode_against_kvturn_on_later_turns() -> None:
    rows = {s.mode: s for s in summarise(REPORTS)}
    assert rows["stock-pd"].median_ttft_ms == 390 and rows["stock-pd"].computed == 502
    assert rows["stock-cond"].median_ttft_ms == 200 and rows["stock-cond"].computed == 200
    assert rows["kvturn"].median_ttft_ms == 200 and rows["kvturn"].computed == 200

    lines = summary(REPORTS).splitlines()
    assert lines[0].split()[:2] == ["turns", "2-3"]
    assert lines[1].split() == ["stock-pd", "390", "ms", "502", "1.95x", "2.51x"]
    assert lines[2].split() == ["stock-cond", "200", "ms", "200", "1.00x", "1.00x"]
    assert lines[3].split() == ["kvturn", "200", "ms", "200"]
    # The headline is against the strongest stock setup, not stock P/D.
    assert lines[4].startswith("kvturn against stock-cond, the strongest stock setup: median "
                               "TTFT 200 / 200 ms = 1.00x, prompt tokens computed 200 / 200 = "
                               "1.00x")


def test_a_summary_without_kvturn_states_no_ratio() -> None:
    text = summary([r for r in REPORTS if r.mode != "kvturn"])
    assert len(text.splitlines()) == 3 and re.search(r"\d\.\d\dx", text) is None
    assert summary([]) == ""
