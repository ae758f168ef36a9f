"""The local stack runs its control endpoints authenticated (``local/_secret.py``)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from kvturn_server._control_secret import ENV, ENV_FILE, resolve_secret
from kvturn_server.local import StackConfig, StackError
from kvturn_server.local._launch import server_specs
from kvturn_server.local._secret import ensure_control_secret


@pytest.fixture(autouse=True)
def no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    # setenv first, so that monkeypatch restores the real value (or its absence) afterwards:
    # ensure_control_secret writes os.environ, and must not leak into other tests.
    for name in (ENV, ENV_FILE):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_a_secret_is_generated_once_per_process_and_written_0600(tmp_path: Path) -> None:
    path = ensure_control_secret(tmp_path / "a")
    secret = os.environ[ENV]
    assert len(secret) >= 32
    assert path.read_text().strip() == secret
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # A second stack of the same process shares it (its servers and helpers read the env).
    other = ensure_control_secret(tmp_path / "b")
    assert os.environ[ENV] == secret and other.read_text().strip() == secret
    assert resolve_secret(os.environ) == secret


def test_a_users_secret_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "users-own-secret-0123456789")
    path = ensure_control_secret(tmp_path)
    assert path.read_text().strip() == "users-own-secret-0123456789"
    mine = tmp_path / "mine"
    mine.write_text("file-secret-0123456789\n")
    monkeypatch.setenv(ENV_FILE, str(mine))
    assert ensure_control_secret(tmp_path / "x") == mine


def test_a_bad_secret_is_a_stack_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "short")
    with pytest.raises(StackError, match="control secret"):
        ensure_control_secret(tmp_path)


def test_the_secret_is_on_no_command_line(tmp_path: Path) -> None:
    ensure_control_secret(tmp_path)
    secret = os.environ[ENV]
    for spec in server_specs(StackConfig(state_dir=tmp_path, with_reference=True)):
        assert secret not in json.dumps(list(spec.argv)), spec.name
        assert secret not in json.dumps(dict(spec.env)), spec.name
