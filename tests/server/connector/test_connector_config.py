"""kvturn's keys in kv_connector_extra_config."""

from __future__ import annotations

import pytest

from kvturn_server.connector import ConnectorConfig, ConnectorConfigError
from kvturn_server.connector._cost import CostSettings


def test_defaults() -> None:
    cfg = ConnectorConfig.from_extra(None)
    assert cfg == ConnectorConfig()
    assert cfg.kv_read_timeout == 20.0
    assert cfg.nixl_progress_thread is None
    assert cfg.nixl_progress_delay_ms == 10.0
    assert cfg.keep_thread_affinity is True


def test_the_progress_thread_runs_on_decodes_unless_configured() -> None:
    assert ConnectorConfig().progress_thread(decode=True) is True
    assert ConnectorConfig().progress_thread(decode=False) is False
    off = ConnectorConfig.from_extra({"nixl_progress_thread": False})
    assert off.progress_thread(decode=True) is False
    on = ConnectorConfig.from_extra({"nixl_progress_thread": True})
    assert on.progress_thread(decode=False) is True


@pytest.mark.parametrize("bad", [0, -1, 1001, "5", True, None])
def test_the_progress_delay_is_a_positive_number_of_ms(bad: object) -> None:
    with pytest.raises(ConnectorConfigError, match="nixl_progress_delay_ms must be a number"):
        ConnectorConfig.from_extra({"nixl_progress_delay_ms": bad})


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
    with pytest.raises(ConnectorConfigError, match="keep_thread_affinity must be true or false"):
        ConnectorConfig.from_extra({"keep_thread_affinity": "yes"})
    with pytest.raises(ConnectorConfigError, match="nixl_progress_thread must be true, false or"):
        ConnectorConfig.from_extra({"nixl_progress_thread": "yes"})
    assert ConnectorConfig.from_extra({"nixl_progress_thread": None}).nixl_progress_thread is None


def test_retention_defaults() -> None:
    cfg = ConnectorConfig()
    assert cfg.control_host == "127.0.0.1" and cfg.control_port is None
    assert cfg.decoder_kv_blocks_ttl == 480.0 and cfg.retention_max_hold == 3600.0
    assert cfg.retention_budget == 1.0 and cfg.retention_max_pin == 300.0


def test_retention_values() -> None:
    cfg = ConnectorConfig.from_extra({
        "control_host": "::1", "control_port": 8201, "decoder_kv_blocks_ttl": 5,
        "retention_max_hold": 60, "retention_budget": 0, "retention_max_pin": 30})
    assert (cfg.control_host, cfg.control_port) == ("::1", 8201)
    assert cfg.decoder_kv_blocks_ttl == 5.0 and cfg.retention_budget == 0.0


@pytest.mark.parametrize(("key", "bad", "message"), [
    ("control_port", 0, "control_port must be a TCP port"),
    ("control_port", 70000, "control_port must be a TCP port"),
    ("control_port", "8201", "control_port must be a TCP port"),
    ("control_host", "", "control_host must be a host address"),
    ("control_host", "example.com", "control_host must be an IP address or localhost"),
    ("retention_budget", 1.5, "retention_budget must be a fraction"),
    ("retention_budget", -0.1, "retention_budget must be a fraction"),
    ("decoder_kv_blocks_ttl", 0, "decoder_kv_blocks_ttl must be a positive number"),
])
def test_bad_retention_values_name_the_key(key: str, bad: object, message: str) -> None:
    with pytest.raises(ConnectorConfigError, match=message):
        ConnectorConfig.from_extra({key: bad})


def test_max_hold_below_the_ttl_is_refused() -> None:
    with pytest.raises(ConnectorConfigError, match=r"retention_max_hold .* must be at least"):
        ConnectorConfig.from_extra({"decoder_kv_blocks_ttl": 600, "retention_max_hold": 60})


# The reuse cost model.


def test_cost_model_defaults_to_auto_with_every_parameter_calibrated() -> None:
    cfg = ConnectorConfig()
    assert cfg.reuse_cost_model == "auto"
    assert cfg.cost_settings == CostSettings()
    assert (cfg.read_fixed_ms, cfg.read_gbps, cfg.compute_tokens_per_s,
            cfg.compute_attention_tokens) == (None, None, None, None)


def test_cost_model_values() -> None:
    cfg = ConnectorConfig.from_extra({
        "reuse_cost_model": "auto", "read_fixed_ms": 0, "read_gbps": 12.5,
        "compute_tokens_per_s": 8000, "compute_attention_tokens": 4096})
    assert cfg.cost_settings == CostSettings(read_fixed_ms=0.0, read_gbps=12.5,
                                             compute_tokens_per_s=8000.0,
                                             compute_attention_tokens=4096)
    assert isinstance(cfg.compute_tokens_per_s, float)
    assert ConnectorConfig.from_extra({"reuse_cost_model": "off"}).reuse_cost_model == "off"


def test_null_means_calibrate() -> None:
    cfg = ConnectorConfig.from_extra({"read_fixed_ms": None, "read_gbps": None,
                                      "compute_tokens_per_s": None,
                                      "compute_attention_tokens": None})
    assert cfg.cost_settings == CostSettings()


@pytest.mark.parametrize(("key", "bad", "message"), [
    ("reuse_cost_model", "on", "reuse_cost_model must be one of 'auto', 'off', got 'on'"),
    ("reuse_cost_model", True, "reuse_cost_model must be one of"),
    ("reuse_cost_model", None, "reuse_cost_model must be one of"),
    ("read_fixed_ms", -1, "read_fixed_ms must be a number of milliseconds >= 0"),
    ("read_fixed_ms", "2", "read_fixed_ms must be a number of milliseconds"),
    ("read_fixed_ms", float("inf"), "read_fixed_ms must be a number of milliseconds"),
    ("read_fixed_ms", False, "read_fixed_ms must be a number of milliseconds"),
    ("read_gbps", 0, "read_gbps must be a positive number, or null to calibrate it"),
    ("read_gbps", float("nan"), "read_gbps must be a positive number"),
    ("compute_tokens_per_s", -5, "compute_tokens_per_s must be a positive number"),
    ("compute_tokens_per_s", True, "compute_tokens_per_s must be a positive number"),
    ("compute_attention_tokens", 0, "compute_attention_tokens must be a positive whole"),
    ("compute_attention_tokens", 4096.0, "compute_attention_tokens must be a positive whole"),
])
def test_bad_cost_model_values_name_the_key(key: str, bad: object, message: str) -> None:
    with pytest.raises(ConnectorConfigError, match=message):
        ConnectorConfig.from_extra({key: bad})


def test_cost_parameters_with_the_cost_model_off_are_refused() -> None:
    with pytest.raises(ConnectorConfigError,
                       match="read_gbps has no effect with reuse_cost_model 'off'"):
        ConnectorConfig.from_extra({"reuse_cost_model": "off", "read_gbps": 10})


def test_a_bad_cost_model_name_is_refused_when_built_directly_too() -> None:
    with pytest.raises(ConnectorConfigError, match="reuse_cost_model must be one of"):
        ConnectorConfig(reuse_cost_model="fast")
