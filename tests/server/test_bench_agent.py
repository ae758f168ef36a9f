"""The agent benchmark without servers: the gap distribution, the workload, the summary math,
the JSON and the plot, and the agent loop against an in-process fake router."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx2
import pytest

import kvturn
from kvturn_server.bench._agent import (
    AgentBenchSettings,
    AgentOutcome,
    GapDistribution,
    ModeRun,
    Sample,
    Sampler,
    TurnRecord,
    add_agent_bench_parser,
    agent_stack_config,
    build_results,
    build_scripts,
    measure,
    percentile,
    settings_from_args,
    summarize,
    table,
    write_json,
    write_plot,
)
from kvturn_server.local._metrics import PromptSources

MIB = 1024 * 1024


# The gap distribution.

def test_the_gap_fit_puts_p50_and_p90_on_the_trace_and_scales_them() -> None:
    gaps = GapDistribution(p50_s=2.0, p90_s=24.0, time_scale=0.1, cap_s=None)
    assert gaps.mu == pytest.approx(math.log(2.0))
    assert gaps.sigma == pytest.approx(math.log(12.0) / 1.2815515655446004)
    assert gaps.quantile(0.5) == pytest.approx(0.2)
    assert gaps.quantile(0.9) == pytest.approx(2.4)
    # Fitted to p50/p90 the log-normal's p99 is about 3 min: lighter than the traces' ~11 min.
    assert 170 < gaps.trace_quantile(0.99) < 195
    assert gaps.describe()["fit_trace_p99_s"] == pytest.approx(gaps.trace_quantile(0.99), abs=0.1)


def test_seeded_draws_repeat_and_their_quantiles_are_near_the_targets() -> None:
    gaps = GapDistribution(time_scale=0.1)
    draws = [gaps.draw(random.Random(7)) for _ in range(3)]
    assert draws == [gaps.draw(random.Random(7)) for _ in range(3)]
    rng = random.Random(1234)
    sample = [gaps.draw(rng) for _ in range(20000)]
    p50, p90 = percentile(sample, 0.5), percentile(sample, 0.9)
    assert p50 is not None and p90 is not None
    assert p50 == pytest.approx(0.2, rel=0.05)
    assert p90 == pytest.approx(2.4, rel=0.08)
    assert max(sample) <= 66.0 + 1e-9  # the cap: 660 trace seconds, scaled


def test_the_gap_distribution_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        GapDistribution(p50_s=30.0, p90_s=24.0)
    with pytest.raises(ValueError):
        GapDistribution(time_scale=0.0)


# Settings and the workload.

def test_settings_derive_the_lease_and_the_keepalive_from_the_time_scale() -> None:
    s = AgentBenchSettings(time_scale=0.1)
    assert s.retention_ttl == 48.0 and s.keepalive_interval == 6.0
    assert AgentBenchSettings(time_scale=0.01).retention_ttl == 30.0  # floor
    assert AgentBenchSettings(retention_ttl_s=100.0).keepalive_interval == 12.5
    with pytest.raises(ValueError):
        AgentBenchSettings(modes=("on", "on"))
    with pytest.raises(ValueError):
        AgentBenchSettings(modes=("fast",))
    with pytest.raises(ValueError):
        AgentBenchSettings(message_tokens=(300, 100))
    AgentBenchSettings().check_fits(8192)  # the defaults fit the tiny model's context
    with pytest.raises(ValueError, match="context"):
        AgentBenchSettings(turns=40).check_fits(8192)


def test_scripts_are_deterministic_with_the_requested_sizes() -> None:
    s = AgentBenchSettings(agents=4, turns=5, system_tokens=1000, message_tokens=(100, 300),
                           stagger_s=0.5, seed=3)
    on, again, off = build_scripts(s, "on"), build_scripts(s, "on"), build_scripts(s, "off")
    assert on == again
    assert [a.start_s for a in on] == [0.0, 0.5, 1.0, 1.5]
    for a in on:
        assert len(a.system.split()) == 1000 and a.system_words == 1000
        assert len(a.messages) == 5 and len(a.gaps_s) == 4
        assert all(100 <= n <= 300 for n in a.message_words)
        assert [len(m["content"].split()) for m in a.messages] == list(a.message_words)
        assert a.messages[0]["role"] == "user"
        assert all(m["role"] == "tool" and m["tool_call_id"] for m in a.messages[1:])
        assert all(g >= 0 for g in a.gaps_s)
    # Same sizes, gaps and starts in both modes; other words, so no cache carries over.
    for a, b in zip(on, off, strict=True):
        assert (a.message_words, a.gaps_s, a.start_s) == (b.message_words, b.gaps_s, b.start_s)
        assert a.system != b.system
    assert len({a.system for a in on}) == 4  # every agent its own history
    assert build_scripts(AgentBenchSettings(agents=4, turns=5, seed=4), "on")[0].gaps_s \
        != on[0].gaps_s


def test_the_stack_runs_the_router_and_scales_the_lease(tmp_path: Path) -> None:
    s = AgentBenchSettings(state_dir=tmp_path, time_scale=0.2, size="bench")
    cfg = agent_stack_config(s, {"router_port": 9100, "decode_control_port": 9101})
    assert cfg.with_router and not cfg.with_reference
    assert cfg.router_port == 9100 and cfg.decode_control_port == 9101
    assert cfg.decoder_kv_blocks_ttl == 96.0
    assert cfg.max_model_len == 32768 and cfg.served_model_name == "kvturn-bench"
    assert not cfg.prefill_prefix_caching
    assert agent_stack_config(AgentBenchSettings(prefill_prefix_cache=True), {}) \
        .prefill_prefix_caching


# Summary math.

def test_percentiles_interpolate_between_order_statistics() -> None:
    values = [float(v) for v in range(10, 0, -1)]  # unsorted on purpose
    assert percentile(values, 0.5) == pytest.approx(5.5)
    assert percentile(values, 0.9) == pytest.approx(9.1)
    assert percentile(values, 0.99) == pytest.approx(9.91)
    assert percentile(values, 0.0) == 1.0 and percentile(values, 1.0) == 10.0
    assert percentile([4.0], 0.99) == 4.0
    assert percentile([], 0.5) is None


def _record(mode: str, agent: int, turn: int, ttft: float | None, prompt: int,
            reuse: str = "miss", reused: int = 0, error: str | None = None) -> TurnRecord:
    return TurnRecord(mode=mode, agent=agent, turn=turn, conversation_id=None,
                      started_s=float(turn), message_role="tool", message_words=100,
                      prompt_tokens=prompt, completion_tokens=64, ttft_ms=ttft,
                      total_ms=None if ttft is None else ttft + 500, reuse=reuse,
                      reused_tokens=reused, error=error)


def _runs() -> list[ModeRun]:
    off = ModeRun(
        mode="off", wall_s=10.0, agents=[AgentOutcome("off", 0, None, 3)],
        records=[_record("off", 0, 1, 100.0, 1000), _record("off", 0, 2, 300.0, 1500),
                 _record("off", 0, 3, 500.0, 2000),
                 _record("off", 0, 4, None, 0, error="APIError: boom")],
        samples=[Sample("off", 0.0, 0, 0.0), Sample("off", 5.0, 0, 2500.0)],
        prefill_before=PromptSources(1000.0, 0.0, 0.0),
        prefill_after=PromptSources(5500.0, 0.0, 0.0), load_before=(1.0, 1.0, 1.0))
    on = ModeRun(
        mode="on", wall_s=8.0, agents=[AgentOutcome("on", 0, "kvt-x", 3)],
        records=[_record("on", 0, 1, 100.0, 1000),
                 _record("on", 0, 2, 50.0, 1500, "hit", 1024),
                 _record("on", 0, 3, 60.0, 2000, "partial", 1504)],
        samples=[Sample("on", 0.0, 0, 0.0), Sample("on", 1.0, 2 * MIB, 1000.0),
                 Sample("on", 2.0, 4 * MIB, None), Sample("on", 3.0, None, 1500.0)],
        prefill_before=PromptSources(5500.0, 0.0, 0.0),
        prefill_after=PromptSources(7000.0, 0.0, 2528.0))
    return [off, on]


def test_a_mode_summary_counts_only_successful_turns() -> None:
    off, on = (summarize(run, planned_turns=4) for run in _runs())
    assert off["turns_ok"] == 3 and off["errors"] == 1 and off["turns_planned"] == 4
    assert off["ttft_ms"]["p50"] == 300.0 and off["ttft_ms"]["n"] == 3
    assert off["ttft_ms"]["p90"] == pytest.approx(460.0)
    assert off["ttft_ms_turn2plus"]["p50"] == 400.0
    assert off["prompt_tokens"] == {"total": 4500, "mean": 1500.0, "max": 2000}
    assert off["prefill_computed_tokens"] == 4500.0
    assert off["turns_per_s"] == 0.3
    assert off["reuse"] == {"outcomes": {"miss": 3}, "reused_tokens": 0}
    assert on["reuse"] == {"outcomes": {"hit": 1, "miss": 1, "partial": 1},
                           "reused_tokens": 2528}
    assert on["prefill_tokens"] == {"computed": 1500.0, "local_cache": 0.0,
                                    "transferred": 2528.0}
    assert on["retained_mib"] == {"max": 4.0, "mean": 2.0, "samples": 3}
    assert on["decode_tokens"] is None  # not measured


def test_the_results_document_has_settings_seed_summaries_records_and_samples(
        tmp_path: Path) -> None:
    settings = AgentBenchSettings(agents=1, turns=4, seed=11)
    results = build_results(settings, _runs(), {"load_average": {"start": [], "end": []}})
    path = tmp_path / "out" / "agent.json"
    write_json(results, path)
    data = json.loads(path.read_text())
    assert data["benchmark"] == "agent" and data["seed"] == 11
    assert data["settings"]["agents"] == 1 and data["settings"]["seed"] == 11
    assert data["settings"]["effective_retention_ttl_s"] == 48.0
    assert data["order"] == ["off", "on"] and data["order_rationale"]
    assert set(data["modes"]) == {"off", "on"}
    assert data["gaps"]["distribution"] == "lognormal"
    assert len(data["gaps"]["drawn_s"]["0"]) == 3
    assert data["comparison"]["prefill_computed_off_over_on"] == 3.0
    assert data["comparison"]["ttft_ms_p50_off_over_on"] == pytest.approx(300.0 / 60.0, abs=1e-3)
    assert len(data["turns"]) == 7 and len(data["samples"]) == 6
    assert set(data["turns"][0]) == {
        "mode", "agent", "turn", "conversation_id", "started_s", "message_role",
        "message_words", "prompt_tokens", "completion_tokens", "ttft_ms", "total_ms", "reuse",
        "reused_tokens", "no_reuse_reason", "finish_reason", "gap_after_s", "error"}
    assert set(data["samples"][0]) == {"mode", "t_s", "retained_bytes",
                                       "prefill_computed_tokens"}
    assert data["load_average"] == {"start": [], "end": []}
    lines = table(data).splitlines()
    assert lines[1].startswith("off") and lines[2].startswith("on") and "off/on" in lines[3]


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    results = build_results(AgentBenchSettings(agents=1, turns=4), _runs())
    path = tmp_path / "agent.png"
    assert write_plot(results, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _FixedProbe:
    def __init__(self) -> None:
        self.held = 0

    def retained_bytes(self) -> int | None:
        self.held += MIB
        return self.held

    def prefill_sources(self) -> PromptSources | None:
        return PromptSources(float(self.held), 0.0, 0.0)

    def decode_sources(self) -> PromptSources | None:
        return None


def test_the_sampler_always_has_a_first_and_a_last_point() -> None:
    ticks = iter(range(100))
    sampler = Sampler(_FixedProbe(), "on", interval=3600.0, clock=lambda: float(next(ticks)))
    sampler.start(t0=0.0)
    samples = sampler.stop()
    assert [s.retained_bytes for s in samples] == [MIB, 2 * MIB]
    assert [s.mode for s in samples] == ["on", "on"]
    assert samples[0].t_s < samples[1].t_s


def test_the_command_line_maps_onto_the_settings(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_agent_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["agent", "--json", str(tmp_path / "a.json")])
    s = settings_from_args(args)
    assert callable(args.func)
    assert (s.agents, s.turns, s.time_scale, s.seed, s.size, s.modes) == (
        8, 6, 0.1, 0, "tiny", ("off", "on"))
    assert s.json_path == tmp_path / "a.json" and s.plot_path is None
    args = parser.parse_args(["agent", "--json", "x.json", "--modes", "on,off", "--agents", "2",
                              "--message-tokens", "50,60", "--max-gap", "0", "--size", "bench",
                              "--prefill-prefix-cache", "--retention-ttl", "90"])
    s = settings_from_args(args)
    assert s.modes == ("on", "off") and s.agents == 2 and s.message_tokens == (50, 60)
    assert s.gap_cap_s is None and s.size == "bench" and s.prefill_prefix_cache
    assert s.retention_ttl == 90.0
    with pytest.raises(SystemExit):
        parser.parse_args(["agent", "--json", "x.json", "--modes", "on,slow"])


# The agent loop against an in-process fake router.

def _sse(data: dict[str, Any]) -> str:
    return "data: " + json.dumps(data) + "\n\n"


class FakeRouter:
    """Answers streamed chat completions with reuse headers the way the router does (hit
    after a conversation's first turn, miss without an id), plus the conversation endpoints."""

    REPLY = ("Sure", ",", " looking", " into", " it", ".")

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.keepalives: list[str] = []
        self.released: list[str] = []
        self.live: set[str] = set()
        self.last_prompt: dict[str, int] = {}
        self.computed = 0
        self.keepalive_seen = asyncio.Event()

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        if path.startswith("/kvturn/v1/conversations/"):
            rest = path.removeprefix("/kvturn/v1/conversations/")
            if request.method == "POST" and rest.endswith("/keepalive"):
                conversation = unquote(rest.removesuffix("/keepalive"))
                self.keepalives.append(conversation)
                self.keepalive_seen.set()
                return httpx2.Response(200, json={
                    "conversation_id": conversation, "retained": True, "expires_in": 48.0,
                    "hold_remaining": 3000.0, "num_tokens": 100})
            conversation = unquote(rest)
            self.released.append(conversation)
            self.live.discard(conversation)
            return httpx2.Response(200, json={"conversation_id": conversation,
                                              "released": True})
        assert path == "/v1/chat/completions", path
        body = json.loads(request.content)
        self.requests.append({"body": body, "headers": dict(request.headers)})
        prompt = sum(len(str(m.get("content") or "").split()) + 4 for m in body["messages"])
        conversation = body.get("conversation_id")
        if conversation is None:
            reuse, reused = "miss", 0
        elif conversation in self.last_prompt:
            reuse, reused = "hit", self.last_prompt[conversation]
        else:
            reuse, reused = "miss", 0
        if conversation is not None:
            self.last_prompt[conversation] = prompt
            self.live.add(conversation)
        self.computed += prompt - reused
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1,
                "model": body["model"]}
        events = [_sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                    "content": ""},
                                              "finish_reason": None}]})]
        events += [_sse({**base, "choices": [{"index": 0, "delta": {"content": piece},
                                              "finish_reason": None}]})
                   for piece in self.REPLY]
        events.append(_sse({**base, "choices": [{"index": 0, "delta": {},
                                                 "finish_reason": "length"}]}))
        assert body["stream_options"] == {"include_usage": True}
        events.append(_sse({**base, "choices": [], "usage": {
            "prompt_tokens": prompt, "completion_tokens": len(self.REPLY),
            "total_tokens": prompt + len(self.REPLY)}}))
        events.append("data: [DONE]\n\n")
        headers = {"content-type": "text/event-stream", "X-KVTurn-Reuse": reuse,
                   "X-KVTurn-Reused-Tokens": str(reused), "x-request-id": "fake"}
        if conversation is not None:
            headers["X-KVTurn-Conversation"] = conversation
        return httpx2.Response(200, headers=headers, content="".join(events).encode())


class FakeProbe:
    """The stack's instance-wide numbers, as the fake router's bookkeeping has them."""

    def __init__(self, router: FakeRouter) -> None:
        self.router = router

    def retained_bytes(self) -> int | None:
        return len(self.router.live) * MIB

    def prefill_sources(self) -> PromptSources | None:
        return PromptSources(float(self.router.computed), 0.0, 0.0)

    def decode_sources(self) -> PromptSources | None:
        return None


def _client(router: FakeRouter) -> kvturn.AsyncOpenAI:
    http = httpx2.AsyncClient(transport=httpx2.MockTransport(router.handle))
    return kvturn.AsyncOpenAI(base_url="http://router.test/v1", api_key="bench", max_retries=0,
                              http_client=http)


async def test_both_modes_run_every_turn_and_read_usage_and_reuse_headers() -> None:
    router = FakeRouter()
    settings = AgentBenchSettings(agents=2, turns=3, system_tokens=50, message_tokens=(10, 20),
                                  stagger_s=0.0, time_scale=0.001, progress_interval_s=0,
                                  sample_interval_s=3600.0)
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await asyncio.sleep(0)

    said: list[str] = []
    client = _client(router)
    try:
        results = await measure(settings, client, "kvturn-tiny", FakeProbe(router),
                                say=said.append, sleep=sleep)
    finally:
        await client.close()

    turns = results["turns"]
    assert [(t["mode"], t["agent"], t["turn"]) for t in turns] == [
        (mode, agent, turn) for mode in ("off", "on") for agent in (0, 1) for turn in (1, 2, 3)]
    assert all(t["error"] is None and t["ttft_ms"] is not None and t["total_ms"] is not None
               and t["ttft_ms"] <= t["total_ms"] for t in turns)
    assert all(t["completion_tokens"] == 6 and t["finish_reason"] == "length" for t in turns)
    off = [t for t in turns if t["mode"] == "off"]
    on = [t for t in turns if t["mode"] == "on"]
    assert all(t["reuse"] == "miss" and t["reused_tokens"] == 0 and t["conversation_id"] is None
               for t in off)
    assert [t["reuse"] for t in on] == ["miss", "hit", "hit"] * 2
    assert all(t["conversation_id"].startswith("kvt-") for t in on)
    assert all(t["no_reuse_reason"] is None for t in on)  # the replies went back verbatim
    # What the router saw: ids only in "on" (body and header), prompts growing by the reply.
    # (The first two requests are the warm-up conversation.)
    sent = router.requests[2:]
    assert len(sent) == 12
    by_id: dict[str | None, list[dict[str, Any]]] = {}
    for request in sent:
        by_id.setdefault(request["body"].get("conversation_id"), []).append(request)
    assert len(by_id[None]) == 6
    assert all("x-conversation-id" not in r["headers"] for r in by_id[None])
    for conversation in {t["conversation_id"] for t in on}:
        requests = by_id[conversation]
        assert len(requests) == 3
        assert all(r["headers"]["x-conversation-id"] == conversation for r in requests)
        assert all("x-kvturn-no-reuse" not in r["headers"] for r in requests)
        first, second = requests[0]["body"]["messages"], requests[1]["body"]["messages"]
        assert second[:len(first)] == first
        assert second[len(first)] == {"role": "assistant", "content": "".join(FakeRouter.REPLY)}
        assert second[-1]["role"] == "tool"
        assert [r["body"]["max_tokens"] for r in requests] == [64] * 3
        assert all(r["body"]["temperature"] == 0 and r["body"]["stream"] for r in requests)
    # Usage and the router's numbers reach the records and the summaries.
    for t in on:
        request = by_id[t["conversation_id"]][t["turn"] - 1]
        assert t["prompt_tokens"] == sum(len(str(m.get("content") or "").split()) + 4
                                         for m in request["body"]["messages"])
    assert set(router.released) == {t["conversation_id"] for t in on} | {
        router.requests[0]["body"]["conversation_id"]}
    summary = results["modes"]
    assert summary["on"]["reuse"]["outcomes"] == {"hit": 4, "miss": 2}
    assert summary["on"]["reuse"]["reused_tokens"] == sum(t["reused_tokens"] for t in on)
    assert summary["off"]["prefill_computed_tokens"] == sum(t["prompt_tokens"] for t in off)
    assert summary["on"]["prefill_computed_tokens"] == sum(
        t["prompt_tokens"] - t["reused_tokens"] for t in on)
    assert summary["off"]["turns_ok"] == summary["on"]["turns_ok"] == 6
    assert results["comparison"]["prefill_computed_off_over_on"] > 1
    # The tool gaps slept are the drawn ones, in both modes (the warm-up's are zero).
    drawn = [g for agent in results["gaps"]["drawn_s"].values() for g in agent]
    assert sorted(round(s, 4) for s in slept if s > 0) == sorted(
        [g for g in drawn if g > 0] * 2)
    assert any(line.startswith("[on] done") for line in said)


async def test_an_on_agent_keeps_its_lease_alive_during_each_tool_gap() -> None:
    router = FakeRouter()
    settings = AgentBenchSettings(agents=1, turns=3, system_tokens=20, message_tokens=(5, 5),
                                  modes=("on",), warmup=False, keepalive_interval_s=0.001,
                                  progress_interval_s=0, sample_interval_s=3600.0)
    gaps_waited = 0

    async def until_a_keepalive(seconds: float) -> None:
        # The gap ends when the SDK has renewed the lease, not after some time.
        nonlocal gaps_waited
        gaps_waited += 1
        router.keepalive_seen.clear()
        await asyncio.wait_for(router.keepalive_seen.wait(), timeout=30)

    client = _client(router)
    try:
        results = await measure(settings, client, "kvturn-tiny", FakeProbe(router),
                                say=lambda _: None, sleep=until_a_keepalive)
    finally:
        await client.close()
    (agent,) = results["agents"]
    assert gaps_waited == 2
    assert len(router.keepalives) >= 2 and set(router.keepalives) == {agent["conversation_id"]}
    assert agent["sdk_stats"]["keepalives"] >= 2
    assert agent["sdk_stats"]["keepalive_failures"] == 0
    assert agent["sdk_stats"]["hits"] == 2 and agent["turns_ok"] == 3
    assert router.released == [agent["conversation_id"]]
    assert results["modes"]["on"]["retained_mib"]["samples"] == 2  # at start and at stop


async def test_a_failed_turn_is_recorded_and_stops_that_agent_only() -> None:
    router = FakeRouter()
    handle = router.handle
    calls = 0

    def flaky(request: httpx2.Request) -> httpx2.Response:
        nonlocal calls
        if request.url.path == "/v1/chat/completions":
            calls += 1
            if calls == 2:
                return httpx2.Response(400, json={"error": {
                    "message": "bad", "type": "invalid_request_error", "param": None,
                    "code": None}})
        return handle(request)

    settings = AgentBenchSettings(agents=1, turns=3, system_tokens=20, message_tokens=(5, 5),
                                  modes=("off",), warmup=False, progress_interval_s=0,
                                  sample_interval_s=3600.0)
    http = httpx2.AsyncClient(transport=httpx2.MockTransport(flaky))
    client = kvturn.AsyncOpenAI(base_url="http://router.test/v1", api_key="bench",
                                max_retries=0, http_client=http)

    async def instant(seconds: float) -> None:
        await asyncio.sleep(0)

    try:
        results = await measure(settings, client, "kvturn-tiny", FakeProbe(router),
                                say=lambda _: None, sleep=instant)
    finally:
        await client.close()
    turns = results["turns"]
    assert [t["error"] is None for t in turns] == [True, False]
    assert "BadRequestError" in turns[1]["error"]
    assert results["modes"]["off"]["errors"] == 1 and results["modes"]["off"]["turns_ok"] == 1
    assert results["agents"][0]["error"].startswith("turn 2:")
