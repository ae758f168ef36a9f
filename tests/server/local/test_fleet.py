"""The local fleet's plan and command lines (no vLLM started): every instance is the Stack's
prefill or decode with ports of its own, and its routers take the flags of the real router."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvturn_server.cli import build_parser
from kvturn_server.local import Fleet, FleetConfig, StackConfig, StackError
from kvturn_server.local._fleet import (
    Instance,
    Router,
    instance_spec,
    plan_instances,
    router_argv,
)
from kvturn_server.local._launch import server_specs
from kvturn_server.local._process import ServerSpec
from kvturn_server.router import router_config_from_args


def _ports() -> Callable[[str], int]:
    counter = iter(range(20000, 21000))
    return lambda host: next(counter)


def _kv(argv: list[str]) -> dict[str, object]:
    return dict(json.loads(argv[argv.index("--kv-transfer-config") + 1]))


def test_the_plan_names_instances_by_role_with_ports_of_their_own(tmp_path: Path) -> None:
    cfg = FleetConfig(state_dir=tmp_path, prefills=3, decodes=2)
    instances = plan_instances(cfg, _ports())
    assert [i.name for i in instances] == ["prefill0", "prefill1", "prefill2", "decode0",
                                           "decode1"]
    ports = [p for i in instances for p in (i.port, i.side_channel_port, i.control_port)]
    assert len(set(ports)) == 15
    for i in instances:
        assert i.url == f"http://127.0.0.1:{i.port}"
        assert i.spec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(i.side_channel_port)
        assert i.spec.log_path == tmp_path / "logs" / f"{i.name}.log"
        assert _kv(list(i.spec.argv))["kv_connector_extra_config"]["control_port"] == \
            i.control_port  # type: ignore[index]
    with pytest.raises(StackError, match="differ"):
        plan_instances(cfg, lambda host: 20000)


def test_an_instance_is_the_stacks_prefill_or_decode_with_its_block_count(
        tmp_path: Path) -> None:
    cfg = FleetConfig(state_dir=tmp_path, prefill_num_blocks=66, decode_num_blocks=400,
                      max_model_len=4480, decoder_kv_blocks_ttl=48.0)
    prefill = list(instance_spec(cfg, "prefill0", "prefill", 9100, 9101, 9102).argv)
    decode = list(instance_spec(cfg, "decode0", "decode", 9200, 9201, 9202).argv)
    stack = {s.name: list(s.argv) for s in server_specs(StackConfig(
        state_dir=tmp_path, model_dir=cfg.model_path, max_model_len=4480,
        decoder_kv_blocks_ttl=48.0, prefill_port=9100, decode_port=9200,
        prefill_control_port=9102, decode_control_port=9202, decode_num_blocks=400,
        with_router=False))}
    # The prefill: the Stack's, plus its block count; prefix caching on (vLLM's default).
    at = prefill.index("--num-gpu-blocks-override")
    assert prefill[at + 1] == "66"
    assert prefill[:at] + prefill[at + 2:] == stack["prefill"]
    assert "--no-enable-prefix-caching" not in prefill
    assert _kv(prefill)["kv_role"] == "kv_producer"
    assert decode == stack["decode"]
    assert _kv(decode)["kv_role"] == "kv_consumer"
    assert _kv(decode)["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] == 48.0  # type: ignore[index]
    assert decode[decode.index("--max-model-len") + 1] == "4480"
    with pytest.raises(ValueError):
        instance_spec(cfg, "x", "reference", 1, 2, 3)


def test_every_instance_offloads_as_the_stacks_do_when_asked(tmp_path: Path) -> None:
    cfg = FleetConfig(state_dir=tmp_path, prefills=1, decodes=1, kv_offload_gib=0.25,
                      kv_offload_extra={"offload_prompt_only": False})
    for instance in plan_instances(cfg, _ports()):
        kv = _kv(list(instance.spec.argv))
        assert kv["kv_connector"] == "MultiConnector"
        inner, offload = kv["kv_connector_extra_config"]["connectors"]  # type: ignore[index]
        assert inner["kv_connector"] == "KVTurnConnector"
        assert offload["kv_connector_extra_config"]["cpu_bytes_to_use"] == 1 << 28
        assert offload["kv_connector_extra_config"]["offload_prompt_only"] is False
    assert cfg.describe()["kv_offload_gib"] == 0.25


def test_prefills_and_decodes_may_each_have_a_host_tier_of_their_own(tmp_path: Path) -> None:
    cfg = FleetConfig(state_dir=tmp_path, prefills=2, decodes=1, kv_offload_gib=0.25,
                      prefill_kv_offload_gib=0.5)
    sizes = {i.name: _kv(list(i.spec.argv))["kv_connector_extra_config"][  # type: ignore[index]
        "connectors"][1]["kv_connector_extra_config"]["cpu_bytes_to_use"]
        for i in plan_instances(cfg, _ports())}
    assert sizes == {"prefill0": 1 << 29, "prefill1": 1 << 29, "decode0": 1 << 28}
    assert (cfg.describe()["prefill_kv_offload_gib"], cfg.describe()["decode_kv_offload_gib"]) \
        == (0.5, 0.25)
    # A role set to 0 has none.
    cfg = FleetConfig(state_dir=tmp_path, kv_offload_gib=0.25, prefill_kv_offload_gib=0.0)
    kinds = {i.role: _kv(list(i.spec.argv))["kv_connector"] for i in plan_instances(cfg, _ports())}
    assert kinds == {"prefill": "KVTurnConnector", "decode": "MultiConnector"}
    with pytest.raises(StackError):
        FleetConfig(state_dir=tmp_path, decode_kv_offload_gib=-1.0)


def test_the_router_argv_names_every_backend_and_parses_as_the_router(tmp_path: Path) -> None:
    fleet = Fleet(FleetConfig(state_dir=tmp_path, prefills=2, decodes=2),
                  port=_ports())
    argv = router_argv(fleet.prefills, fleet.decodes, 8000, 48.0, ["--log-level", "debug"])
    assert argv[:4] == [sys.executable, "-m", "kvturn_server.cli", "router"]
    config = router_config_from_args(build_parser().parse_args(argv[3:]))
    assert config.prefill == tuple(p.url for p in fleet.prefills)
    assert [(d.url, d.control) for d in config.decode] == [
        (d.url, d.control_url) for d in fleet.decodes]
    assert config.port == 8000 and config.retention_ttl == 48.0
    assert config.log_level == "debug" and config.host == "127.0.0.1"
    only = router_argv(fleet.prefills[1:], fleet.decodes[:1], 8001, 48.0)
    assert router_config_from_args(build_parser().parse_args(only[3:])).prefill == (
        fleet.prefills[1].url,)


def test_a_fleet_refuses_nonsense_and_stops_cleanly_before_it_starts(tmp_path: Path) -> None:
    for bad in ({"prefills": 0}, {"decodes": 0}, {"model_size": "huge"},
                {"prefill_num_blocks": 1}, {"kv_offload_gib": -1}):
        with pytest.raises(StackError):
            FleetConfig(state_dir=tmp_path, **bad)
    cfg = FleetConfig(state_dir=tmp_path)
    assert cfg.model_name == "kvturn-tiny" and cfg.context == 8192
    assert cfg.model_path == tmp_path / "models" / "tiny"
    with Fleet(cfg, port=_ports()) as fleet:
        assert [i.name for i in fleet.prefills] == ["prefill0", "prefill1"]
        assert fleet.instance("decode0").role == "decode"
        fleet.stop_router("never-started")  # a no-op
    assert fleet.routers == {}


def test_instances_on_addresses_of_their_own_advertise_and_are_dialled_there(
        tmp_path: Path) -> None:
    hosts = ("127.0.0.3", "127.0.0.4", "127.0.0.5")
    cfg = FleetConfig(state_dir=tmp_path, prefills=2, decodes=1, hosts=hosts,
                      router_host="127.0.0.2")
    asked: list[str] = []

    def port(host: str) -> int:
        asked.append(host)
        return 20000  # the same number everywhere: each host has its own ports
    with pytest.raises(StackError, match="differ on each address"):
        plan_instances(cfg, port)
    fleet = Fleet(cfg, port=_ports())
    assert [i.host for i in fleet.instances] == list(hosts)
    assert set(asked) == set(hosts)  # each port was found free on its own address
    for i in fleet.instances:
        argv = list(i.spec.argv)
        assert argv[argv.index("--host") + 1] == i.host and i.spec.host == i.host
        assert i.spec.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == i.host
        assert i.spec.env["VLLM_HOST_IP"] == i.host
        assert _kv(argv)["kv_connector_extra_config"]["control_host"] == i.host  # type: ignore[index]
        assert i.url == f"http://{i.host}:{i.port}"
        assert i.spec.health_url == f"{i.url}/health"
    argv = router_argv(fleet.prefills, fleet.decodes, 8000, 48.0, host="127.0.0.2")
    config = router_config_from_args(build_parser().parse_args(argv[3:]))
    assert config.host == "127.0.0.2"
    assert config.prefill == ("http://127.0.0.3:20000", "http://127.0.0.4:20003")
    assert [(d.url, d.control) for d in config.decode] == [
        ("http://127.0.0.5:20006", "http://127.0.0.5:20008")]
    for bad in ({"hosts": hosts[:2]}, {"hosts": ("10.0.0.3", *hosts[1:])},
                {"router_host": "0.0.0.0"}):
        with pytest.raises(StackError):
            FleetConfig(state_dir=tmp_path, prefills=2, decodes=1, **bad)  # type: ignore[arg-type]


def test_members_on_an_ipv6_address_are_dialled_in_brackets_as_the_stacks_are(
        tmp_path: Path) -> None:
    spec = ServerSpec(name="decode0", argv=(), port=8200, health_url="", log_path=tmp_path)
    decode = Instance("decode0", "decode", 8200, 8201, 8202, spec, host="::1")
    assert (decode.url, decode.control_url) == ("http://[::1]:8200", "http://[::1]:8202")
    assert Router("r", 8000, (), 1, 0.0, host="::1").url == "http://[::1]:8000"
    assert Router("r", 8000, (), 1, 0.0).url == "http://127.0.0.1:8000"
    stack = StackConfig(host="::1")
    assert stack.router_url == f"http://[::1]:{stack.router_port}"
