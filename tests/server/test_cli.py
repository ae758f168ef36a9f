"""The kvturn command: help everywhere, model build, down/status without a stack."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvturn_server.cli import main

COMMANDS = [[], ["model"], ["model", "build"], ["up"], ["down"], ["status"], ["router"],
            ["demo"], ["bench"], ["bench", "reuse"], ["bench", "trace"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "kvturn")
def test_every_command_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    assert "usage: kvturn" in capsys.readouterr().out


def test_model_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "build", "--size", "tiny", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert "built tiny model" in capsys.readouterr().out


def test_down_and_status_without_a_stack(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["down", "--state-dir", str(tmp_path)]) == 0
    assert main(["status", "--state-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.count("no kvturn stack is running") == 2


def test_stack_errors_are_one_clear_line(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--state-dir", str(tmp_path), "--router-port", "8100"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvturn: stack ports must all differ")


def test_up_puts_each_member_on_the_address_given(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from kvturn_server.cli import _stack_config, build_parser

    args = build_parser().parse_args([
        "up", "--state-dir", str(tmp_path), "--router-host", "127.0.0.2",
        "--prefill-host", "127.0.0.3", "--decode-host", "127.0.0.4", "--decode-port", "8100"])
    cfg = _stack_config(args)
    cfg.validate()  # the same HTTP and control ports on two addresses
    assert (cfg.router_url, cfg.prefill_url, cfg.decode_url, cfg.decode_control_url) == (
        "http://127.0.0.2:8000", "http://127.0.0.3:8100", "http://127.0.0.4:8100",
        "http://127.0.0.4:8101")
    assert main(["up", "--state-dir", str(tmp_path), "--decode-host", "10.0.0.21"]) == 1
    assert "loopback only" in capsys.readouterr().err
