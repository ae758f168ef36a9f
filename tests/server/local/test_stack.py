"""The local stack's configuration, state file and process handling (no vLLM started)."""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvturn_server.local import (
    RunningStack,
    Stack,
    StackConfig,
    StackError,
    free_port,
    kv_transfer_config,
    read_running,
)
from kvturn_server.local._launch import server_specs
from kvturn_server.local._process import ServerSpec, launch, pid_alive, stop_group, wait_healthy
from kvturn_server.local._stack import STATE_FILE


def test_config_refuses_clashing_ports_and_non_loopback() -> None:
    with pytest.raises(StackError, match="must all differ"):
        StackConfig(prefill_port=8000).validate()
    with pytest.raises(StackError, match="loopback only"):
        StackConfig(host="0.0.0.0").validate()


def test_prefill_and_decode_roles_and_recompute_policy() -> None:
    cfg = StackConfig(kv_read_timeout=3)
    for role in ("kv_producer", "kv_consumer"):
        kv = kv_transfer_config(cfg, role)
        assert kv["kv_role"] == role
        assert kv["kv_connector"] == "KVTurnConnector"
        assert kv["kv_connector_module_path"] == "kvturn_server.connector"
        assert kv["kv_load_failure_policy"] == "recompute"
        assert kv["kv_connector_extra_config"]["kv_read_timeout"] == 3


def test_server_specs_stay_on_loopback_with_distinct_side_channels(tmp_path: Path) -> None:
    cfg = StackConfig(state_dir=tmp_path, with_reference=True)
    specs = {s.name: s for s in server_specs(cfg)}
    assert set(specs) == {"prefill", "decode", "reference", "router"}
    for spec in specs.values():
        assert spec.argv[spec.argv.index("--host") + 1] == "127.0.0.1"
        assert spec.log_path.parent == tmp_path / "logs"
    assert specs["prefill"].env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert specs["decode"].env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    assert "--kv-transfer-config" not in specs["reference"].argv
    kv = json.loads(specs["decode"].argv[specs["decode"].argv.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_consumer"
    # The decode's usage says what its own cache supplied (a continued turn's reuse).
    assert "--enable-prompt-tokens-details" in specs["decode"].argv


def test_state_file_round_trip(tmp_path: Path) -> None:
    running = RunningStack(StackConfig(state_dir=tmp_path, router_port=9000),
                           {"router": 1, "prefill": 2}, 123.0)
    again = RunningStack.from_json(running.to_json())
    assert again.config.router_port == 9000
    assert again.config.model_path == running.config.model_path
    assert again.pids == {"router": 1, "prefill": 2}


def test_a_stale_state_file_is_discarded(tmp_path: Path) -> None:
    dead = RunningStack(StackConfig(state_dir=tmp_path), {"router": 2**22 + 17}, 0.0)
    (tmp_path / STATE_FILE).write_text(dead.to_json())
    assert read_running(tmp_path) is None
    assert not (tmp_path / STATE_FILE).exists()
    (tmp_path / STATE_FILE).write_text("{broken")
    assert read_running(tmp_path) is None


def test_a_second_start_while_one_runs_is_refused(tmp_path: Path) -> None:
    alive = RunningStack(StackConfig(state_dir=tmp_path), {"router": os.getpid()}, 0.0)
    (tmp_path / STATE_FILE).write_text(alive.to_json())
    with pytest.raises(StackError, match="already running"):
        Stack(StackConfig(state_dir=tmp_path)).start()


def test_busy_ports_are_reported_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = StackConfig(state_dir=tmp_path, router_port=port)
        with pytest.raises(StackError, match=f"router port {port}"):
            Stack(cfg).start()
    assert not (tmp_path / STATE_FILE).exists()


def _http_server(tmp_path: Path, name: str) -> ServerSpec:
    port = free_port()
    return ServerSpec(name=name, port=port, health_url=f"http://127.0.0.1:{port}/",
                      argv=[sys.executable, "-m", "http.server", "--bind", "127.0.0.1",
                            str(port), "--directory", str(tmp_path)],
                      log_path=tmp_path / "logs" / f"{name}.log")


def test_launch_wait_and_stop_a_real_process(tmp_path: Path) -> None:
    spec = _http_server(tmp_path, "web")
    proc = launch(spec, die_with_parent=True)
    try:
        progress: list[tuple[list[str], list[str]]] = []
        wait_healthy({"web": (spec, proc)}, timeout=30,
                     progress=lambda t, ready, waiting: progress.append((ready, waiting)))
        assert progress[-1] == (["web"], [])
    finally:
        stop_group(proc.pid, grace=5)
    assert proc.poll() is not None
    assert not pid_alive(proc.pid)
    assert "starting web" in spec.log_path.read_text()


def test_a_server_that_dies_while_starting_is_reported_with_its_log(tmp_path: Path) -> None:
    spec = replace(_http_server(tmp_path, "broken"),
                   argv=[sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"])
    proc = launch(spec, die_with_parent=True)
    with pytest.raises(StackError, match=r"(?s)broken exited with code 3.*no model here"):
        wait_healthy({"broken": (spec, proc)}, timeout=30)


def test_a_server_that_never_gets_healthy_times_out(tmp_path: Path) -> None:
    spec = replace(_http_server(tmp_path, "mute"),
                   argv=[sys.executable, "-c", "import time; time.sleep(60)"])
    proc = launch(spec, die_with_parent=True)
    try:
        with pytest.raises(StackError, match="mute not healthy after 1 s"):
            wait_healthy({"mute": (spec, proc)}, timeout=1, interval=0.1)
    finally:
        stop_group(proc.pid, grace=5)


def test_retention_and_prefix_cache_switches(tmp_path: Path) -> None:
    cfg = StackConfig(state_dir=tmp_path, decoder_kv_blocks_ttl=60, retention_budget=0.25,
                      prefill_prefix_caching=False)
    specs = {s.name: s for s in server_specs(cfg)}
    assert "--no-enable-prefix-caching" in specs["prefill"].argv
    assert "--no-enable-prefix-caching" not in specs["decode"].argv
    decode = kv_transfer_config(cfg, "kv_consumer")["kv_connector_extra_config"]
    assert decode == {"kv_read_timeout": 20.0, "control_host": "127.0.0.1", "control_port": 8201,
                      "decoder_kv_blocks_ttl": 60, "retention_max_hold": 3600.0,
                      "retention_budget": 0.25}
    prefill = kv_transfer_config(cfg, "kv_producer")["kv_connector_extra_config"]
    # The connector turns vLLM's bidirectional read on for prefills itself, never on decodes.
    assert prefill == {"kv_read_timeout": 20.0, "control_host": "127.0.0.1",
                       "control_port": 8101}


def test_prefill_connector_extra_reaches_the_prefill_only() -> None:
    cfg = StackConfig(prefill_connector_extra={"compute_tokens_per_s": 1.0,
                                               "kv_read_timeout": 7})
    prefill = kv_transfer_config(cfg, "kv_producer")["kv_connector_extra_config"]
    assert prefill == {"kv_read_timeout": 7, "control_host": "127.0.0.1", "control_port": 8101,
                       "compute_tokens_per_s": 1.0}
    decode = kv_transfer_config(cfg, "kv_consumer")["kv_connector_extra_config"]
    assert "compute_tokens_per_s" not in decode and decode["kv_read_timeout"] == 20.0


def test_free_ports_are_distinct_and_outside_the_ephemeral_range() -> None:
    # Binding port 0 (as UCX does dozens of times in every NIXL worker) takes ports from the
    # ephemeral range: a port handed out from there could be gone before our server binds it.
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
                 .split())
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(not low <= port <= high for port in ports), ports
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


# The README's multi-host recipe on loopback: every member on its own address, and the same
# port numbers on each (as on separate hosts).
SPREAD = {"router_host": "127.0.0.2", "prefill_host": "127.0.0.3", "decode_host": "127.0.0.4",
          "reference_host": "127.0.0.5", "router_port": 8000, "prefill_port": 8100,
          "decode_port": 8100, "reference_port": 8100, "prefill_side_channel_port": 5600,
          "decode_side_channel_port": 5600, "prefill_control_port": 8101,
          "decode_control_port": 8101}


def test_members_on_addresses_of_their_own_bind_advertise_and_dial_only_those(
        tmp_path: Path) -> None:
    cfg = StackConfig(state_dir=tmp_path, with_reference=True, **SPREAD)  # type: ignore[arg-type]
    cfg.validate()  # equal port numbers on different addresses do not clash
    specs = {s.name: s for s in server_specs(cfg)}
    for name in ("prefill", "decode", "reference"):
        host, spec = cfg.host_of(name), specs[name]
        assert spec.argv[spec.argv.index("--host") + 1] == host and spec.host == host
        assert spec.health_url == f"http://{host}:8100/health"
        assert spec.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == host  # bound and advertised
        assert spec.env["VLLM_HOST_IP"] == host
    for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        extra = kv_transfer_config(cfg, role)["kv_connector_extra_config"]
        assert (extra["control_host"], extra["control_port"]) == (cfg.host_of(name), 8101)
        assert specs[name].other_ports == (5600, 8101)
    router = list(specs["router"].argv)
    assert router[router.index("--host") + 1] == "127.0.0.2" == specs["router"].host
    assert router[router.index("--prefill") + 1] == "http://127.0.0.3:8100"
    assert router[router.index("--decode") + 1] == \
        "http://127.0.0.4:8100,control=http://127.0.0.4:8101"
    assert cfg.router_url == "http://127.0.0.2:8000"
    assert cfg.reference_url == "http://127.0.0.5:8100"
    # Nothing falls back to the one-host default anywhere on a command line or environment.
    assert "127.0.0.1" not in json.dumps([[s.argv, dict(s.env)] for s in specs.values()])
    assert "localhost" not in json.dumps([[s.argv, dict(s.env)] for s in specs.values()])
    # The state file keeps the addresses (``kvturn status`` and ``down`` read it).
    again = RunningStack.from_json(RunningStack(cfg, {}, 0.0).to_json()).config
    assert again.decode_url == cfg.decode_url and again.router_host == "127.0.0.2"


def test_members_on_one_address_still_need_ports_of_their_own() -> None:
    with pytest.raises(StackError, match="must all differ"):
        StackConfig(**{**SPREAD, "decode_host": "127.0.0.3"}).validate()  # type: ignore[arg-type]
    with pytest.raises(StackError, match="loopback only"):
        StackConfig(**{**SPREAD, "decode_host": "10.0.0.21"}).validate()  # type: ignore[arg-type]
