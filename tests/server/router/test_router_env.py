"""Every router setting from a ``KVTURN_<FLAG>`` environment variable: flags win over
variables, variables over the config file; bad values fail as their flags do."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvturn_server.router import RouterConfig, RouterConfigError, add_router_args
from kvturn_server.router._flags import env_name, router_config_from_args

ROOT = Path(__file__).resolve().parents[3]


def _config(argv: list[str], env: dict[str, str]) -> RouterConfig:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    return router_config_from_args(parser.parse_args(argv), env)


def _flags() -> list[str]:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    return [o for a in parser._actions for o in a.option_strings
            if o.startswith("--") and not o.startswith("--no-") and o != "--help"]


def test_every_flag_has_its_variable() -> None:
    config = _config([], {
        "KVTURN_PREFILL": "http://p0:8100  http://p1:8100",
        "KVTURN_DECODE": "http://d0:8200,control=http://d0:9201 http://d1:8200",
        "KVTURN_PORT": "9000", "KVTURN_HEALTH_INTERVAL": "1.5", "KVTURN_EJECT_AFTER": "7",
        "KVTURN_PREFILL_POLICY": "round-robin", "KVTURN_KV_REUSE": "false",
        "KVTURN_STATE": "redis://r:6379/1", "KVTURN_BACKEND_API_KEY": "sk-x",
        "KVTURN_LOG_FORMAT": "json", "KVTURN_DRAIN_GRACE": "5", "KVTURN_OTEL": "no",
        "KVTURN_HOST": "0.0.0.0"})
    assert config.prefill == ("http://p0:8100", "http://p1:8100")
    assert [(d.url, d.control) for d in config.decode] == [
        ("http://d0:8200", "http://d0:9201"), ("http://d1:8200", "http://d1:8201")]
    assert (config.port, config.health_interval, config.eject_after) == (9000, 1.5, 7)
    assert config.prefill_policy == "round-robin" and config.kv_reuse is False
    assert config.state == "redis://r:6379/1" and config.backend_api_key == "sk-x"
    assert (config.log_format, config.drain_grace, config.otel, config.host) == (
        "json", 5.0, False, "0.0.0.0")
    # Every flag the parser has is covered (--config and the control secret file included;
    # --print-settings-table is an action, not a setting).
    covered = {"config", "control_secret_file", "print_settings_table"} | set(
        name for name in RouterConfig.__dataclass_fields__)
    assert {f[2:].replace("-", "_") for f in _flags()} <= covered
    assert env_name("prefill_policy") == "KVTURN_PREFILL_POLICY"


def test_flags_win_over_variables_and_variables_over_the_file(tmp_path: Path) -> None:
    file = tmp_path / "router.toml"
    file.write_text('prefill = ["http://file:1"]\ndecode = ["http://file:2"]\n'
                    'health_interval = 9.0\nretry_after = 4.0\n')
    config = _config(["--health-interval", "3"], {
        "KVTURN_CONFIG": str(file), "KVTURN_HEALTH_INTERVAL": "2", "KVTURN_RETRY_AFTER": "2",
        "KVTURN_PREFILL": "http://env:1"})
    assert config.health_interval == 3.0 and config.retry_after == 2.0
    assert config.prefill == ("http://env:1",) and config.decode[0].url == "http://file:2"
    # An empty variable counts as unset.
    config = _config(["--prefill", "http://a:1", "--decode", "http://b:2"],
                     {"KVTURN_RETRY_AFTER": ""})
    assert config.retry_after == RouterConfig.__dataclass_fields__["retry_after"].default


@pytest.mark.parametrize(("name", "value", "message"), [
    ("KVTURN_HEALTH_INTERVAL", "soon", "KVTURN_HEALTH_INTERVAL (as --health-interval): "
                                       "invalid float value: 'soon'"),
    ("KVTURN_PORT", "80a", "KVTURN_PORT (as --port): invalid int value: '80a'"),
    ("KVTURN_PREFILL_POLICY", "random", "invalid choice: 'random' (choose from kv-aware"),
    ("KVTURN_KV_REUSE", "maybe", "KVTURN_KV_REUSE (as --kv-reuse): expected true or false"),
    ("KVTURN_HEALTH_INTERVAL", "-1", "health_interval must be a positive number"),
    ("KVTURN_DECODE", "ftp://d:1", "decode URL must look like http://host:port"),
])
def test_bad_values_fail_clearly(name: str, value: str, message: str) -> None:
    env = {"KVTURN_PREFILL": "http://p:1", "KVTURN_DECODE": "http://d:2", name: value}
    with pytest.raises(RouterConfigError) as caught:
        _config([], env)
    assert message in str(caught.value)


def test_the_control_secret_variables_still_work(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 32 + "\n")
    args = ["--prefill", "http://p:1", "--decode", "http://d:2"]
    assert _config(args, {"KVTURN_CONTROL_SECRET": "t" * 32}).control_secret == "t" * 32
    assert _config(args, {"KVTURN_CONTROL_SECRET_FILE": str(secret),
                          "KVTURN_CONTROL_SECRET": "t" * 32}).control_secret == "s" * 32


def test_the_cli_reports_a_bad_variable_in_one_line() -> None:
    # The router imports the SDK's wire words (kvturn.wire): this tree's, not an installed copy.
    env = {"PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("server", "sdk")),
           "KVTURN_PREFILL": "http://p:1",
           "KVTURN_DECODE": "http://d:2", "KVTURN_EJECT_AFTER": "three"}
    done = subprocess.run([sys.executable, "-m", "kvturn_server.router"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == ("kvturn router: KVTURN_EJECT_AFTER (as --eject-after): "
                                   "invalid int value: 'three'")


def test_a_variable_is_not_read_when_its_flag_is_given() -> None:
    # Kubernetes' service links: a Service named "kvturn" gives every pod KVTURN_PORT=tcp://...
    env = {"KVTURN_PORT": "tcp://10.0.0.1:8000", "KVTURN_PREFILL": "http://p:1",
           "KVTURN_DECODE": "http://d:2"}
    assert _config(["--port", "8000"], env).port == 8000
    with pytest.raises(RouterConfigError, match="KVTURN_PORT"):
        _config([], env)
