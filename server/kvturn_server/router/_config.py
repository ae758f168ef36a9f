"""Router settings: one dataclass, validated when built, from a mapping or a config file.

``kvturn router --config router.toml --decode http://d2:8200`` reads the file first, then lets
flags and ``KVTURN_*`` variables override it (``_flags.py``). The file (TOML, or JSON when it
ends in ``.json``) uses the field names below; backends are lists:

.. code-block:: toml

    prefill = ["http://p0:8100", "http://p1:8100"]
    decode = ["http://d0:8200", {url = "http://d1:8200", control = "http://d1:9201"}]
    state = "redis://redis:6379/0"
    health_interval = 2.0

A decode's control URL (its connector's control endpoint) defaults to the decode's scheme and
host on its port + 1.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvturn_server._control_secret import (
    ControlSecretError,
    check_secret,
    read_secret_file,
)


class RouterConfigError(ValueError):
    """A setting the router cannot run with; the message says which and why."""


@dataclass(frozen=True, slots=True)
class DecodeSpec:
    """A decode vLLM instance: its OpenAI base URL and its connector's control URL."""

    url: str
    control: str

    @classmethod
    def parse(cls, text: str) -> DecodeSpec:
        """``URL`` or ``URL,control=URL``; the control URL defaults to port + 1."""
        url, *options = (part.strip() for part in text.split(","))
        url = _base_url(url, "decode")
        control: str | None = None
        for option in options:
            name, sep, value = option.partition("=")
            if name != "control" or not sep:
                raise RouterConfigError(
                    f"decode {text!r}: unknown option {option!r} (the form is "
                    "URL[,control=URL])")
            control = _base_url(value, "decode control")
        if control is not None:
            _same_discovery(url, control)
        return cls(url, control or default_control_url(url))

    @property
    def discovered(self) -> bool:
        """Whether this entry names a DNS name to resolve rather than one instance."""
        return self.url.startswith(DNS_PREFIX)


def _same_discovery(url: str, control: str) -> None:
    """A discovered decode's control endpoint is on each of its addresses: the control URL
    names the same DNS name (only its scheme and port are used)."""
    if url.startswith(DNS_PREFIX) != control.startswith(DNS_PREFIX) or (
            url.startswith(DNS_PREFIX) and urlsplit(url).hostname != urlsplit(control).hostname):
        raise RouterConfigError(
            f"decode {url}: a dns+ decode's control URL is dns+ on the same name (e.g. "
            f"control=dns+http://NAME:9201), and a plain decode's is plain; got {control}")


def default_control_url(url: str) -> str:
    """Same scheme and host, port + 1 (the local stack's convention)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port + 1}"


# A backend URL with this scheme prefix names a DNS name whose every address is a backend
# (a Kubernetes headless Service), re-resolved every ``discovery_interval`` (``_discovery.py``).
DNS_PREFIX = "dns+"


def _base_url(url: str, what: str) -> str:
    url = url.strip().rstrip("/")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise RouterConfigError(f"{what} URL {url!r}: {exc}") from exc
    scheme = parts.scheme.removeprefix(DNS_PREFIX)
    if scheme not in ("http", "https") or not parts.hostname or parts.netloc.endswith(":"):
        raise RouterConfigError(
            f"{what} URL must look like http://host:port (or https://, or dns+http://name:port "
            f"for every address of a DNS name), got {url!r}")
    if parts.scheme.startswith(DNS_PREFIX) and parts.port is None:
        raise RouterConfigError(f"{what} URL {url!r}: a dns+ URL needs a port")
    if parts.query or parts.fragment:
        raise RouterConfigError(f"{what} URL {url!r} must not have a query or fragment")
    return url


LOG_LEVELS = ("debug", "info", "warning", "error")
PREFILL_POLICIES = ("kv-aware", "affinity", "least-loaded", "round-robin")


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens, which backends it uses, and how long it waits for them.

    Attributes:
        prefill: base URLs of prefill vLLM instances (``http://host:port``).
        decode: decode instances; plain URLs are accepted and get the default control URL.
        host, port: where the router listens.
        prefill_timeout: seconds for a whole prefill leg; a leg past it is retried once on
            another prefill, then the decode computes the prompt itself.
        connect_timeout: seconds to open a connection to any backend.
        decode_timeout: seconds the decode may stay silent: for the reply head and between
            stream chunks, or for a whole non-streaming reply.
        control_timeout: seconds for a control-endpoint call (pin, unpin, describe, keepalive,
            release). Past it there is no reuse for that turn; the turn itself goes on.
        pin_ttl: seconds a pin holds a retention's blocks; must cover the prefill leg
            (default: prefill_timeout + 10).
        health_interval: seconds between active health checks of every backend.
        health_timeout: seconds a health check may take.
        eject_after: consecutive failures (checks or legs) that eject a backend.
        readmit_after: consecutive successful checks that re-admit an ejected backend.
        state: ``memory`` (default, per process) or ``redis://host:port/db`` (shared by
            router replicas and kept across restarts; also ``rediss://``, ``unix://``).
        state_prefix: prefix of every Redis key the router writes.
        max_conversations: table cap; past it the least recently used conversation goes.
        retention_ttl: lease seconds assumed when a decode reports a retention without
            ``expires_in``.
        remember_expired: seconds a conversation stays in the table after its lease ran out,
            so that its next turn reports ``expired`` rather than ``miss``.
        retry_after: seconds clients are told to wait on transient errors (``Retry-After``).
        drain_timeout: seconds a shutdown waits for in-flight requests and streams.
        drain_grace: seconds between SIGTERM and the start of that shutdown, during which
            ``/ready`` answers 503 (so that load balancers take the router out of rotation)
            while new requests are still served; 0 (default) shuts down at once.
        discovery_interval: seconds between two resolutions of the ``dns+http://`` backends
            (``_discovery.py``): new addresses join their pool, vanished ones are drained.
        otel: export an OpenTelemetry span per backend leg over OTLP (``_tracing.py``; needs
            the ``kvturn[otel]`` extra; the exporter reads the standard ``OTEL_*``
            variables, e.g. ``OTEL_EXPORTER_OTLP_ENDPOINT``).
        max_body_bytes: largest request body accepted; a body is refused (413) as soon as
            this many bytes have arrived, declared or chunked.
        body_timeout: seconds a client has to send a request's whole body; past it the
            router answers 408 and closes the connection.
        backend_api_key: sent as ``Authorization: Bearer`` to every backend, if set.
        control_secret: the decodes' control API secret (``X-KVTurn-Control-Secret`` on every
            control call); from a config file or ``KVTURN_CONTROL_SECRET``, never a flag.
        control_secret_file: a file holding it (``--control-secret-file``,
            ``KVTURN_CONTROL_SECRET_FILE``); read at start-up.
        http_client: ``pooled`` (the router's lean keep-alive transport) or ``httpx``
            (httpx2's default transport; slower, for comparison or odd networks).
        capture_attempts: how often the router asks a decode for a just-finished stream's
            retention before taking the answer it has (the decode retains at finish, which
            can trail the stream's last byte by a scheduler step).
        capture_retry_delay: seconds between those attempts.
        log_level, log_format: ``debug``..``error``; ``text`` or ``json`` lines.
        prefill_policy: how a turn's prefill is chosen (``_placement.py``): ``kv-aware``
            (default: the prefill that computed this conversation's last prefill leg, unless
            it is busier than the least loaded one by more than ``prefill_affinity_slack``),
            ``affinity`` (that prefill whenever it is healthy: session affinity),
            ``least-loaded`` or ``round-robin``.
        prefill_affinity_slack: requests in flight the holding prefill may have beyond the
            least loaded one before ``kv-aware`` sends the turn elsewhere.
        decode_affinity_slack: requests in flight the decode retaining a conversation may have
            beyond the least loaded decode before its turn's decode leg goes elsewhere.
        kv_reuse: False runs stock P/D: no pins, no retention on the decodes, no decode
            continuation; conversation ids still give affinity.
        decode_continue_tokens: a turn whose holding decode is estimated to lack at most this
            many prompt tokens is served by that decode alone, with no prefill leg and no
            transfer; 0 turns this off.
        decode_continue_budget: estimated prompt tokens of continued turns one decode may be
            computing at once; past it turns take the prefill path (protects the inter-token
            latency of the decode's other requests).
        follow_evictions: follow each decode's lost log (retentions it evicted or let
            expire: ``GET /kvturn/v1/lost``, a long poll) and mark the records naming them
            lost, so that their next turns take a prefill (``_lost.py``).
        conditional_disagg: with ``kv_reuse`` off, stock conditional disaggregation (the
            baseline kvturn is measured against: llm-d's prefix-based-pd-decider, Dynamo's
            conditional disaggregation; ``_placement.conditional_decode``): a turn whose
            estimated uncached part on the decode that served the conversation is at most
            this many tokens runs on that decode alone; 0 (default) is plain stock P/D.
        min_read_tokens: the router pins a retention for a prefill leg only when at least
            this many of its tokens are beyond what that prefill is known to hold.
        responses_ttl: seconds a stored Responses API response (``/v1/responses``) can be
            continued by ``previous_response_id`` after it was written.
        max_responses: stored responses kept (least recently used go first).
        responses_max_bytes: in-memory state only: total bytes of stored responses kept.
    """

    prefill: tuple[str, ...]
    decode: tuple[DecodeSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_timeout: float = 60.0
    connect_timeout: float = 5.0
    decode_timeout: float = 300.0
    control_timeout: float = 2.0
    pin_ttl: float | None = None
    health_interval: float = 5.0
    health_timeout: float = 2.0
    eject_after: int = 3
    readmit_after: int = 2
    state: str = "memory"
    state_prefix: str = "kvturn:"
    max_conversations: int = 100_000
    retention_ttl: float = 480.0
    remember_expired: float = 600.0
    retry_after: float = 1.0
    drain_timeout: float = 30.0
    drain_grace: float = 0.0
    discovery_interval: float = 10.0
    otel: bool = False
    max_body_bytes: int = 32 * 1024 * 1024
    body_timeout: float = 60.0
    backend_api_key: str | None = field(default=None, repr=False)
    control_secret: str | None = field(default=None, repr=False)
    control_secret_file: str | None = None
    http_client: str = "pooled"
    capture_attempts: int = 3
    capture_retry_delay: float = 0.05
    log_level: str = "info"
    log_format: str = "text"
    prefill_policy: str = "kv-aware"
    prefill_affinity_slack: int = 1
    decode_affinity_slack: int = 4
    kv_reuse: bool = True
    decode_continue_tokens: int = 512
    decode_continue_budget: int = 1024
    conditional_disagg: int = 0
    follow_evictions: bool = True
    min_read_tokens: int = 1
    responses_ttl: float = 3600.0
    max_responses: int = 100_000
    responses_max_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if isinstance(self.prefill, str) or isinstance(self.decode, str):
            raise RouterConfigError("prefill and decode are lists of URLs, not one string")
        prefill = tuple(_base_url(u, "prefill") for u in self.prefill)
        decode = tuple(d if isinstance(d, DecodeSpec) else DecodeSpec.parse(d)
                       for d in self.decode)
        if not prefill or not decode:
            raise RouterConfigError(
                "the router needs at least one prefill and one decode backend (--prefill URL "
                "--decode URL, or prefill/decode in the config file)")
        for role, urls in (("prefill", prefill), ("decode", [d.url for d in decode])):
            dupes = sorted({u for u in urls if urls.count(u) > 1})
            if dupes:
                raise RouterConfigError(f"{role} backend listed twice: {', '.join(dupes)}")
        object.__setattr__(self, "prefill", prefill)
        object.__setattr__(self, "decode", decode)
        for name in ("prefill_timeout", "connect_timeout", "decode_timeout", "control_timeout",
                     "health_interval", "health_timeout", "retention_ttl", "retry_after",
                     "drain_timeout", "body_timeout", "discovery_interval"):
            _positive(name, getattr(self, name))
        _positive("responses_ttl", self.responses_ttl)
        for name in ("max_responses", "responses_max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RouterConfigError(f"{name} must be a whole number >= 1, got {value!r}")
        for name in ("remember_expired", "capture_retry_delay", "drain_grace"):
            _positive(name, getattr(self, name), allow_zero=True)
        if self.pin_ttl is not None:
            _positive("pin_ttl", self.pin_ttl)
        for name in ("eject_after", "readmit_after", "max_conversations", "capture_attempts",
                     "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RouterConfigError(f"{name} must be a whole number >= 1, got {value!r}")
        for name in ("prefill_affinity_slack", "decode_affinity_slack", "decode_continue_tokens",
                     "decode_continue_budget", "conditional_disagg", "min_read_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RouterConfigError(f"{name} must be a whole number >= 0, got {value!r}")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise RouterConfigError(
                f"prefill_policy must be one of {', '.join(PREFILL_POLICIES)}, got "
                f"{self.prefill_policy!r}")
        for name in ("kv_reuse", "otel", "follow_evictions"):
            if not isinstance(getattr(self, name), bool):
                raise RouterConfigError(f"{name} must be true or false, got "
                                        f"{getattr(self, name)!r}")
        if self.kv_reuse and self.conditional_disagg:
            raise RouterConfigError(
                "conditional_disagg is the stock baseline and needs kv_reuse off "
                "(--no-kv-reuse); kvturn's own decode continuation is decode_continue_tokens")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise RouterConfigError(f"port must be 0-65535, got {self.port!r}")
        if self.state != "memory" and not self.state.startswith(("redis://", "rediss://",
                                                                 "unix://")):
            raise RouterConfigError(
                f"state must be 'memory' or a Redis URL (redis://host:port/db), got "
                f"{self.state!r}")
        if self.http_client not in ("pooled", "httpx"):
            raise RouterConfigError(
                f"http_client must be 'pooled' or 'httpx', got {self.http_client!r}")
        if self.log_level not in LOG_LEVELS:
            raise RouterConfigError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.log_format not in ("text", "json"):
            raise RouterConfigError(f"log_format must be 'text' or 'json', got "
                                    f"{self.log_format!r}")
        self._resolve_control_secret()

    def _resolve_control_secret(self) -> None:
        if self.control_secret is not None and self.control_secret_file is not None:
            raise RouterConfigError("give control_secret or control_secret_file, not both")
        try:
            if self.control_secret_file is not None:
                secret: str | None = read_secret_file(self.control_secret_file)
            elif self.control_secret is not None:
                if not isinstance(self.control_secret, str):
                    raise RouterConfigError("control_secret must be a string")
                secret = check_secret(self.control_secret, "the router config")
            else:
                secret = None
        except ControlSecretError as exc:
            raise RouterConfigError(str(exc)) from exc
        object.__setattr__(self, "control_secret", secret)

    @property
    def effective_pin_ttl(self) -> float:
        return self.pin_ttl if self.pin_ttl is not None else self.prefill_timeout + 10.0

    def summary(self) -> dict[str, Any]:
        """Every setting, for the start-up log (secrets masked)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("backend_api_key", "control_secret"):
                value = "***" if value else None
            elif f.name == "decode":
                value = ",".join(f"{d.url}(control={d.control})" for d in value)
            elif f.name == "prefill":
                value = ",".join(value)
            elif f.name == "state" and "@" in str(value):
                value = _mask_password(str(value))
            out[f.name] = value
        return out

    @classmethod
    def from_file(cls, path: Path, **overrides: Any) -> RouterConfig:
        """Settings from a TOML (or ``.json``) file; ``overrides`` win over the file."""
        return cls.from_mapping({**load_config_file(path), **overrides})

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> RouterConfig:
        values = {k.replace("-", "_"): v for k, v in values.items()}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise RouterConfigError(
                f"unknown router setting(s) {', '.join(unknown)}; known: "
                f"{', '.join(sorted(known))}")
        missing = [f.name for f in fields(cls) if f.default is MISSING
                   and f.default_factory is MISSING and f.name not in values]
        if missing:
            raise RouterConfigError(
                "the router needs at least one prefill and one decode backend (--prefill URL "
                "--decode URL, or prefill/decode in the config file)")
        decode = values.get("decode")
        if isinstance(decode, list | tuple):
            values["decode"] = tuple(_decode_entry(d) for d in decode)
        if isinstance(values.get("prefill"), list):
            values["prefill"] = tuple(values["prefill"])
        try:
            return cls(**values)
        except TypeError as exc:
            raise RouterConfigError(f"bad router settings: {exc}") from exc


def _decode_entry(entry: Any) -> DecodeSpec:
    if isinstance(entry, DecodeSpec):
        return entry
    if isinstance(entry, str):
        return DecodeSpec.parse(entry)
    if isinstance(entry, dict) and isinstance(entry.get("url"), str) \
            and set(entry) <= {"url", "control"}:
        url = _base_url(entry["url"], "decode")
        control = entry.get("control")
        if control:
            control = _base_url(control, "decode control")
            _same_discovery(url, control)
        return DecodeSpec(url, control or default_control_url(url))
    raise RouterConfigError(
        f"a decode entry is 'URL[,control=URL]' or {{url = URL, control = URL}}, got {entry!r}")


def load_config_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise RouterConfigError(f"cannot read router config {path}: {exc}") from exc
    try:
        data: Any = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise RouterConfigError(f"router config {path} is not valid "
                                f"{'JSON' if path.suffix == '.json' else 'TOML'}: {exc}") from exc
    if not isinstance(data, dict):
        raise RouterConfigError(f"router config {path} must be a table/object of settings")
    return data


def _positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise RouterConfigError(
            f"{name} must be a {'non-negative' if allow_zero else 'positive'} number of "
            f"seconds, got {value!r}")


def _mask_password(url: str) -> str:
    scheme, _, rest = url.partition("://")
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
