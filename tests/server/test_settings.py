"""One list per setting (issue 27): the settings dataclasses are the only list.

Every router setting has its flag, ``KVTURN_*`` variable, config-file key and docs row; every
connector key its check and docs row; the docs' tables are the generated ones; former names
still work, with a warning; the lease's defaults are one constant wherever they appear.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvturn_server import _settings, _settings_docs
from kvturn_server._defaults import (
    KEEPALIVES_PER_TTL,
    RETENTION_BUDGET,
    RETENTION_MAX_HOLD,
    RETENTION_TTL,
)
from kvturn_server._settings import DeprecatedSettingWarning, setting
from kvturn_server.cli import build_parser, main
from kvturn_server.connector import ConnectorConfig, RetentionTable
from kvturn_server.local import StackConfig
from kvturn_server.router import RouterConfig, RouterConfigError, add_router_args
from kvturn_server.router._flags import ENV_PREFIX, router_config_from_args, settings_from_env
from kvturn_server.sim import standard_policies

DOCS = Path(__file__).resolve().parents[2] / "docs"
P, D = "http://p:8100", "http://d:8200"
# A value each setting accepts, as a variable's text and as the value it gives; the rest take
# their default's text.
SAMPLES: dict[str, tuple[str, Any]] = {
    "prefill": ("http://p1:1 http://p2:1", ("http://p1:1", "http://p2:1")),
    "decode": ("http://d1:1", ("http://d1:1",)),
    "pin_ttl": ("7.5", 7.5),
    "backend_api_key": ("sk-test", "sk-test"),
    "kv_reuse": ("false", False),
    "otel": ("true", True),
    "follow_evictions": ("off", False),
    "control_secret": ("s" * 32, "s" * 32),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvturn router")
    add_router_args(parser)
    return parser


def _sample(f: dataclasses.Field[Any]) -> tuple[str, Any]:
    if f.name in SAMPLES:
        return SAMPLES[f.name]
    return str(f.default), f.default


def _doc_rows(page: str) -> set[str]:
    return set(re.findall(r"^\| `([a-z_0-9]+)` \|", (DOCS / page).read_text(), re.MULTILINE))


ROUTER_SETTINGS = [f for f, _ in _settings.settings_of(RouterConfig)]


def test_every_router_field_is_a_documented_setting() -> None:
    assert [f.name for f in dataclasses.fields(RouterConfig)] == [
        f.name for f in ROUTER_SETTINGS]
    for f, meta in _settings.settings_of(RouterConfig):
        assert meta.doc and meta.doc[0].islower(), f.name


@pytest.mark.parametrize("f", ROUTER_SETTINGS, ids=lambda f: f.name)
def test_every_router_setting_has_a_flag_a_variable_a_key_and_a_docs_row(
        f: dataclasses.Field[Any], tmp_path: Path) -> None:
    meta = f.metadata[_settings.SETTING]
    text, value = _sample(f)
    if f.name == "control_secret_file":
        value = str(tmp_path / "secret")
        Path(value).write_text("s" * 32)
    variable = ENV_PREFIX + f.name.upper()
    # the config file's key
    got = getattr(RouterConfig.from_mapping({"prefill": [P], "decode": [D], f.name: value}),
                  f.name)
    assert (tuple(d.url for d in got) if f.name == "decode" else got) == value
    # the flag, documented in --help
    options = {o for a in _parser()._actions for o in a.option_strings}
    if meta.flag:
        assert f"--{f.name.replace('_', '-')}" in options
    else:
        assert f.name == "control_secret"  # the one setting that is never a flag
        assert f"--{f.name.replace('_', '-')}" not in options
    # the variable: KVTURN_<NAME> (the secret's two read by their own rule, tested in
    # test_router_env.py)
    if f.name not in ("control_secret", "control_secret_file"):
        assert settings_from_env({variable: text}) == {f.name: value}
        config = router_config_from_args(_parser().parse_args([]), {
            "KVTURN_PREFILL": P, "KVTURN_DECODE": D, variable: text})
        got = getattr(config, f.name)
        assert (tuple(d.url for d in got) if f.name == "decode" else got) == value
    # the docs row
    assert f.name in _doc_rows("router-operations.md")


def test_every_connector_key_is_checked_and_documented() -> None:
    rows = _doc_rows("connector.md")
    for f, meta in _settings.settings_of(ConnectorConfig):
        assert meta.doc and meta.check is not None, f.name
        assert f.name in rows
        if f.default is not None:
            assert getattr(ConnectorConfig.from_extra({f.name: f.default}), f.name) == \
                f.default
    assert len(list(_settings.settings_of(ConnectorConfig))) == \
        len(dataclasses.fields(ConnectorConfig))


def test_the_docs_hold_the_generated_tables() -> None:
    assert _settings_docs.stale() == [], \
        "regenerate them: python -m kvturn_server._settings_docs"


def test_the_router_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["router", "--print-settings-table"])
    assert done.value.code == 0
    assert capsys.readouterr().out == _settings_docs.TABLES["router"][1]()


def test_help_shows_each_default_and_doc(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "retention_ttl" not in out  # flags, not field names
    assert "--retention-ttl SECONDS lease seconds assumed" in out
    assert f"(default: {RETENTION_TTL:.0f} s)" in out
    assert "(default: prefill-timeout + 10 s)" in out


def test_a_stale_table_is_found_and_rewritten(tmp_path: Path) -> None:
    for page in ("router-operations.md", "connector.md"):
        (tmp_path / page).write_text((DOCS / page).read_text().replace(
            "| `retention_ttl` |", "| `retention_tll` |"))
    assert _settings_docs.stale(tmp_path) == [
        "router-operations.md: the router settings table differs from the code"]
    _settings_docs.stale(tmp_path, write=True)
    assert _settings_docs.stale(tmp_path) == []
    assert (tmp_path / "router-operations.md").read_text() == \
        (DOCS / "router-operations.md").read_text()


# -- former names ------------------------------------------------------------------------------


class _Error(ValueError):
    pass


@dataclass(frozen=True)
class _Renamed:
    retention_ttl: float = field(default=RETENTION_TTL, metadata=setting(
        "the lease", unit="s", aliases=("lease_ttl",)))
    reuse: bool = field(default=True, metadata=setting("reuse", aliases=("kv_reuse",)))


def test_a_former_flag_still_works_with_a_warning() -> None:
    parser = argparse.ArgumentParser()
    _settings.add_setting_args(parser, _Renamed)
    assert parser.parse_args([]).retention_ttl is None
    with pytest.warns(DeprecatedSettingWarning, match="--lease-ttl is deprecated, use "
                                                      "--retention-ttl"):
        args = parser.parse_args(["--lease-ttl", "60"])
    with pytest.warns(DeprecatedSettingWarning, match="--no-kv-reuse is deprecated, use "
                                                      "--no-reuse"):
        assert parser.parse_args(["--no-kv-reuse"]).reuse is False
    assert args.retention_ttl == 60.0
    with pytest.warns(DeprecatedSettingWarning):
        assert parser.parse_args(["--kv-reuse"]).reuse is True
    assert "--lease-ttl" not in parser.format_usage()  # hidden, but named by the new flag
    assert "formerly --lease-ttl, still read" in " ".join(parser.format_help().split())


def test_a_former_variable_and_file_key_still_work_with_a_warning() -> None:
    with pytest.warns(DeprecatedSettingWarning, match="KVTURN_LEASE_TTL is deprecated, use "
                                                      "KVTURN_RETENTION_TTL"):
        assert _settings.settings_from_env(_Renamed, {"KVTURN_LEASE_TTL": "60"}, "KVTURN_",
                                           error=_Error) == {"retention_ttl": 60.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name alone: no warning
        assert _settings.settings_from_env(
            _Renamed, {"KVTURN_LEASE_TTL": "60", "KVTURN_RETENTION_TTL": "70"}, "KVTURN_",
            error=_Error) == {"retention_ttl": 70.0}
    with pytest.warns(DeprecatedSettingWarning, match="lease_ttl is deprecated"):
        assert _settings.rename_aliases(_Renamed, {"lease-ttl": 5}, where="x",
                                        error=_Error) == {"retention_ttl": 5}
    with pytest.raises(_Error, match="lease_ttl is the former name of retention_ttl"):
        _settings.rename_aliases(_Renamed, {"lease_ttl": 5, "retention_ttl": 6}, where="x",
                                 error=_Error)


def test_the_router_reads_former_file_keys() -> None:
    # RouterConfig has no former names yet; the mechanism is the one tested above.
    with pytest.raises(RouterConfigError, match="unknown router setting"):
        RouterConfig.from_mapping({"prefill": [P], "decode": [D], "lease_ttl": 5})


def test_the_simulators_former_flags_still_work(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    with pytest.warns(DeprecatedSettingWarning) as caught:
        args = parser.parse_args(["simulate", "--lease-ttl", "60", "--budget", "0.5",
                                  "--host-gib", "64"])
    assert (args.retention_ttl, args.retention_budget, args.kv_offload_gib) == (60, 0.5, 64)
    assert [str(w.message).split(" is ")[0] for w in caught] == [
        "--lease-ttl", "--budget", "--host-gib"]
    args = parser.parse_args(["simulate"])
    assert (args.retention_ttl, args.retention_budget) == (RETENTION_TTL, RETENTION_BUDGET)
    # a command line's user gets one plain line
    with _settings.plain_warnings("kvturn"), pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--lease-ttl", "60", "--help"])
    assert "kvturn: warning: --lease-ttl is deprecated, use --retention-ttl" in \
        capsys.readouterr().err


# -- one constant per default ------------------------------------------------------------------


def test_the_lease_defaults_are_one_constant() -> None:
    connector = ConnectorConfig()
    assert connector.decoder_kv_blocks_ttl == RETENTION_TTL
    assert connector.retention_max_hold == RETENTION_MAX_HOLD
    assert connector.retention_budget == RETENTION_BUDGET
    assert RouterConfig(prefill=(P,), decode=(D,)).retention_ttl == RETENTION_TTL  # type: ignore[arg-type]
    table = RetentionTable(budget_blocks=1)
    assert (table.ttl, table.max_hold) == (RETENTION_TTL, RETENTION_MAX_HOLD)
    stack = StackConfig()
    assert (stack.decoder_kv_blocks_ttl, stack.retention_max_hold, stack.retention_budget) == (
        RETENTION_TTL, RETENTION_MAX_HOLD, RETENTION_BUDGET)
    lease = standard_policies()["kvturn-lease"]
    assert (lease.ttl_s, lease.max_hold_s, lease.budget) == (
        RETENTION_TTL, RETENTION_MAX_HOLD, RETENTION_BUDGET)
    assert lease.keepalive_s == RETENTION_TTL / KEEPALIVES_PER_TTL
    up = build_parser().parse_args(["up"])
    assert (up.retention_ttl, up.retention_budget, up.kv_read_timeout) == (
        RETENTION_TTL, RETENTION_BUDGET, connector.kv_read_timeout)
