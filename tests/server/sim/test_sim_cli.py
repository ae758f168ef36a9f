"""``kvturn simulate``: arguments, outputs, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvturn_server.cli import build_parser, main
from kvturn_server.router import RouterConfig
from kvturn_server.sim import RouterSpec


def test_help_names_the_policies_and_the_doc(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "--help"])
    text = capsys.readouterr().out
    for word in ("kvturn-lease", "vllm-ttl-480", "--trace", "--sweep-budgets",
                 "docs/simulate.md"):
        assert word in text


def test_simulate_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    assert main(["simulate", "--conversations", "30", "--window", "20", "--prefills", "1",
                 "--decodes", "1", "--sweep-budgets", "0.25,0.5", "--sweep-ttls", "480",
                 "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"vllm-ttl-480", "kvturn-lease", "kvturn-host", "lru-budget",
                                     "evict-before-starve", "stock-pd", "stock-cond",
                                     "stock-cond-2k", "stock-cond-offload",
                                     "stock-cond-2k-offload"}
    assert len(data["sweep"]) == 2 and data["config"]["conversations"] == 30
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "| kvturn-lease |" in printed and "30 conversations" in printed


def test_the_router_s_continuation_settings_reach_the_kvturn_policies(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    assert main(["simulate", "--conversations", "10", "--window", "20", "--prefills", "1",
                 "--decodes", "1", "--sweep-budgets", "", "--policies", "kvturn-lease",
                 "--decode-continue-tokens", "2048", "--decode-continue-budget", "4096",
                 "--decode-continue-host-tokens", "0", "--json", str(out), "--quiet"]) == 0
    router = json.loads(out.read_text())["config"]["router"]
    assert (router["decode_continue_tokens"], router["decode_continue_budget"],
            router["decode_continue_host_tokens"]) == (2048, 4096, 0)
    for flag in ("--decode-continue-tokens", "--decode-continue-host-tokens"):
        assert main(["simulate", flag, "-1", "--json", str(tmp_path / "x.json")]) == 2
        assert "must be 0 or more" in capsys.readouterr().err
    # The router's own default otherwise.
    config = RouterConfig(prefill=("http://p0",), decode=("http://d0",))
    assert RouterSpec().decode_continue_host_tokens == config.decode_continue_host_tokens == 4096


def test_unknown_policy_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--policies", "fifo", "--json", str(tmp_path / "x.json")]) == 2
    assert "unknown policies ['fifo']" in capsys.readouterr().err
