"""The command lines a stack's members run: each vLLM instance (its flags, environment and
``--kv-transfer-config``) and the router, as ``ServerSpec`` values.

Apart from ``_stack.py`` (which starts, records and stops them) so that the launch of one
instance is one place: ``Stack`` and ``Fleet`` (``_fleet.py``: more instances of the same kind,
ports of their own) both build their vLLM members with ``vllm_spec``.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from kvturn_server.local._model import SIZES
from kvturn_server.local._process import ServerSpec
from kvturn_server.offload import with_offloading

if TYPE_CHECKING:
    from kvturn_server.local._stack_config import StackConfig


def _vllm_env(cfg: StackConfig, host: str, side_channel_port: int | None) -> dict[str, str]:
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": f"{cfg.kv_cache_gib:g}",
        # vLLM binds its engine<->worker message queues to this address; keep them on loopback.
        "VLLM_HOST_IP": host,
        # NIXL binds its side channel here *and* advertises it to peers in kv_transfer_params
        # (remote_host): it must be the address the other instances dial, never a default.
        "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
        "PYTHONUNBUFFERED": "1",
    }
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    return env


# The member of the stack that plays each vLLM role (None: the plain reference instance).
MEMBERS: dict[str | None, str] = {"kv_producer": "prefill", "kv_consumer": "decode",
                                  None: "reference"}


def kv_transfer_config(cfg: StackConfig, role: str) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of the prefill (``kv_producer``) or decode (``kv_consumer``):
    the kvturn connector, in a ``MultiConnector`` with vLLM's CPU offloading when
    ``kv_offload_gib`` is set."""
    extra: dict[str, Any] = {
        "kv_read_timeout": cfg.kv_read_timeout,
        # The connector's default is 127.0.0.1: routers on other hosts could not reach it.
        "control_host": cfg.host_of(MEMBERS[role]),
        "control_port": cfg.prefill_control_port if role == "kv_producer"
        else cfg.decode_control_port,
    }
    if role == "kv_consumer":
        extra.update(decoder_kv_blocks_ttl=cfg.decoder_kv_blocks_ttl,
                     retention_max_hold=cfg.retention_max_hold,
                     retention_budget=cfg.retention_budget)
        extra.update(cfg.decode_connector_extra)
    else:
        extra.update(cfg.prefill_connector_extra)
    config: dict[str, Any] = {
        "kv_connector": "KVTurnConnector",
        "kv_connector_module_path": "kvturn_server.connector",
        "kv_role": role,
        # A failed or abandoned read must recompute, never fail the user's request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    if cfg.kv_buffer_device is not None:
        config["kv_buffer_device"] = cfg.kv_buffer_device
    if cfg.kv_offload_gib > 0:
        return with_offloading(config, int(cfg.kv_offload_gib * 2**30), cfg.kv_offload_extra)
    return config


def vllm_spec(cfg: StackConfig, name: str, port: int, role: str | None,
               side_channel_port: int | None) -> ServerSpec:
    host = cfg.host_of(MEMBERS[role])
    argv = [
        sys.executable, "-m", "kvturn_server.local._vllm", "serve", str(cfg.model_path),
        "--host", host, "--port", str(port),
        "--served-model-name", cfg.served_model_name,
        "--seed", "0",
        # vLLM's "auto" downcasts float32 checkpoints to bfloat16 on CPU; the tiny model must run
        # in float32 for greedy output to match a plain run token for token (_model.py).
        "--dtype", SIZES[cfg.model_size].dtype,
        # Eager mode boots in ~40 s instead of 50-85 s; the tiny model gains nothing from compile.
        "--enforce-eager",
        "--max-model-len", str(cfg.max_model_len),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        # Forced tool calls follow the tool's argument schema (vLLM 0.32 constrains only the
        # call's envelope by default): the random test model then emits valid calls.
        "--tool-strict-level", "parameter",
        "--uvicorn-log-level", "warning",
        *cfg.extra_vllm_args,
    ]
    if role is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(cfg, role))]
    if role == "kv_producer" and not cfg.prefill_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if role == "kv_consumer":
        # Usage says how many prompt tokens the decode's cache supplied (cached_tokens): what
        # a turn it continues alone reports as its reuse (docs/http-api.md, A).
        argv.append("--enable-prompt-tokens-details")
    if role == "kv_consumer" and cfg.decode_num_blocks is not None:
        # A small decode cache makes retention budgets and memory pressure testable.
        argv += ["--num-gpu-blocks-override", str(cfg.decode_num_blocks)]
    other_ports: tuple[int, ...] = ()
    if role is not None:
        control = cfg.prefill_control_port if role == "kv_producer" else cfg.decode_control_port
        other_ports = tuple(p for p in (side_channel_port, control) if p is not None)
    return ServerSpec(
        name=name, argv=argv, port=port, health_url=f"{cfg.url(MEMBERS[role], port)}/health",
        log_path=cfg.state_dir / "logs" / f"{name}.log",
        env=_vllm_env(cfg, host, side_channel_port), other_ports=other_ports, host=host)


def server_specs(cfg: StackConfig) -> list[ServerSpec]:
    specs = [
        vllm_spec(cfg, "prefill", cfg.prefill_port, "kv_producer", cfg.prefill_side_channel_port),
        vllm_spec(cfg, "decode", cfg.decode_port, "kv_consumer", cfg.decode_side_channel_port),
    ]
    if cfg.with_reference:
        specs.append(vllm_spec(cfg, "reference", cfg.reference_port, None, None))
    if not cfg.with_router:
        return specs
    router_argv = [
        sys.executable, "-m", "kvturn_server.cli", "router",
        "--host", cfg.host_of("router"), "--port", str(cfg.router_port),
        "--prefill", cfg.prefill_url,
        "--decode", f"{cfg.decode_url},control={cfg.decode_control_url}",
        "--retention-ttl", f"{cfg.decoder_kv_blocks_ttl:g}",
        *cfg.router_args,
    ]
    specs.append(ServerSpec(
        name="router", argv=router_argv, port=cfg.router_port,
        health_url=f"{cfg.router_url}/health",
        log_path=cfg.state_dir / "logs" / "router.log", env={"PYTHONUNBUFFERED": "1"},
        host=cfg.host_of("router")))
    return specs
