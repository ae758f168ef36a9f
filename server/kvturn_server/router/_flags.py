"""The ``kvturn router`` flags and ``KVTURN_*`` variables, and the config they build.

Precedence: a flag over its variable, a variable over the config file (``--config``), the
file over ``RouterConfig``'s defaults (``_config.py``). Every flag defaults to None so that
the file can supply the value.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from kvturn_server._control_secret import ENV, ENV_FILE
from kvturn_server.router._config import (
    LOG_LEVELS,
    PREFILL_POLICIES,
    RouterConfig,
    RouterConfigError,
    load_config_file,
)

_D = RouterConfig.__dataclass_fields__

_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("prefill_timeout", float, "seconds for a whole prefill leg; then it is retried once on "
                               "another prefill, then the decode computes the prompt itself"),
    ("connect_timeout", float, "seconds to connect to a backend"),
    ("decode_timeout", float, "seconds the decode may stay silent (reply head, between "
                              "stream chunks, or a whole non-streaming reply)"),
    ("control_timeout", float, "seconds for a control-endpoint call (pin, unpin, describe, "
                               "keepalive, release)"),
    ("pin_ttl", float, "seconds a pin holds the retention being read (default: "
                       "prefill-timeout + 10)"),
    ("health_interval", float, "seconds between active health checks"),
    ("health_timeout", float, "seconds a health check may take"),
    ("eject_after", int, "consecutive failures that eject a backend"),
    ("readmit_after", int, "consecutive good health checks that re-admit it"),
    ("state_prefix", str, "prefix of the router's Redis keys"),
    ("max_conversations", int, "conversation table cap (least recently used go first)"),
    ("retention_ttl", float, "lease seconds assumed when a decode reports none"),
    ("remember_expired", float, "seconds an expired conversation is remembered (so its next "
                                "turn reports 'expired', not 'miss')"),
    ("retry_after", float, "Retry-After seconds on transient errors"),
    ("drain_timeout", float, "seconds shutdown waits for in-flight requests and streams"),
    ("drain_grace", float, "seconds after SIGTERM during which /ready answers 503 and new "
                           "requests are still served, before the shutdown starts (give "
                           "load balancers time to take the router out of rotation)"),
    ("discovery_interval", float, "seconds between two DNS resolutions of dns+http:// "
                                  "backends"),
    ("max_body_bytes", int, "largest request body accepted (413 as soon as more has "
                            "arrived, chunked or not)"),
    ("body_timeout", float, "seconds a client has to send a whole request body (then 408 "
                            "and the connection is closed)"),
    ("backend_api_key", str, "API key sent to the backends (vLLM --api-key)"),
    ("prefill_affinity_slack", int, "requests in flight the prefill holding a conversation "
                                    "may have beyond the least loaded one before kv-aware "
                                    "placement sends its turn elsewhere"),
    ("decode_affinity_slack", int, "requests in flight the decode retaining a conversation "
                                   "may have beyond the least loaded decode before its turn "
                                   "decodes elsewhere"),
    ("decode_continue_tokens", int, "a turn whose holding decode lacks at most about this "
                                    "many prompt tokens runs on that decode alone (no "
                                    "prefill leg, no transfer); 0: never"),
    ("decode_continue_budget", int, "estimated prompt tokens of such turns one decode may "
                                    "compute at once (protects its other requests' "
                                    "inter-token latency)"),
    ("conditional_disagg", int, "with --no-kv-reuse: stock conditional disaggregation (the "
                                "baseline: llm-d's prefix-based-pd-decider, Dynamo's "
                                "--router-conditional-disagg): a turn whose uncached part on "
                                "the decode that served the conversation is at most about "
                                "this many tokens runs on that decode alone; 0: plain stock "
                                "P/D"),
    ("min_read_tokens", int, "pin a retention for a prefill leg only when at least this many "
                             "of its tokens are beyond what that prefill holds"),
    ("responses_ttl", float, "seconds a stored /v1/responses response can be continued by "
                             "previous_response_id"),
    ("max_responses", int, "stored /v1/responses responses kept (least recently used go "
                           "first)"),
    ("responses_max_bytes", int, "total bytes of stored responses kept (in-memory state)"),
)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """The ``kvturn router`` flags; build the config with :func:`router_config_from_args`."""
    # No abbreviations: "--control-secret X" must not be read as --control-secret-file X (the
    # "cannot read file" error would print the secret).
    parser.allow_abbrev = False
    parser.add_argument(
        "--config", type=Path, default=None, metavar="PATH",
        help="TOML (or .json) file of router settings, by field name (prefill, decode, state, "
             "health_interval, ...); flags override it")
    parser.add_argument("--prefill", action="append", default=None, metavar="URL",
                        help="prefill vLLM base URL (repeatable)")
    parser.add_argument(
        "--decode", action="append", default=None, metavar="URL[,control=URL]",
        help="decode vLLM base URL (repeatable). Its connector's control endpoint defaults to "
             "the same scheme and host on the next port (http://h:8200 -> http://h:8201); "
             "give another with ,control=URL")
    parser.add_argument("--host", default=None, help=f"default: {_D['host'].default}")
    parser.add_argument("--port", type=int, default=None, metavar="N",
                        help=f"default: {_D['port'].default}")
    parser.add_argument(
        "--state", default=None, metavar="memory|redis://HOST:PORT/DB",
        help="where conversations live: in this process (default), or in Redis, shared by "
             "replicas and kept across restarts")
    for name, type_, text in _FLAGS:
        default = _D[name].default
        shown = "" if name in ("pin_ttl", "backend_api_key") else f" (default: {default})"
        metavar = {float: "SECONDS", int: "N"}.get(type_, name.rsplit("_", 1)[-1].upper())
        parser.add_argument(f"--{name.replace('_', '-')}", type=type_, default=None,
                            metavar=metavar, help=text + shown)
    parser.add_argument(
        "--prefill-policy", choices=PREFILL_POLICIES, default=None,
        help="how a turn's prefill is chosen: kv-aware (default: the one holding the "
             "conversation unless it is busier, then the least loaded, and the decode supplies "
             "what it lacks), affinity (session affinity), least-loaded, round-robin")
    parser.add_argument(
        "--kv-reuse", action=argparse.BooleanOptionalAction, default=None,
        help="keep conversations' KV on the decodes and reuse it (default); --no-kv-reuse "
             "runs stock P/D (ids then only give affinity)")
    parser.add_argument(
        "--follow-evictions", action=argparse.BooleanOptionalAction, default=None,
        help="follow each decode's evicted and expired retentions (a long poll on its control "
             "endpoint) and mark the records naming them lost, so that their next turns take "
             "a prefill instead of continuing on a decode that holds nothing (default: on)")
    parser.add_argument(
        "--control-secret-file", default=None, metavar="PATH",
        help="file holding the decodes' control API secret (default: $KVTURN_CONTROL_SECRET_FILE, "
             "else $KVTURN_CONTROL_SECRET, else none); the secret itself is never a flag")
    parser.add_argument("--http-client", choices=("pooled", "httpx"), default=None,
                        help="backend HTTP transport (default: pooled)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                        help="default: info (one line per request at debug)")
    parser.add_argument("--log-format", choices=("text", "json"), default=None,
                        help="default: text (key=value)")
    parser.add_argument(
        "--otel", action=argparse.BooleanOptionalAction, default=None,
        help="export an OpenTelemetry span per backend leg (pin, prefill, decode, capture) "
             "over OTLP/HTTP, configured by the standard OTEL_* variables (needs "
             "pip install 'kvturn[otel]'); W3C traceparent is passed to the backends "
             "either way")
    parser.epilog = ENV_EPILOG
    if parser.formatter_class is argparse.HelpFormatter:
        parser.formatter_class = argparse.RawDescriptionHelpFormatter


ENV_PREFIX = "KVTURN_"

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


def _env_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _choice(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"invalid choice: {text!r} (choose from {', '.join(choices)})")
        return text
    return parse


# Setting -> how its KVTURN_* variable's text is read (the flag's own type). The control
# secret's two variables keep their own rule (below): they apply only when the config file
# names no secret.
_ENV_SETTINGS: dict[str, Any] = {
    "prefill": str.split, "decode": str.split, "host": str, "port": int, "state": str,
    "prefill_policy": _choice(PREFILL_POLICIES), "kv_reuse": _env_bool,
    "follow_evictions": _env_bool,
    "http_client": _choice(("pooled", "httpx")),
    "log_level": _choice(LOG_LEVELS), "log_format": _choice(("text", "json")),
    "otel": _env_bool, **{name: type_ for name, type_, _ in _FLAGS},
}


def env_name(setting: str) -> str:
    """``prefill_policy`` -> ``KVTURN_PREFILL_POLICY`` (the flag ``--prefill-policy``)."""
    return ENV_PREFIX + setting.upper()


def settings_from_env(environ: Mapping[str, str],
                      skip: Collection[str] = ()) -> dict[str, Any]:
    """The settings given as ``KVTURN_*`` variables (empty ones count as unset), read as
    their flags read them; RouterConfigError naming the variable when one cannot be.

    Settings in ``skip`` (given as flags, which win) are not read at all: a variable that
    merely shares a name must not stop a router whose flag says otherwise (Kubernetes sets
    ``KVTURN_PORT=tcp://...`` in every pod of a namespace with a Service named ``kvturn``)."""
    values: dict[str, Any] = {}
    for name, convert in _ENV_SETTINGS.items():
        if name in skip:
            continue
        text = environ.get(env_name(name), "")
        if not text.strip():
            continue
        try:
            value = convert(text.strip())
        except ValueError as exc:
            detail = (f"invalid {convert.__name__} value: {text!r}"
                      if convert in (int, float) else str(exc))
            raise RouterConfigError(
                f"{env_name(name)} (as --{name.replace('_', '-')}): {detail}") from exc
        values[name] = tuple(value) if isinstance(value, list) else value
    return values


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
        values.update({k.replace("-", "_"): v
                       for k, v in load_config_file(config_file).items()})
    flags = {name: getattr(args, name, None) for name in (*_ENV_SETTINGS, "control_secret_file")}
    values.update(settings_from_env(
        environ, skip={name for name, value in flags.items() if value is not None}))
    for name, value in flags.items():
        if value is not None:
            values[name] = tuple(value) if name in ("prefill", "decode") else value
    if "control_secret" not in values and "control_secret_file" not in values:
        if environ.get(ENV_FILE):
            values["control_secret_file"] = environ[ENV_FILE]
        elif environ.get(ENV):
            values["control_secret"] = environ[ENV]
    return RouterConfig.from_mapping(values)
