"""The demo's per-turn accounting: where each turn's prompt KV came from (local/_demo.py)."""

from __future__ import annotations

from kvturn_server.local._demo import TurnReport, format_table, summary
from kvturn_server.local._metrics import PromptSources

NONE = PromptSources(0, 0, 0)


def _turn(mode: str, turn: int, prefill: PromptSources, decode: PromptSources,
          ttft: float) -> TurnReport:
    return TurnReport(mode, turn, "search", 5000, ttft, ttft + 50, "hit", prefill, decode)


def test_a_turn_the_decode_continued_counts_its_own_cache_and_computation() -> None:
    continued = _turn("on", 2, NONE, PromptSources(90, 4864, 0), 200)
    assert continued.route == "decode"
    assert continued.from_decode == 4864 and continued.computed == 90
    pd = _turn("on", 3, PromptSources(150, 4608, 256), PromptSources(1, 4864, 150), 300)
    assert pd.route == "prefill"
    assert pd.from_decode == 256 and pd.computed == 151


def test_the_table_and_summary_compare_computed_tokens_on_both_instances() -> None:
    reports = [
        _turn("off", 1, PromptSources(4700, 0, 0), PromptSources(1, 0, 4700), 700),
        _turn("off", 2, PromptSources(300, 4608, 0), PromptSources(1, 4608, 300), 400),
        _turn("on", 1, PromptSources(4700, 0, 0), PromptSources(1, 0, 4700), 700),
        _turn("on", 2, NONE, PromptSources(100, 4864, 0), 200),
    ]
    table = format_table(reports)
    assert "decode" in table and "prefill" in table
    text = summary(reports)
    assert "400 ms off, 200 ms on (2.0x)" in text
    assert "301 off, 100 on (3.0x fewer)" in text
