"""The local stack's control secret: its servers run authenticated, as a fleet should.

One secret per launching process: the first stack or fleet it starts generates one into its
environment (``KVTURN_CONTROL_SECRET``), so every server it launches (they inherit the
environment, and the secret is on no command line) and every in-process helper that calls a
control endpoint (``_direct.control``) use the same. A secret the user set
(``KVTURN_CONTROL_SECRET`` or ``KVTURN_CONTROL_SECRET_FILE``) is used as it is.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from kvturn_server._control_secret import ENV, ENV_FILE, ControlSecretError, resolve_secret
from kvturn_server.local._process import StackError

SECRET_FILE = "control.secret"


def ensure_control_secret(state_dir: Path) -> Path:
    """Make sure this process has a control secret; write it to ``<state_dir>/control.secret``
    (mode 0600) for tools run from another shell (``KVTURN_CONTROL_SECRET_FILE=...``), and
    return that path (or the user's own secret file)."""
    try:
        # Checked now, so that a bad one fails here with its reason, not in every server.
        secret = resolve_secret(os.environ)
    except ControlSecretError as exc:
        raise StackError(str(exc)) from exc
    if os.environ.get(ENV_FILE):
        return Path(os.environ[ENV_FILE])
    if secret is None:
        secret = secrets.token_urlsafe(32)
        os.environ[ENV] = secret
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / SECRET_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secret + "\n")
    os.chmod(path, 0o600)  # an older file may have been created with other bits
    return path
