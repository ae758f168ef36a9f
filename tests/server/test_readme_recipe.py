"""The README's multi-host recipe ("Using it"), parsed by the code that will read it: vLLM's own
``vllm serve`` parser, the connector's config parser and kvturn's router CLI. Every address an
instance binds or advertises is its own, and the router dials exactly those."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from kvturn_server.cli import build_parser
from kvturn_server.connector._config import ConnectorConfig
from kvturn_server.router import router_config_from_args
from tests.server.test_deploy_manifests import vllm_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def recipe() -> list[tuple[dict[str, str], list[str]]]:
    """Each command of the first bash block under "## Using it": (its env prefix, its argv)."""
    text = README.read_text().split("\n## Using it\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block is not None, "no bash block under 'Using it'"
    commands = []
    for command in re.split(r"(?<!\\)\n(?!  )", block.group(1).replace("\\\n", " ")):
        words = shlex.split(command, comments=True)
        if not words or words[0] == "export":
            continue
        env = {}
        while "=" in words[0] and not words[0].startswith("-"):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        commands.append((env, words))
    return commands


def test_every_engine_binds_and_advertises_its_own_address() -> None:
    engines: dict[str, Any] = {}
    for env, argv in recipe():
        if argv[:2] != ["vllm", "serve"]:
            continue
        args = vllm_parser().parse_args(argv[2:])
        kv = args.kv_transfer_config
        assert kv.kv_connector == "KVTurnConnector" and kv.kv_load_failure_policy == "recompute"
        config = ConnectorConfig.from_extra(kv.kv_connector_extra_config)
        host = args.host
        assert host not in ("0.0.0.0", "127.0.0.1", "localhost", None)
        # Bound and advertised (NIXL's remote_host), vLLM's own processes, the control endpoint.
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == env["VLLM_HOST_IP"] == config.control_host \
            == host
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] and config.control_port is not None
        # A decode's usage says what its own cache supplied (a continued turn's reuse).
        assert args.enable_prompt_tokens_details == (kv.kv_role == "kv_consumer")
        engines[kv.kv_role] = (host, args.port, config.control_port)
    assert set(engines) == {"kv_producer", "kv_consumer"}
    assert engines["kv_producer"][0] != engines["kv_consumer"][0]  # two hosts

    routers = [argv for _, argv in recipe() if argv[:2] == ["kvturn", "router"]]
    assert len(routers) == 1
    router = router_config_from_args(build_parser().parse_args(routers[0][1:]))
    prefill_host, prefill_port, _ = engines["kv_producer"]
    decode_host, decode_port, decode_control = engines["kv_consumer"]
    assert router.prefill == (f"http://{prefill_host}:{prefill_port}",)
    assert [(d.url, d.control) for d in router.decode] == [
        (f"http://{decode_host}:{decode_port}", f"http://{decode_host}:{decode_control}")]
    assert router.retention_ttl == ConnectorConfig().decoder_kv_blocks_ttl
    assert router.state.startswith("redis://")
