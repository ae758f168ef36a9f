"""The ``--kv-transfer-config`` that puts vLLM's CPU offloading beside another connector.

vLLM's own switch (``--kv-offloading-size``) replaces whatever connector the config names and
sets ``kv_role: kv_both``, so it cannot run beside a P/D connector; vLLM's ``MultiConnector``
can. Its first connector is asked first for external tokens of each request, so kvturn's
connector comes first: a prefill leg's blocks arrive over NIXL, and the offloading connector
loads from host memory what no transfer brings (a turn the decode serves alone). No vLLM import.
"""

from __future__ import annotations

from typing import Any

# vLLM's offloading spec with a worker for the CPU platform (``_spec.py``); vLLM's own on GPUs.
SPEC = {"spec_name": "HostOffloadingSpec", "spec_module_path": "kvturn_server.offload"}


def offloading_connector(cpu_bytes: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's ``OffloadingConnector`` with a host tier of ``cpu_bytes`` (``extra`` overrides any
    of its keys: ``offload_prompt_only``, ``eviction_policy``, ``store_threshold``, ...)."""
    if cpu_bytes <= 0:
        raise ValueError(f"the host tier needs a positive size, got {cpu_bytes} bytes")
    return {"kv_connector": "OffloadingConnector",
            # A best-effort cache that both stores and loads, as vLLM's own switch configures it.
            "kv_role": "kv_both",
            "kv_connector_extra_config": {**SPEC, "cpu_bytes_to_use": cpu_bytes,
                                          **(extra or {})}}


def with_offloading(config: dict[str, Any], cpu_bytes: int,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config`` (a connector's ``--kv-transfer-config``) and vLLM's CPU offloading, in one
    ``MultiConnector`` that keeps ``config``'s role, failure policy and buffer device."""
    outer: dict[str, Any] = {key: config[key] for key in ("kv_role", "kv_load_failure_policy",
                                          "kv_buffer_device") if key in config}
    return {"kv_connector": "MultiConnector", **outer,
            "kv_connector_extra_config": {
                "connectors": [config, offloading_connector(cpu_bytes, extra)]}}
