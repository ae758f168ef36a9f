"""Router settings: flags, config file, control URLs, validation messages."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvturn_server.router import (
    DecodeSpec,
    RouterConfig,
    RouterConfigError,
    add_router_args,
    router_config_from_args,
)

P = "http://prefill:8100"
D = "http://decode:8200"


def _parse(*argv: str) -> RouterConfig:
    parser = argparse.ArgumentParser(prog="kvturn router")
    add_router_args(parser)
    return router_config_from_args(parser.parse_args(list(argv)))


def test_the_existing_flags_keep_working() -> None:
    cfg = _parse("--prefill", P, "--prefill", "http://p2:8100/", "--decode", D, "--host",
                 "0.0.0.0", "--port", "9000", "--prefill-timeout", "30", "--connect-timeout",
                 "2", "--decode-timeout", "100")
    assert cfg.prefill == (P, "http://p2:8100")
    assert cfg.decode == (DecodeSpec(D, "http://decode:8201"),)
    assert (cfg.host, cfg.port) == ("0.0.0.0", 9000)
    assert (cfg.prefill_timeout, cfg.connect_timeout, cfg.decode_timeout) == (30, 2, 100)
    assert cfg.effective_pin_ttl == 40


def test_a_decode_control_url_defaults_to_the_next_port_or_is_given() -> None:
    cfg = _parse("--prefill", P, "--decode", D, "--decode",
                 "https://d2:8300,control=http://ctl:9999", "--decode", "http://[::1]:8400",
                 "--decode", "http://d4")
    assert [d.control for d in cfg.decode] == ["http://decode:8201", "http://ctl:9999",
                                               "http://[::1]:8401", "http://d4:81"]


def test_plain_strings_are_accepted_in_code() -> None:
    cfg = RouterConfig(prefill=(P,), decode=(D,))  # type: ignore[arg-type]
    assert cfg.decode[0].control == "http://decode:8201"
    assert cfg.state == "memory" and cfg.max_conversations == 100_000


def test_help_documents_the_control_url_rule(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvturn router")
    add_router_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "control=URL" in out and "next port" in out
    assert "--state" in out and "--health-interval" in out


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_config_file_is_read_and_flags_override_it(tmp_path: Path, suffix: str) -> None:
    settings = {"prefill": [P], "decode": [D, {"url": "http://d1:8200",
                                               "control": "http://d1:7000"}],
                "state": "redis://localhost:6379/1", "health_interval": 2.5,
                "max_conversations": 10}
    path = tmp_path / f"router{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(settings))
    else:
        path.write_text(
            f'prefill = ["{P}"]\n'
            f'decode = ["{D}", {{url = "http://d1:8200", control = "http://d1:7000"}}]\n'
            'state = "redis://localhost:6379/1"\nhealth_interval = 2.5\n'
            'max-conversations = 10\n')
    cfg = _parse("--config", str(path), "--health-interval", "1")
    assert cfg.decode[1] == DecodeSpec("http://d1:8200", "http://d1:7000")
    assert cfg.state == "redis://localhost:6379/1"
    assert cfg.health_interval == 1 and cfg.max_conversations == 10


@pytest.mark.parametrize(("argv", "message"), [
    ([], "at least one prefill and one decode"),
    (["--prefill", P], "at least one prefill and one decode"),
    (["--prefill", "prefill:8100", "--decode", D], "must look like http://host:port"),
    (["--prefill", "http://p:", "--decode", D], "must look like http://host:port"),
    (["--prefill", P, "--decode", f"{D},ctl=http://x:1"], "unknown option 'ctl=http://x:1'"),
    (["--prefill", P, "--prefill", P, "--decode", D], "listed twice"),
    (["--prefill", P, "--decode", D, "--prefill-timeout", "0"],
     "prefill_timeout must be a positive number"),
    (["--prefill", P, "--decode", D, "--state", "postgres://x"], "Redis URL"),
    (["--prefill", P, "--decode", D, "--max-conversations", "0"], "whole number >= 1"),
])
def test_bad_settings_say_what_is_wrong(argv: list[str], message: str) -> None:
    with pytest.raises(RouterConfigError, match=message.replace("(", r"\(")):
        _parse(*argv)


def test_unknown_file_settings_are_named(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"prefill": [P], "decode": [D], "prefil_timeout": 3}))
    with pytest.raises(RouterConfigError, match=r"unknown router setting.*prefil_timeout"):
        _parse("--config", str(path))
    path.write_text("{not json")
    with pytest.raises(RouterConfigError, match="not valid JSON"):
        _parse("--config", str(path))


def test_the_startup_summary_masks_secrets() -> None:
    cfg = RouterConfig(prefill=(P,), decode=(DecodeSpec(D, "http://decode:8201"),),
                       state="redis://user:secret@redis:6379/0", backend_api_key="sk-1",
                       control_secret="control-secret-1234")
    summary = cfg.summary()
    assert ":secret@" not in str(summary) and "sk-1" not in str(summary)
    assert "control-secret-1234" not in str(summary) and "control-secret-1234" not in repr(cfg)
    assert summary["control_secret"] == "***"
    assert summary["state"] == "redis://user:***@redis:6379/0"
    assert summary["decode"] == "http://decode:8200(control=http://decode:8201)"


def test_the_public_names_resolve_lazily() -> None:
    import kvturn_server.router as router

    assert sorted(router.__all__) == sorted(router._WHERE)
    for name in router.__all__:
        assert getattr(router, name) is not None
