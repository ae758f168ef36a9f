"""kvturn's keys in kv_connector_extra_config."""

from __future__ import annotations

import pytest

from kvturn_server.connector import ConnectorConfig, ConnectorConfigError


def test_defaults() -> None:
    cfg = ConnectorConfig.from_extra(None)
    assert cfg == ConnectorConfig()
    assert cfg.kv_read_timeout == 20.0
    assert cfg.nixl_progress_thread is False
    assert cfg.keep_thread_affinity is True


def test_values_and_unknown_keys() -> None:
    cfg = ConnectorConfig.from_extra(
        {"kv_read_timeout": 3, "nixl_progress_thread": True, "backends": ["UCX"]})
    assert cfg.kv_read_timeout == 3.0
    assert cfg.nixl_progress_thread is True


@pytest.mark.parametrize("bad", [0, -1, "5", True, None])
def test_timeout_must_be_positive_number(bad: object) -> None:
    with pytest.raises(ConnectorConfigError, match="kv_read_timeout must be a positive number"):
        ConnectorConfig.from_extra({"kv_read_timeout": bad})


def test_flags_must_be_booleans() -> None:
    with pytest.raises(ConnectorConfigError, match="nixl_progress_thread must be true or false"):
        ConnectorConfig.from_extra({"nixl_progress_thread": "yes"})
