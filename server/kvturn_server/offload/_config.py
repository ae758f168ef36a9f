"""The ``--kv-transfer-config`` that puts the host tier beside another connector.

vLLM's own switch (``--kv-offloading-size``) replaces whatever connector the config names and
sets ``kv_role: kv_both``, so it cannot run beside a P/D connector; vLLM's ``MultiConnector``
can. Its first connector is asked first for external tokens of each request, so kvturn's
connector comes first: a prefill leg's blocks arrive over NIXL, and the host tier loads from
host memory what no transfer brings (a turn the decode serves alone). No vLLM import.

The host tier is vLLM's offloading connector with kvturn's spec (``HostTierConnector``,
``_connector.py``), by default evicting in the order of kvturn's leases (``eviction_policy:
"kvturn"``) and storing replies too (``offload_prompt_only: false``: an agent's next prompt
holds the previous reply). ``{"eviction_policy": "lru", "offload_prompt_only": true}`` in
``extra`` gives vLLM's own behaviour (a stock baseline).
"""

from __future__ import annotations

from typing import Any

# vLLM's offloading spec with kvturn's manager and a worker for the CPU platform (``_spec.py``).
SPEC = {"spec_name": "HostOffloadingSpec", "spec_module_path": "kvturn_server.offload"}
# kvturn's defaults for the host tier's other keys (vLLM's: "lru", true).
HOST_TIER_DEFAULTS = {"eviction_policy": "kvturn", "offload_prompt_only": False}


def offloading_connector(cpu_bytes: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The host tier's connector with ``cpu_bytes`` of host memory (``extra`` overrides any
    of its keys: ``offload_prompt_only``, ``eviction_policy``, ``store_threshold``, ...)."""
    if cpu_bytes <= 0:
        raise ValueError(f"the host tier needs a positive size, got {cpu_bytes} bytes")
    return {"kv_connector": "HostTierConnector",
            "kv_connector_module_path": "kvturn_server.offload",
            # A best-effort cache that both stores and loads, as vLLM's own switch configures it.
            "kv_role": "kv_both",
            "kv_connector_extra_config": {**SPEC, "cpu_bytes_to_use": cpu_bytes,
                                          **HOST_TIER_DEFAULTS, **(extra or {})}}


def with_offloading(config: dict[str, Any], cpu_bytes: int,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config`` (a connector's ``--kv-transfer-config``) and the host tier, in one
    ``MultiConnector`` that keeps ``config``'s role, failure policy and buffer device."""
    outer: dict[str, Any] = {key: config[key] for key in ("kv_role", "kv_load_failure_policy",
                                          "kv_buffer_device") if key in config}
    return {"kv_connector": "MultiConnector", **outer,
            "kv_connector_extra_config": {
                "connectors": [config, offloading_connector(cpu_bytes, extra)]}}
