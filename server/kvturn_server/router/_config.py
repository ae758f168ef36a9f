"""Router settings: one dataclass, validated when built, from a mapping or a config file.

Each field is one setting, its doc and check in ``setting(...)``: the flags, the ``KVTURN_*``
variables (``_flags.py``), the config file's keys and the settings table of
docs/router-operations.md are all built from the fields (``kvturn_server._settings``).

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
from kvturn_server._defaults import RETENTION_TTL
from kvturn_server._settings import Check, check_all, rename_aliases, setting


class RouterConfigError(ValueError):
    """A setting the router cannot run with; the message says which and why."""


NEED_BACKENDS = ("the router needs at least one prefill and one decode backend (--prefill URL "
                 "--decode URL, or prefill/decode in the config file)")


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
LOG_FORMATS = ("text", "json")
PREFILL_POLICIES = ("kv-aware", "affinity", "least-loaded", "round-robin")
HTTP_CLIENTS = ("pooled", "httpx")


def _seconds(name: str, value: Any) -> Any:
    _positive(name, value)
    return value


def _seconds_or_zero(name: str, value: Any) -> Any:
    _positive(name, value, allow_zero=True)
    return value


def _optional_seconds(name: str, value: Any) -> Any:
    return value if value is None else _seconds(name, value)


def _whole(least: int) -> Check:
    def check(name: str, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise RouterConfigError(f"{name} must be a whole number >= {least}, got {value!r}")
        return value
    return check


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(name: str, value: Any) -> Any:
        if value not in choices:
            what = (" or ".join(map(repr, choices)) if len(choices) == 2
                    else f"one of {', '.join(choices)}")
            raise RouterConfigError(f"{name} must be {what}, got {value!r}")
        return value
    return check


def _switch(name: str, value: Any) -> Any:
    if not isinstance(value, bool):
        raise RouterConfigError(f"{name} must be true or false, got {value!r}")
    return value


def _port(name: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise RouterConfigError(f"{name} must be 0-65535, got {value!r}")
    return value


def _state(name: str, value: Any) -> Any:
    if value != "memory" and not (isinstance(value, str) and value.startswith(
            ("redis://", "rediss://", "unix://"))):
        raise RouterConfigError(
            f"{name} must be 'memory' or a Redis URL (redis://host:port/db), got {value!r}")
    return value


_WHOLE_0, _WHOLE_1 = _whole(0), _whole(1)


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens, which backends it uses, and how long it waits for them.

    One field per setting, documented in its ``setting(...)``: ``kvturn router``'s flags, the
    ``KVTURN_*`` variables, the config file's keys, ``--help`` and the settings table of
    docs/router-operations.md are built from these fields (``kvturn_server._settings``).
    """

    prefill: tuple[str, ...] = field(metadata=setting(
        "base URL of a prefill vLLM instance (repeatable; a list in the file, separated by "
        "spaces in the variable)", metavar="URL"))
    decode: tuple[DecodeSpec, ...] = field(metadata=setting(
        "base URL of a decode vLLM instance (repeatable). Its connector's control endpoint "
        "defaults to the same scheme and host on the next port (http://h:8200 -> "
        "http://h:8201); give another with ,control=URL (in the file also {url = URL, "
        "control = URL})", metavar="URL[,control=URL]"))
    host: str = field(default="127.0.0.1", metadata=setting(
        "address the router listens on", metavar="HOST"))
    port: int = field(default=8000, metadata=setting(
        "port the router listens on", metavar="N", check=_port))
    state: str = field(default="memory", metadata=setting(
        "where conversations live: memory (this process) or redis://HOST:PORT/DB (also "
        "rediss://, unix://), shared by replicas and kept across restarts",
        metavar="memory|redis://HOST:PORT/DB", check=_state))
    prefill_timeout: float = field(default=60.0, metadata=setting(
        "seconds for a whole prefill leg; then it is retried once on another prefill, then the "
        "decode computes the prompt itself", unit="s", check=_seconds))
    connect_timeout: float = field(default=5.0, metadata=setting(
        "seconds to open a connection to any backend", unit="s", check=_seconds))
    decode_timeout: float = field(default=300.0, metadata=setting(
        "seconds the decode may stay silent (reply head, between stream chunks, or a whole "
        "non-streaming reply)", unit="s", check=_seconds))
    control_timeout: float = field(default=2.0, metadata=setting(
        "seconds for a control-endpoint call (pin, unpin, describe, keepalive, release); past "
        "it there is no reuse for that turn, the turn itself goes on", unit="s",
        check=_seconds))
    pin_ttl: float | None = field(default=None, metadata=setting(
        "seconds a pin holds the retention being read; must cover the prefill leg", unit="s",
        default_doc="prefill-timeout + 10 s", check=_optional_seconds))
    health_interval: float = field(default=5.0, metadata=setting(
        "seconds between active health checks of every backend", unit="s", check=_seconds))
    health_timeout: float = field(default=2.0, metadata=setting(
        "seconds a health check may take", unit="s", check=_seconds))
    eject_after: int = field(default=3, metadata=setting(
        "consecutive failures (checks or legs) that eject a backend", check=_WHOLE_1))
    readmit_after: int = field(default=2, metadata=setting(
        "consecutive good health checks that re-admit an ejected backend", check=_WHOLE_1))
    state_prefix: str = field(default="kvturn:", metadata=setting(
        "prefix of every Redis key the router writes"))
    max_conversations: int = field(default=100_000, metadata=setting(
        "conversation table cap (least recently used go first)", check=_WHOLE_1))
    retention_ttl: float = field(default=RETENTION_TTL, metadata=setting(
        "lease seconds assumed when a decode reports a retention without expires_in (the "
        "decodes' decoder_kv_blocks_ttl)", unit="s", check=_seconds))
    remember_expired: float = field(default=600.0, metadata=setting(
        "seconds a conversation stays in the table after its lease ran out, so that its next "
        "turn reports 'expired', not 'miss'", unit="s", check=_seconds_or_zero))
    retry_after: float = field(default=1.0, metadata=setting(
        "seconds clients are told to wait on transient errors (Retry-After)", unit="s",
        check=_seconds))
    drain_timeout: float = field(default=30.0, metadata=setting(
        "seconds a shutdown waits for in-flight requests and streams", unit="s",
        check=_seconds))
    drain_grace: float = field(default=0.0, metadata=setting(
        "seconds after SIGTERM during which /ready answers 503 and new requests are still "
        "served, before the shutdown starts (load balancers take the router out of rotation "
        "meanwhile); 0: shut down at once", unit="s", check=_seconds_or_zero))
    discovery_interval: float = field(default=10.0, metadata=setting(
        "seconds between two DNS resolutions of the dns+http:// backends: new addresses join "
        "their pool, vanished ones are drained", unit="s", check=_seconds))
    otel: bool = field(default=False, metadata=setting(
        "export an OpenTelemetry span per backend leg (pin, prefill, decode, capture) over "
        "OTLP/HTTP, configured by the standard OTEL_* variables (needs pip install "
        "'kvturn[otel]'); W3C traceparent is passed to the backends either way",
        check=_switch))
    max_body_bytes: int = field(default=32 * 1024 * 1024, metadata=setting(
        "largest request body accepted (413 as soon as more has arrived, declared or "
        "chunked)", unit="bytes", default_doc="32 MiB", check=_WHOLE_1))
    body_timeout: float = field(default=60.0, metadata=setting(
        "seconds a client has to send a whole request body (then 408, and the connection is "
        "closed)", unit="s", check=_seconds))
    backend_api_key: str | None = field(default=None, repr=False, metadata=setting(
        "sent as Authorization: Bearer to every backend (vLLM --api-key)", metavar="KEY"))
    control_secret: str | None = field(default=None, repr=False, metadata=setting(
        "the decodes' control API secret (X-KVTurn-Control-Secret on every control call); "
        "from the config file or its variable, never a flag (command lines show in ps); the "
        "variable applies when the config file names no secret", flag=False))
    control_secret_file: str | None = field(default=None, metadata=setting(
        "file holding the decodes' control API secret, read at start-up (its variable "
        "applies when the config file names no secret; give this or control_secret, not "
        "both)", metavar="PATH"))
    http_client: str = field(default="pooled", metadata=setting(
        "backend HTTP transport: pooled (the router's lean keep-alive transport) or httpx "
        "(httpx2's default; slower, for comparison or odd networks)", choices=HTTP_CLIENTS,
        check=_one_of(HTTP_CLIENTS)))
    capture_attempts: int = field(default=3, metadata=setting(
        "how often the router asks a decode for a just-finished stream's retention before "
        "taking the answer it has (the decode retains at finish, which can trail the stream's "
        "last byte by a scheduler step)", check=_WHOLE_1))
    capture_retry_delay: float = field(default=0.05, metadata=setting(
        "seconds between those attempts", unit="s", check=_seconds_or_zero))
    log_level: str = field(default="info", metadata=setting(
        "log level (one line per request at debug)", choices=LOG_LEVELS,
        check=_one_of(LOG_LEVELS)))
    log_format: str = field(default="text", metadata=setting(
        "log lines: text (key=value) or json", choices=LOG_FORMATS, check=_one_of(LOG_FORMATS)))
    prefill_policy: str = field(default="kv-aware", metadata=setting(
        "how a turn's prefill is chosen: kv-aware (the one that computed the conversation's "
        "last prefill leg unless it is busier than the least loaded by more than "
        "prefill-affinity-slack; the decode supplies what it lacks), affinity (that prefill "
        "whenever it is healthy: session affinity), least-loaded, round-robin",
        choices=PREFILL_POLICIES, check=_one_of(PREFILL_POLICIES)))
    prefill_affinity_slack: int = field(default=1, metadata=setting(
        "requests in flight the prefill holding a conversation may have beyond the least "
        "loaded one before kv-aware placement sends its turn elsewhere", check=_WHOLE_0))
    decode_affinity_slack: int = field(default=4, metadata=setting(
        "requests in flight the decode retaining a conversation may have beyond the least "
        "loaded decode before its turn decodes elsewhere", check=_WHOLE_0))
    kv_reuse: bool = field(default=True, metadata=setting(
        "keep conversations' KV on the decodes and reuse it; off (--no-kv-reuse) runs stock "
        "P/D: no pins, no retention, no decode continuation (conversation ids then only give "
        "affinity)", check=_switch))
    decode_continue_tokens: int = field(default=2048, metadata=setting(
        "a turn whose holding decode lacks at most about this many prompt tokens runs on that "
        "decode alone (no prefill leg, no transfer); 0: never (nor the longer turns of "
        "decode-continue-host-tokens)", unit="tokens",
        check=_WHOLE_0))
    decode_continue_budget: int = field(default=4096, metadata=setting(
        "estimated prompt tokens of such turns one decode may compute at once; past it turns "
        "take the prefill path (protects its other requests' inter-token latency; a history "
        "only the decode's host tier holds has its own cap, decode-continue-host-tokens)",
        unit="tokens", check=_WHOLE_0))
    decode_continue_host_tokens: int = field(default=4096, metadata=setting(
        "a longer turn whose history its decode holds only in its host tier (a pin found no "
        "device blocks for a prefill to read) runs on that decode alone, which loads the "
        "history from host memory, when it lacks at most about this many prompt tokens, those "
        "of the decode's other continued turns included; otherwise a prefill reads the "
        "history from the decode's host tier where the decode serves host reads, or "
        "recomputes it; 0: never", unit="tokens", check=_WHOLE_0))
    conditional_disagg: int = field(default=0, metadata=setting(
        "with --no-kv-reuse: stock conditional disaggregation (the baseline: llm-d's "
        "prefix-based-pd-decider, Dynamo's --router-conditional-disagg): a turn whose uncached "
        "part on the decode that served the conversation is at most about this many tokens "
        "runs on that decode alone; 0: plain stock P/D", unit="tokens", check=_WHOLE_0))
    follow_evictions: bool = field(default=True, metadata=setting(
        "follow each decode's evicted and expired retentions (a long poll on its control "
        "endpoint) and mark the records naming them lost, so that their next turns ask the "
        "decode what its prefix cache kept and take a prefill instead of continuing on a "
        "decode that holds too little", check=_switch))
    min_read_tokens: int = field(default=1, metadata=setting(
        "pin a retention for a prefill leg only when at least this many of its tokens are "
        "beyond what that prefill holds", unit="tokens", check=_WHOLE_0))
    responses_ttl: float = field(default=3600.0, metadata=setting(
        "seconds a stored /v1/responses response can be continued by previous_response_id",
        unit="s", check=_seconds))
    max_responses: int = field(default=100_000, metadata=setting(
        "stored /v1/responses responses kept (least recently used go first)", check=_WHOLE_1))
    responses_max_bytes: int = field(default=1 << 30, metadata=setting(
        "total bytes of stored responses kept (in-memory state only)", unit="bytes",
        default_doc="1 GiB", check=_WHOLE_1))

    def __post_init__(self) -> None:
        if isinstance(self.prefill, str) or isinstance(self.decode, str):
            raise RouterConfigError("prefill and decode are lists of URLs, not one string")
        prefill = tuple(_base_url(u, "prefill") for u in self.prefill)
        decode = tuple(d if isinstance(d, DecodeSpec) else DecodeSpec.parse(d)
                       for d in self.decode)
        if not prefill or not decode:
            raise RouterConfigError(NEED_BACKENDS)
        for role, urls in (("prefill", prefill), ("decode", [d.url for d in decode])):
            dupes = sorted({u for u in urls if urls.count(u) > 1})
            if dupes:
                raise RouterConfigError(f"{role} backend listed twice: {', '.join(dupes)}")
        object.__setattr__(self, "prefill", prefill)
        object.__setattr__(self, "decode", decode)
        check_all(self)
        if self.kv_reuse and self.conditional_disagg:
            raise RouterConfigError(
                "conditional_disagg is the stock baseline and needs kv_reuse off "
                "(--no-kv-reuse); kvturn's own decode continuation is decode_continue_tokens")
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
        """Settings by name (dashes read as underscores; former names renamed, warning)."""
        values = rename_aliases(cls, values, where="router settings", error=RouterConfigError)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise RouterConfigError(
                f"unknown router setting(s) {', '.join(unknown)}; known: "
                f"{', '.join(sorted(known))}")
        missing = [f.name for f in fields(cls) if f.default is MISSING
                   and f.default_factory is MISSING and f.name not in values]
        if missing:
            raise RouterConfigError(NEED_BACKENDS)
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
