"""The shared secret of the connectors' control API (docs/http-api.md, section C).

One secret per fleet: every connector's control endpoint requires it, every router sends it, in
the ``X-KVTurn-Control-Secret`` header (``kvturn.wire.HEADER_CONTROL_SECRET``; not
``Authorization``: that one carries vLLM's ``--api-key``, which the router sends to every
backend). It comes from a file or from the environment, never from a command line, which any
local user can read in ``ps``.

Both sides use this module: the connector (in vLLM's engine process) and the router import
nothing of each other.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from pathlib import Path

ENV = "KVTURN_CONTROL_SECRET"
ENV_FILE = "KVTURN_CONTROL_SECRET_FILE"
# Long enough that nobody guesses it, short enough for a header line.
MIN_LENGTH = 16
MAX_LENGTH = 1024


class ControlSecretError(ValueError):
    """A configured secret that cannot be used (unreadable file, too short, odd bytes)."""


def check_secret(secret: str, where: str) -> str:
    """``secret`` stripped of surrounding whitespace (a file's trailing newline), validated."""
    secret = secret.strip()
    if not MIN_LENGTH <= len(secret) <= MAX_LENGTH:
        raise ControlSecretError(
            f"the control secret from {where} must be {MIN_LENGTH}-{MAX_LENGTH} characters, "
            f"got {len(secret)}")
    if not (secret.isascii() and secret.isprintable()) or " " in secret:
        raise ControlSecretError(
            f"the control secret from {where} must be printable ASCII without spaces (it is "
            "sent in an HTTP header)")
    return secret


def read_secret_file(path: str | Path) -> str:
    try:
        text = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise ControlSecretError(f"cannot read the control secret file {path}: {exc}") from exc
    return check_secret(text, f"file {path}")


def resolve_secret(environ: Mapping[str, str], file: str | Path | None = None) -> str | None:
    """The secret: ``file`` if given, else the file named by ``KVTURN_CONTROL_SECRET_FILE``,
    else ``KVTURN_CONTROL_SECRET``; None when none is configured (no authentication)."""
    if file is not None:
        return read_secret_file(file)
    if environ.get(ENV_FILE):
        return read_secret_file(environ[ENV_FILE])
    if environ.get(ENV):
        return check_secret(environ[ENV], f"${ENV}")
    return None


def secret_matches(given: str | None, secret: str) -> bool:
    """Whether a request's header carries ``secret``, in time independent of where they
    differ (hmac.compare_digest; only the length may show)."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("latin-1", "replace"), secret.encode("ascii"))


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this host only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
