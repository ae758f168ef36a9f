"""The ``kvturn router`` flags and ``KVTURN_*`` variables, and the config they build.

Both are built from ``RouterConfig``'s fields (``kvturn_server._settings``): a flag per
setting, named after it (``prefill_policy`` -> ``--prefill-policy``), and a variable per
flag (``KVTURN_PREFILL_POLICY``). Precedence: a flag over its variable, a variable over the
config file (``--config``), the file over ``RouterConfig``'s defaults (``_config.py``). Every
flag defaults to None so that the file can supply the value.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from kvturn_server import _settings
from kvturn_server._control_secret import ENV, ENV_FILE
from kvturn_server.router._config import RouterConfig, RouterConfigError, load_config_file

ENV_PREFIX = "KVTURN_"

# The control secret's two variables keep their own rule (router_config_from_args): they apply
# only when the config file names no secret.
SECRET_SETTINGS = ("control_secret", "control_secret_file")


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """The ``kvturn router`` flags; build the config with :func:`router_config_from_args`."""
    # No abbreviations: "--control-secret X" must not be read as --control-secret-file X (the
    # "cannot read file" error would print the secret).
    parser.allow_abbrev = False
    parser.add_argument(
        "--config", type=Path, default=None, metavar="PATH",
        help="TOML (or .json) file of router settings, by field name (prefill, decode, state, "
             "health_interval, ...); flags override it")
    _settings.add_setting_args(parser, RouterConfig)
    parser.add_argument(
        "--print-settings-table", action=_PrintTable, nargs=0, default=argparse.SUPPRESS,
        help="print every setting (flag, variable, default, meaning) as the Markdown table of "
             "docs/router-operations.md, and exit")
    parser.epilog = ENV_EPILOG
    if parser.formatter_class is argparse.HelpFormatter:
        parser.formatter_class = argparse.RawDescriptionHelpFormatter


def settings_table() -> str:
    """The router's settings as a Markdown table (docs/router-operations.md holds a copy)."""
    return _settings.markdown_table(RouterConfig, env_prefix=ENV_PREFIX)


class _PrintTable(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        sys.stdout.write(settings_table())
        parser.exit()


ENV_EPILOG = """\
environment:
  Every setting can also come from a KVTURN_<FLAG> variable: the flag's name in capitals,
  dashes as underscores (--prefill-policy -> KVTURN_PREFILL_POLICY, --health-interval ->
  KVTURN_HEALTH_INTERVAL, --config -> KVTURN_CONFIG). A flag wins over its variable, a
  variable over the config file. Lists are separated by spaces:
  KVTURN_PREFILL="http://p0:8100 http://p1:8100",
  KVTURN_DECODE="http://d0:8200,control=http://d0:9201 http://d1:8200".
  Switches take true/false (also 1/0, yes/no, on/off): KVTURN_KV_REUSE=false.
  Secrets: KVTURN_CONTROL_SECRET or KVTURN_CONTROL_SECRET_FILE, KVTURN_BACKEND_API_KEY.

discovery:
  A backend given as dns+http://NAME:PORT stands for every address NAME resolves to (a
  Kubernetes headless Service), resolved again every --discovery-interval seconds: new
  addresses join the pool, vanished ones get no new turns and finish what they serve.
  A discovered decode's control endpoint: ,control=dns+http://NAME:PORT (default PORT+1).

shutdown:
  On SIGTERM /ready answers 503 at once; requests are still served for --drain-grace
  seconds, then the router stops accepting and gives in-flight requests and streams up to
  --drain-timeout seconds. A second signal skips the grace.
"""


def env_name(setting: str) -> str:
    """``prefill_policy`` -> ``KVTURN_PREFILL_POLICY`` (the flag ``--prefill-policy``)."""
    return _settings.env_name(ENV_PREFIX, setting)


def flag_settings() -> list[str]:
    """The settings that have a flag."""
    return [f.name for f, meta in _settings.settings_of(RouterConfig) if meta.flag]


def settings_from_env(environ: Mapping[str, str],
                      skip: Collection[str] = ()) -> dict[str, Any]:
    """The settings given as ``KVTURN_*`` variables (empty ones count as unset), read as
    their flags read them; RouterConfigError naming the variable when one cannot be.

    Settings in ``skip`` (given as flags, which win) are not read at all: a variable that
    merely shares a name must not stop a router whose flag says otherwise (Kubernetes sets
    ``KVTURN_PORT=tcp://...`` in every pod of a namespace with a Service named ``kvturn``)."""
    return _settings.settings_from_env(
        RouterConfig, environ, ENV_PREFIX, error=RouterConfigError,
        skip={*skip, *SECRET_SETTINGS})


def router_config_from_args(args: argparse.Namespace,
                            environ: Mapping[str, str] | None = None) -> RouterConfig:
    """The config from ``add_router_args`` flags (and ``--config``), the control secret from
    the environment when neither names one; RouterConfigError with a one-line reason when it
    is not usable."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    config_file = getattr(args, "config", None)
    if config_file is None and environ.get(env_name("config")):
        config_file = Path(environ[env_name("config")])
    if config_file is not None:
        values.update(_settings.rename_aliases(
            RouterConfig, load_config_file(config_file), where=f"router config {config_file}",
            error=RouterConfigError))
    flags = {name: getattr(args, name, None) for name in flag_settings()}
    values.update(settings_from_env(
        environ, skip={name for name, value in flags.items() if value is not None}))
    for name, value in flags.items():
        if value is not None:
            values[name] = tuple(value) if isinstance(value, list) else value
    if "control_secret" not in values and "control_secret_file" not in values:
        if environ.get(ENV_FILE):
            values["control_secret_file"] = environ[ENV_FILE]
        elif environ.get(ENV):
            values["control_secret"] = environ[ENV]
    return RouterConfig.from_mapping(values)
