"""The reuse benchmark without servers: the plan of requests (against a fake stack that keeps
prefix caches and retentions the way vLLM and the connector do), the rotation, the idle waits,
the statistics, the warnings, the table, the JSON and the plot. No timing is asserted: the
fake's clock only advances by what the fake charges."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from kvturn_server._cli_common import write_json
from kvturn_server.bench._reuse import ReuseBenchSettings, ReuseRunner, bench_config
from kvturn_server.bench._reuse_cli import settings_from_args
from kvturn_server.bench._reuse_plan import (
    LABELS,
    MODES,
    NEW_TOKENS,
    SHARED_PROMPT,
    Row,
    expected_decode,
    expected_prefill,
    plan_rows,
    run_orders,
    run_prompts,
    williams_orders,
)
from kvturn_server.bench._reuse_report import (
    ModeSamples,
    RowSamples,
    Spread,
    below_floor,
    results_document,
    steps_table,
    summarize,
    table,
    write_plot,
)
from kvturn_server.bench._reuse_stack import Snapshot, TurnReply
from kvturn_server.bench._stats import quantile
from kvturn_server.cli import build_parser
from kvturn_server.local._launch import kv_transfer_config
from kvturn_server.local._metrics import PromptSources

BLOCK = 16
ZERO = PromptSources(0, 0, 0)


def _add(a: PromptSources, computed: int, local: int, transferred: int) -> PromptSources:
    return PromptSources(a.computed + computed, a.local_cache + local,
                         a.transferred + transferred)


class FakeStack:
    """A prefill and a decode as far as the benchmark can see them: full-block prefix caches
    (a hit stops one token short of the prompt, as vLLM's does), retentions by key, verified
    reads of a retention beyond the local hit, prompt-token counters, an idle flag, a clock."""

    def __init__(self, busy_snapshots: int = 0) -> None:
        self.prefill_cache: set[tuple[int, ...]] = set()
        self.decode_cache: set[tuple[int, ...]] = set()
        self.retentions: dict[str, tuple[int, ...]] = {}
        self.prefill = ZERO
        self.decode = ZERO
        self.clock = 0.0
        self.busy = busy_snapshots
        self.log: list[tuple[str, Any]] = []

    @staticmethod
    def _hit(cache: set[tuple[int, ...]], prompt: Sequence[int]) -> int:
        n = 0
        while n + BLOCK <= len(prompt) - 1 and tuple(prompt[:n + BLOCK]) in cache:
            n += BLOCK
        return n

    @staticmethod
    def _store(cache: set[tuple[int, ...]], prompt: Sequence[int]) -> None:
        for end in range(BLOCK, len(prompt) + 1, BLOCK):
            cache.add(tuple(prompt[:end]))

    def turn(self, prompt: Sequence[int], key: str, *, read_retention: bool) -> TurnReply:
        self.log.append(("turn", key))
        local = self._hit(self.prefill_cache, prompt)
        read = 0
        if read_retention:
            held = self.retentions[key]  # a missing retention fails the pin, as the real one
            same = 0
            while same < min(len(held), len(prompt) - 1) and held[same] == prompt[same]:
                same += 1
            read = max(0, same // BLOCK * BLOCK - local)
        computed = len(prompt) - local - read
        self.prefill = _add(self.prefill, computed, local, read)
        self._store(self.prefill_cache, [*prompt])
        d_local = self._hit(self.decode_cache, prompt)
        self.decode = _add(self.decode, 0, d_local, len(prompt) - d_local)
        self._store(self.decode_cache, prompt)
        self.retentions[key] = tuple(prompt)
        # Costs only so that the clock moves like a stack's: computing is dear, reading cheap.
        steps = {"pin": 2.0, "unpin": 1.0} if read_retention else {}
        steps |= {"prefill": computed * 1.0 + read * 0.01, "decode": 5.0}
        self.clock += sum(steps.values()) / 1000
        return TurnReply(BLOCK, {}, steps)

    def hold(self, prompt: Sequence[int], key: str) -> None:
        self.log.append(("hold", key))
        local = self._hit(self.decode_cache, prompt)
        self.decode = _add(self.decode, len(prompt) - local, local, 0)
        self._store(self.decode_cache, prompt)
        self.retentions[key] = tuple(prompt)

    def warm(self, prompt: Sequence[int]) -> None:
        self.log.append(("warm", len(prompt)))
        local = self._hit(self.prefill_cache, prompt)
        self.prefill = _add(self.prefill, len(prompt) - local, local, 0)
        self._store(self.prefill_cache, prompt)

    def release(self, key: str) -> None:
        self.log.append(("release", key))
        self.retentions.pop(key, None)

    def snapshot(self) -> Snapshot:
        idle = self.busy <= 0
        self.busy -= 1
        self.log.append(("snapshot", idle))
        return Snapshot(idle, self.prefill, self.decode)

    def sleep(self, seconds: float) -> None:
        self.log.append(("sleep", seconds))
        self.clock += seconds


class Tokens:
    """Fresh token ids: a counter, so no two fresh sequences share a block."""

    def __init__(self) -> None:
        self.next = 10

    def __call__(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _runner(stack: FakeStack, **settings: Any) -> ReuseRunner:
    defaults: dict[str, Any] = {"sizes": (256,), "generated": (0, 96), "generated_sizes": None,
                                "runs": 4, "warmup_runs": 1, "settle_s": 0.5}
    return ReuseRunner(stack, ReuseBenchSettings(**{**defaults, **settings}), Tokens(),
                       now=lambda: stack.clock, sleep=stack.sleep, say=lambda _: None)


# The plan.

def test_every_mode_gets_exactly_its_planned_sources_on_both_instances() -> None:
    stack = FakeStack()
    runner = _runner(stack, sizes=(256, 512), generated=(0, 96, 160))
    for row in runner.settings.rows():
        samples = runner.measure_row(row, warmup_runs=1)
        for mode in MODES:
            ms = samples.modes[mode]
            assert len(ms.ttft_ms) == 4
            assert set(ms.prefill) == {expected_prefill(mode, row)}, (row, mode)
            assert set(ms.decode) == {expected_decode(mode, row)}, (row, mode)
        summary = summarize(samples)
        assert summary["warnings"] == []
        assert all(m["plan_met"] for m in summary["modes"].values())


def test_the_plan_in_words() -> None:
    row = Row(1024, 512)
    # (b) reads the whole history, (e) only the generated part; the floor computes the message.
    assert expected_prefill("reuse", row) == PromptSources(NEW_TOKENS, 0, 1536)
    assert expected_prefill("reuse_cached", row) == PromptSources(NEW_TOKENS, 1024, 512)
    assert expected_prefill("floor", row) == PromptSources(NEW_TOKENS, 1536, 0)
    assert expected_prefill("stock", row) == PromptSources(512 + NEW_TOKENS, 1024, 0)
    assert expected_prefill("recompute", row) == PromptSources(1600, 0, 0)
    assert expected_decode("recompute", row) == PromptSources(0, 0, 1600)
    assert expected_decode("floor", row) == PromptSources(0, 1536, NEW_TOKENS)


def test_a_floor_whose_prefill_was_not_warmed_is_flagged() -> None:
    stack = FakeStack()
    stack.warm = lambda prompt: None  # type: ignore[method-assign]
    runner = _runner(stack)
    summary = summarize(runner.measure_row(Row(256, 96)))
    assert not summary["modes"]["floor"]["plan_met"]
    assert summary["modes"]["reuse"]["plan_met"]
    assert any(w.startswith("PLAN NOT MET") and "(c) floor's prefill" in w
               for w in summary["warnings"])


def test_prompts_share_only_the_previous_prompt_that_the_plan_shares() -> None:
    row = Row(256, 64)
    fresh = Tokens()
    shared = fresh(256)
    prompts = run_prompts(row, shared, fresh)
    assert set(prompts) == set(MODES)
    for mode, p in prompts.items():
        assert len(p.history) == row.history and len(p.prompt) == row.prompt_tokens
        assert (list(p.history[:256]) == shared) == (mode in SHARED_PROMPT)
    seen = [t for p in prompts.values() for t in p.history[256:] + p.new]
    assert len(seen) == len(set(seen))  # generated parts and new messages: all fresh
    assert run_prompts(Row(256, 0), shared, fresh)["floor"].history == tuple(shared)
    with pytest.raises(ValueError, match="shared prompt"):
        run_prompts(row, shared[:10], fresh)


def test_every_setup_comes_before_the_timed_turns_and_every_key_is_released() -> None:
    stack = FakeStack()
    runner = _runner(stack, runs=1)
    runner.measure_row(Row(256, 96))
    events = [e for e in stack.log if e[0] in ("hold", "warm", "turn")]
    kinds = [e[0] for e in events]
    # The row's shared turn, a hold for each mode but recompute and the floor's warm, then the
    # five timed turns.
    assert kinds == ["turn", "hold", "hold", "warm", "hold", "hold"] + ["turn"] * 5
    assert stack.retentions == {}
    held = {k for kind, k in stack.log if kind in ("hold", "turn")}
    assert held == {k for kind, k in stack.log if kind == "release"}


def test_rows_default_to_the_generated_axis_at_one_size() -> None:
    assert plan_rows((2048, 4096, 8192), (0, 512, 2048), (2048,)) == [
        Row(2048, 0), Row(2048, 512), Row(2048, 2048), Row(4096, 0), Row(8192, 0)]
    assert len(plan_rows((2048, 4096), (0, 512), None)) == 4
    with pytest.raises(ValueError, match="not among the sizes"):
        plan_rows((2048,), (0,), (4096,))


# Rotation.

@pytest.mark.parametrize("modes", [MODES, MODES[:4]], ids=["five", "four"])
def test_the_orders_balance_positions_and_predecessors(modes: tuple[str, ...]) -> None:
    design = williams_orders(modes)
    assert len(design) == (2 * len(modes) if len(modes) % 2 else len(modes))
    assert all(sorted(o) == sorted(modes) for o in design)
    per_position = [Counter(o[i] for o in design) for i in range(len(modes))]
    assert all(set(c.values()) == {len(design) // len(modes)} for c in per_position)
    after = Counter(pair for o in design for pair in pairwise(o))
    assert len(after) == len(modes) * (len(modes) - 1)
    assert len(set(after.values())) == 1


def test_the_runner_uses_a_new_order_each_run() -> None:
    stack = FakeStack()
    samples = _runner(stack, runs=10).measure_row(Row(256, 0), warmup_runs=1)
    assert samples.orders == run_orders(10)
    assert len(set(samples.orders)) == 10
    timed = [k.rsplit("/", 1)[1] for kind, k in stack.log
             if kind == "turn" and "/shared/" not in k and "/-1/" not in k]
    assert timed == [m for order in run_orders(10) for m in order]


def test_warm_up_runs_come_before_the_first_row_only() -> None:
    stack = FakeStack()
    rows = _runner(stack, generated=(0,), sizes=(256, 512), runs=2, warmup_runs=2).measure()
    assert [(r["tokens"], r["generated"]) for r in rows] == [(256, 0), (512, 0)]
    warm = {k.split("/")[2] for kind, k in stack.log if kind == "turn"
            and k.split("/")[3] in ("-1", "-2")}
    assert warm == {"256+0"}
    assert all(r["modes"]["floor"]["ttft_ms"]["n"] == 2 for r in rows)


# Idle waits.

def test_every_timed_turn_follows_an_idle_check_a_settle_pause_and_a_second_check() -> None:
    stack = FakeStack(busy_snapshots=3)
    _runner(stack, runs=2, settle_s=0.7).measure_row(Row(256, 0))
    turns = [i for i, e in enumerate(stack.log) if e[0] == "turn"][1:]  # after the shared one
    assert len(turns) == 10
    for i in turns:
        assert stack.log[i - 3:i] == [("snapshot", True), ("sleep", 0.7), ("snapshot", True)]
        assert stack.log[i + 1] == ("snapshot", True)  # counters read once idle again
    # While busy the runner polls and does not start.
    assert stack.log.count(("snapshot", False)) == 3


def test_instances_that_never_become_idle_stop_the_benchmark() -> None:
    stack = FakeStack(busy_snapshots=10**9)
    runner = _runner(stack, runs=1)
    runner.idle_timeout_s = 2.0
    with pytest.raises(RuntimeError, match="did not become idle"):
        runner.measure_row(Row(256, 0))
    assert stack.retentions == {}  # released on the way out


# Statistics and warnings.

def test_quantiles_interpolate_like_numpy() -> None:
    values = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert quantile(values, 0.5) == 30.0
    assert quantile(values, 0.1) == pytest.approx(14.0)
    assert quantile(values, 0.9) == pytest.approx(46.0)
    assert quantile([3.0], 0.9) == 3.0
    spread = Spread.of(list(reversed(values)))
    assert (spread.n, spread.min, spread.p50, spread.max) == (5, 10.0, 30.0, 50.0)
    with pytest.raises(ValueError):
        quantile([], 0.5)
    with pytest.raises(ValueError):
        quantile(values, 1.5)


def test_below_the_floor_means_beyond_both_spreads() -> None:
    floor = Spread.of([100.0, 102.0, 104.0, 106.0, 108.0])  # p10 100.8, p50 104
    assert below_floor(Spread.of([101.0, 103.0, 105.0]), floor) is None  # scatter
    assert below_floor(Spread.of([110.0, 120.0, 130.0]), floor) is None  # above
    excess = below_floor(Spread.of([90.0, 91.0, 92.0]), floor)  # 13 ms below, noise 3.2
    assert excess == pytest.approx(104 - 91 - 3.2)
    # A wide scatter of the mode itself excuses a lower p50.
    assert below_floor(Spread.of([80.0, 91.0, 200.0]), floor) is None


ROW = Row(2048, 0)


def _samples(ttft: dict[str, list[float]], row: Row = ROW) -> RowSamples:
    samples = RowSamples(row, 128)
    for mode, values in ttft.items():
        ms = ModeSamples()
        for v in values:
            ms.add(v, expected_prefill(mode, row), expected_decode(mode, row))
        samples.modes[mode] = ms
    return samples


GOOD = {"recompute": [1200.0, 1210.0, 1190.0, 1205.0], "reuse": [150.0, 152.0, 149.0, 151.0],
        "floor": [140.0, 141.0, 139.0, 142.0], "stock": [141.0, 140.0, 142.0, 139.0],
        "reuse_cached": [143.0, 144.0, 142.0, 145.0]}


def test_a_reuse_faster_than_the_floor_is_a_measurement_error_in_table_and_json(
        tmp_path: Path) -> None:
    bad = {**GOOD, "reuse": [120.0, 121.0, 119.0, 122.0]}
    summary = summarize(_samples(bad))
    assert summary["modes"]["reuse"]["below_floor"]
    assert not summary["reuse_within_target"]
    assert len(summary["warnings"]) == 1 and "MEASUREMENT ERROR" in summary["warnings"][0]
    assert "(b) reuse" in summary["warnings"][0] and "not a gain" in summary["warnings"][0]
    text = table([summary])
    assert "120 [119-122]!" in text and "WARNING: MEASUREMENT ERROR" in text
    assert "(off target)" in text
    path = tmp_path / "reuse.json"
    write_json(results_document({"settings": {}}, [summary]), path)
    data = json.loads(path.read_text())
    assert data["warnings"] == summary["warnings"]
    assert data["rows"][0]["modes"]["reuse"]["below_floor"] is True


def test_an_honest_row_has_its_ratios_and_no_warning() -> None:
    summary = summarize(_samples(GOOD))
    assert summary["warnings"] == []
    r = summary["ratios_of_p50"]
    assert r["reuse_over_floor"] == pytest.approx(150.5 / 140.5, abs=1e-3)
    assert r["recompute_over_reuse"] == pytest.approx(1202.5 / 150.5, abs=1e-3)
    assert r["stock_over_reuse_cached"] == pytest.approx(140.5 / 143.5, abs=1e-3)
    assert summary["reuse_within_target"]
    paired = summary["paired_ratios"]["reuse_over_floor"]
    assert paired["n"] == 4 and paired["min"] <= paired["p50"] <= paired["max"]
    assert summary["modes"]["floor"]["ttft_ms"]["p50"] == 140.5
    assert "reuse/floor" in table([summary]) and "WARNING" not in table([summary])


def test_a_slow_reuse_is_off_target_but_not_an_error() -> None:
    summary = summarize(_samples({**GOOD, "reuse": [300.0, 301.0, 302.0, 303.0]}))
    assert summary["warnings"] == [] and not summary["reuse_within_target"]


def test_json_layout_and_plot(tmp_path: Path) -> None:
    rows = [summarize(_samples(GOOD, Row(s, g)))
            for s, g in ((2048, 0), (4096, 0), (2048, 512), (2048, 2048))]
    path = tmp_path / "out" / "reuse.json"
    write_json(results_document({"settings": {"runs": 4}}, rows), path)
    data = json.loads(path.read_text())
    assert data["config"] == {"settings": {"runs": 4}}
    assert set(data["modes"]) == set(MODES)
    first = data["rows"][0]
    assert {"tokens", "generated", "prompt_tokens", "modes", "ratios_of_p50", "paired_ratios",
            "reuse_within_target", "warnings", "orders", "block_size"} <= set(first)
    assert set(first["modes"]["reuse"]["ttft_ms"]) == {"n", "p10", "p50", "p90", "min", "max"}
    png = tmp_path / "reuse.png"
    assert write_plot(rows, png, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# Settings and the stack.

def test_the_cli_defaults_fit_the_time_budget_and_flags_do_more() -> None:
    args = build_parser().parse_args(["bench", "reuse", "--json", "x.json"])
    s = settings_from_args(args)
    assert s.runs == 20 and s.sizes == (2048, 4096, 8192) and s.generated == (0, 512, 2048)
    assert s.generated_sizes == (2048,)
    assert [(r.tokens, r.generated) for r in s.rows()] == [
        (2048, 0), (2048, 512), (2048, 2048), (4096, 0), (8192, 0)]
    args = build_parser().parse_args(["bench", "reuse", "--json", "x.json", "--sizes",
                                      "4096,2048,16384", "--generated-sizes", "all",
                                      "--generated", "0,512", "--runs", "3"])
    s = settings_from_args(args)
    assert s.sizes == (2048, 4096, 16384) and s.generated_sizes is None and len(s.rows()) == 6
    s.check(32768)
    with pytest.raises(ValueError, match="does not fit"):
        ReuseBenchSettings(sizes=(31000,), generated=(2048,), generated_sizes=None).check(32768)
    with pytest.raises(ValueError, match="--runs"):
        ReuseBenchSettings(runs=0).check(32768)


def test_the_benchmark_stack_runs_vllms_default_prefix_cache(tmp_path: Path) -> None:
    cfg = bench_config(tmp_path, {"prefill_port": 9000})
    assert cfg.model_size == "bench" and cfg.max_model_len >= 16384 + 2048 + NEW_TOKENS
    assert cfg.prefill_prefix_caching and not cfg.with_reference and not cfg.with_router
    assert cfg.prefill_port == 9000
    assert cfg.decoder_kv_blocks_ttl >= 1800  # the shared prompt's retention lasts a row


def test_the_run_can_put_the_decode_back_on_engine_steps_while_pinned(tmp_path: Path) -> None:
    args = build_parser().parse_args(["bench", "reuse", "--json", "x.json",
                                      "--decode-steps-while-pinned"])
    s = settings_from_args(args)
    assert s.decode_steps_while_pinned
    before = bench_config(tmp_path, {}, decode_steps_while_pinned=True)
    after = bench_config(tmp_path, {})
    extra = kv_transfer_config(before, "kv_consumer")["kv_connector_extra_config"]
    assert extra["nixl_progress_thread"] is False
    assert "nixl_progress_thread" not in kv_transfer_config(
        after, "kv_consumer")["kv_connector_extra_config"]  # the decode's default: the thread
    assert "nixl_progress_thread" not in kv_transfer_config(
        before, "kv_producer")["kv_connector_extra_config"]


# Where a turn's time goes.

def test_each_steps_median_is_reported_per_mode_and_printed_for_the_reading_modes() -> None:
    stack = FakeStack()
    runner = _runner(stack, sizes=(256,), generated=(96,))
    summary = summarize(runner.measure_row(runner.settings.rows()[0]))
    reuse = summary["modes"]["reuse"]["steps_ms"]
    assert set(reuse) == {"pin", "prefill", "unpin", "decode"}
    assert reuse["pin"] == 2.0 and reuse["unpin"] == 1.0 and reuse["decode"] == 5.0
    floor = summary["modes"]["floor"]["steps_ms"]
    assert set(floor) == {"prefill", "decode"}  # no pin: nothing to read
    lines = steps_table([summary])
    assert lines[0].startswith("where a turn's time goes")
    shown = lines[3:]
    assert len(shown) == 3  # reuse, reuse+cache, floor
    assert any(LABELS["floor"] in line and "      -" in line for line in shown)
    assert "where a turn's time goes" in table([summary])
