"""KVTurnConnector refuses, before vLLM builds anything, the configurations it cannot serve."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvturn_server.connector._config import ConnectorConfigError
from kvturn_server.connector._connector import _check_supported


def transfer(role: str, buffer: str = "cuda", **extra: Any) -> Any:
    return SimpleNamespace(kv_role=role, kv_buffer_device=buffer,
                           kv_connector_extra_config=dict(extra))


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cuda")


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_a_prefill_or_a_decode_is_accepted(role: str) -> None:
    _check_supported(transfer(role))


def test_a_prefill_may_turn_bidirectional_reads_on() -> None:
    _check_supported(transfer("kv_producer", bidirectional_kv_xfer=True))


@pytest.mark.parametrize("role", ["kv_both", "kv_other", None])
def test_a_role_that_is_neither_prefill_nor_decode_is_refused(role: Any) -> None:
    with pytest.raises(ConnectorConfigError, match="kv_role") as info:
        _check_supported(transfer(role))
    assert repr(role) in str(info.value)


def test_a_decode_with_vllms_bidirectional_mode_is_refused() -> None:
    with pytest.raises(ConnectorConfigError, match="bidirectional_kv_xfer"):
        _check_supported(transfer("kv_consumer", bidirectional_kv_xfer=True))
    _check_supported(transfer("kv_consumer", bidirectional_kv_xfer=False))


@pytest.mark.usefixtures("accelerator")
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_a_host_staging_buffer_on_an_accelerator_is_refused(role: str) -> None:
    with pytest.raises(ConnectorConfigError, match="kv_buffer_device"):
        _check_supported(transfer(role, buffer="cpu"))


@pytest.mark.usefixtures("accelerator")
def test_kv_in_place_on_an_accelerator_is_accepted() -> None:
    _check_supported(transfer("kv_consumer", buffer="cuda"))


def test_a_cpu_platform_keeps_its_kv_in_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cpu")
    _check_supported(transfer("kv_consumer", buffer="cpu"))
    _check_supported(transfer("kv_producer", buffer="cpu"))
