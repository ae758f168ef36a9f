"""The Kubernetes manifests and images under deploy/, checked offline against the code they run.

Every overlay is rendered with ``kubectl kustomize`` and validated against the Kubernetes API
schemas of the versions below (``kubernetes-validate``). Then each container's command line is
expanded the way the kubelet expands it (``$(VAR)`` from the container's environment, the pod IP
from the downward API, ConfigMap and Secret files where they are mounted) and parsed by the
parsers that will read it in the pod: kvturn's CLI and router config for the router, vLLM's own
``vllm serve`` parser for the engines, and the connector's config parser for
``kv_connector_extra_config``. A flag renamed in the code, a setting the router no longer knows,
or an address that would be loopback in a pod fails here, not in a cluster.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from kvturn_server.cli import build_parser
from kvturn_server.connector._config import ConnectorConfig
from kvturn_server.router import router_config_from_args

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
DOCKER = ROOT / "deploy" / "docker"
OVERLAYS = ("gpu", "cpu-demo")
# The oldest Kubernetes the manifests claim (docs/deploy.md) and the newest schema shipped.
K8S_VERSIONS = ("1.32.0", "1.37.0")
POD_IP = "10.42.7.9"
ENGINES = ("prefill", "decode")
LAUNCHERS = (("vllm", "serve"), ("python", "-m", "kvturn_server.local._vllm", "serve"))


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) is needed to render deploy/kubernetes"
    out = subprocess.run([kubectl, "kustomize", str(KUBE / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def objects(overlay: str, kind: str) -> list[dict[str, Any]]:
    return [o for o in render(overlay) if o["kind"] == kind]


def component(obj: dict[str, Any]) -> str:
    return str(obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"])


def workload(overlay: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in render(overlay) if o["kind"] in ("Deployment", "StatefulSet")
                and component(o) == name]
    return found


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion: known names are replaced, ``$$`` is a literal ``$``,
    anything else stays as written."""
    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, text)


class Pod:
    """One container of a rendered workload as the kubelet would start it: environment,
    command line, and the files its ConfigMap and Secret volumes put at their mount paths
    (written under ``root``; paths on the command line are rewritten to those copies)."""

    def __init__(self, overlay: str, obj: dict[str, Any], container: dict[str, Any],
                 root: Path) -> None:
        self.container = container
        configmaps = {c["metadata"]["name"]: c.get("data", {})
                      for c in objects(overlay, "ConfigMap")}
        spec = obj["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        self.mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            files: dict[str, str] = {}
            if "configMap" in volume:
                files = configmaps[volume["configMap"]["name"]]
            elif "secret" in volume:
                # Secrets are created by hand (docs/deploy.md); any valid value stands in.
                assert volume["secret"]["secretName"] == "kvturn-control-secret"
                files = {"control.secret": "s3cret-s3cret-s3cret-0123456789\n"}
            else:
                continue
            local = root / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            for key, value in files.items():
                (local / key).write_text(value)
            self.mounts[mount["mountPath"]] = local
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            env.update(configmaps[source["configMapRef"]["name"]])
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = self.local_path(expand(var["value"], env))
            elif "fieldRef" in var["valueFrom"]:
                assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
                env[var["name"]] = POD_IP
            elif "configMapKeyRef" in var["valueFrom"]:
                ref = var["valueFrom"]["configMapKeyRef"]
                env[var["name"]] = configmaps[ref["name"]][ref["key"]]
            else:
                assert var["valueFrom"]["secretKeyRef"].get("optional"), var
        self.env = env
        self.argv = [self.local_path(expand(a, env))
                     for a in (*container.get("command", ()), *container.get("args", ()))]
        unexpanded = [a for a in self.argv if "$(" in a]
        assert not unexpanded, f"left unexpanded by the kubelet: {unexpanded}"

    def local_path(self, text: str) -> str:
        for mount, local in self.mounts.items():
            text = re.sub(rf"(?<![\w/]){re.escape(mount)}(?=/)", str(local), text)
        return text

    def port(self, name: str) -> int:
        (port,) = [p["containerPort"] for p in self.container["ports"] if p["name"] == name]
        return int(port)


def pod(overlay: str, name: str, root: Path) -> Pod:
    obj = workload(overlay, name)
    return Pod(overlay, obj, obj["spec"]["template"]["spec"]["containers"][0], root / name)


@functools.cache
def vllm_parser() -> argparse.ArgumentParser:
    """``vllm serve``'s own argument parser (built as vLLM's CLI builds it)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser: argparse.ArgumentParser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    return parser


def vllm_args(argv: list[str]) -> argparse.Namespace:
    for launcher in LAUNCHERS:
        if tuple(argv[:len(launcher)]) == launcher:
            return vllm_parser().parse_args(argv[len(launcher):])
    raise AssertionError(f"not a vllm serve command line: {shlex.join(argv)}")


# --- rendering and schemas -----------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay: str, version: str) -> None:
    import kubernetes_validate

    kinds = {o["kind"] for o in render(overlay)}
    assert {"Deployment", "StatefulSet", "Service", "NetworkPolicy", "PodDisruptionBudget",
            "ConfigMap"} <= kinds
    for obj in render(overlay):
        # strict: unknown fields (a typo such as "readinesProbe") fail too.
        kubernetes_validate.validate(obj, version, strict=True)


def test_base_alone_renders() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(KUBE / "base")], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr


# --- the router ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_command_is_parsed_by_kvturn(overlay: str, tmp_path: Path) -> None:
    router = pod(overlay, "router", tmp_path)
    assert router.argv[:2] == ["kvturn", "router"]
    args = build_parser().parse_args(router.argv[1:])
    assert args.func.__name__ == "cmd_router"
    config = router_config_from_args(args, environ=router.env)

    assert (config.host, config.port) == (POD_IP, router.port("http"))
    assert config.control_secret, "the router must send the decodes' control secret"
    assert config.state == "redis://kvturn-redis:6379/0"
    (redis,) = [s for s in objects(overlay, "Service") if s["metadata"]["name"] == "kvturn-redis"]
    assert redis["spec"]["ports"][0]["port"] == 6379
    # Every KVTURN_* variable names a router flag (the env convention: --foo-bar -> KVTURN_FOO_BAR).
    flags = {o for a in build_parser()._subparsers._group_actions[0].choices["router"]._actions
             for o in a.option_strings}
    for name in router.env:
        if name.startswith("KVTURN_"):
            assert "--" + name.removeprefix("KVTURN_").lower().replace("_", "-") in flags, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_lists_every_engine_pod(overlay: str, tmp_path: Path) -> None:
    """The router's backends are exactly the StatefulSets' pods, on their HTTP and control
    ports, by the names their headless Services give them."""
    router = pod(overlay, "router", tmp_path)
    config = router_config_from_args(build_parser().parse_args(router.argv[1:]),
                                     environ=router.env)
    services = {s["metadata"]["name"]: s for s in objects(overlay, "Service")}
    expected: dict[str, set[tuple[str, int, int]]] = {}
    for role in ENGINES:
        obj = workload(overlay, role)
        engine = pod(overlay, role, tmp_path)
        headless = services[obj["spec"]["serviceName"]]
        assert headless["spec"]["clusterIP"] == "None"
        name = obj["metadata"]["name"]
        expected[role] = {(f"{name}-{i}.{headless['metadata']['name']}", engine.port("http"),
                           engine.port("control"))
                          for i in range(obj["spec"]["replicas"])}
    prefill = {(urlsplit(u).hostname, urlsplit(u).port) for u in config.prefill}
    assert prefill == {(host, http) for host, http, _ in expected["prefill"]}
    decode = set()
    for spec in config.decode:
        url, control = urlsplit(spec.url), urlsplit(spec.control)
        assert url.hostname == control.hostname
        decode.add((url.hostname, url.port, control.port))
    assert decode == expected["decode"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_replicas_probes_and_disruption_budget(overlay: str) -> None:
    router = workload(overlay, "router")
    assert router["spec"]["replicas"] >= 2
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    (pdb,) = objects(overlay, "PodDisruptionBudget")
    labels = router["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert 1 <= pdb["spec"]["minAvailable"] < router["spec"]["replicas"]


# --- prefill and decode ----------------------------------------------------------------------


def engine_cases() -> Iterator[tuple[str, str]]:
    for overlay in OVERLAYS:
        for role in ENGINES:
            yield overlay, role


@pytest.mark.parametrize(("overlay", "role"), list(engine_cases()))
def test_engine_command_is_parsed_by_vllm_and_the_connector(overlay: str, role: str,
                                                             tmp_path: Path) -> None:
    engine = pod(overlay, role, tmp_path)
    args = vllm_args(engine.argv)
    assert args.model_tag == engine.env["MODEL"]
    assert (args.host, args.port) == (POD_IP, engine.port("http"))
    kv = args.kv_transfer_config
    assert kv.kv_connector == "KVTurnConnector"
    assert kv.kv_connector_module_path == "kvturn_server.connector"
    assert kv.kv_role == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    assert kv.kv_load_failure_policy == "recompute"
    config = ConnectorConfig.from_extra(kv.kv_connector_extra_config)

    # Nothing a peer dials may be loopback or a wildcard: each is this pod's own address.
    assert config.control_host == POD_IP
    assert config.control_port == engine.port("control")
    assert engine.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == POD_IP
    assert int(engine.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == engine.port("nixl")
    assert engine.env["VLLM_HOST_IP"] == POD_IP
    # The control secret comes from the mounted Secret, as a file.
    secret = Path(engine.env["KVTURN_CONTROL_SECRET_FILE"])
    assert secret.is_file() and secret.is_relative_to(tmp_path)
    if role == "decode":
        assert config.retention_budget > 0
        # A turn the decode continues alone reports the cached tokens of its usage.
        assert args.enable_prompt_tokens_details


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_retention_lease_agrees_between_router_and_decodes(overlay: str,
                                                           tmp_path: Path) -> None:
    router = pod(overlay, "router", tmp_path)
    config = router_config_from_args(build_parser().parse_args(router.argv[1:]),
                                     environ=router.env)
    decode = ConnectorConfig.from_extra(
        vllm_args(pod(overlay, "decode", tmp_path).argv).kv_transfer_config
        .kv_connector_extra_config)
    assert config.retention_ttl == decode.decoder_kv_blocks_ttl


def test_gpu_engines_get_a_gpu_and_the_cpu_demo_builds_its_model(tmp_path: Path) -> None:
    for role in ENGINES:
        gpu = workload("gpu", role)["spec"]["template"]["spec"]
        assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert "kv_buffer_device" not in pod("gpu", role, tmp_path / "g").env[
            "KV_TRANSFER_CONFIG"], "the connector refuses a host staging buffer on GPUs"

        demo = workload("cpu-demo", role)["spec"]["template"]["spec"]
        (init,) = demo["initContainers"]
        build = build_parser().parse_args(init["command"][1:])
        assert init["command"][0] == "kvturn" and build.func.__name__ == "cmd_model_build"
        engine = pod("cpu-demo", role, tmp_path / "c")
        assert vllm_args(engine.argv).model_tag == str(build.dir)
        (mount,) = [m for m in init["volumeMounts"] if str(build.dir).startswith(m["mountPath"])]
        assert any(m["name"] == mount["name"] for m in demo["containers"][0]["volumeMounts"])
        assert vllm_args(engine.argv).kv_transfer_config.kv_buffer_device == "cpu"


# --- network policy --------------------------------------------------------------------------


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engine_ports_are_reachable_only_from_the_fleet(overlay: str, tmp_path: Path) -> None:
    """docs/connector.md, "Network exposure": HTTP, control and NIXL ports of the engines, and
    Redis, take traffic from fleet pods only; the router's port is the way in."""
    policies = objects(overlay, "NetworkPolicy")
    labels = {name: workload(overlay, name)["spec"]["template"]["metadata"]["labels"]
              for name in (*ENGINES, "router", "redis")}
    fleet = [labels[name] for name in (*ENGINES, "router")]
    for name in (*ENGINES, "redis"):
        applying = [p for p in policies if selects(p["spec"]["podSelector"], labels[name])]
        assert applying, f"no NetworkPolicy selects the {name} pods (all ingress open)"
        for policy in applying:
            assert "Ingress" in policy["spec"]["policyTypes"]
            for rule in policy["spec"].get("ingress", []):
                assert rule.get("from"), f"{policy['metadata']['name']} opens {name} to all"
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}, peer
                    assert any(selects(peer["podSelector"], member) for member in fleet)
    # The engines' HTTP and control ports: from routers only, not from each other's peers
    # outside the fleet; the router's own port is open.
    engine = pod(overlay, "decode", tmp_path)
    router_rules = [rule for p in policies if selects(p["spec"]["podSelector"], labels["decode"])
                    for rule in p["spec"]["ingress"]
                    if any(selects(peer["podSelector"], labels["router"]) for peer in rule["from"])]
    allowed = {port["port"] for rule in router_rules for port in rule.get("ports", [])}
    assert allowed == {engine.port("http"), engine.port("control")}
    router_policies = [p for p in policies if selects(p["spec"]["podSelector"], labels["router"])]
    open_ports = {port["port"] for p in router_policies for rule in p["spec"]["ingress"]
                  if not rule.get("from") for port in rule["ports"]}
    assert open_ports == {8000}


# --- images ----------------------------------------------------------------------------------


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(instruction, arguments) of each line, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


DOCKERFILES = ("router.Dockerfile", "vllm-connector.Dockerfile", "vllm-cpu.Dockerfile")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_what_the_repository_has(name: str) -> None:
    lines = dockerfile(name)
    assert lines[0][0] in ("FROM", "ARG")
    copies = [shlex.split(rest) for instruction, rest in lines if instruction == "COPY"]
    assert copies
    for *sources, _dest in copies:
        for source in sources:
            assert not source.startswith("--"), "no COPY --from stages: keep the images simple"
            assert (ROOT / source).exists(), f"{name}: COPY {source} is not in the repository"
    # A build that leaves out sdk/, server/ or integrations/ cannot build kvturn's wheel.
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"][
        "targets"]["wheel"]["packages"]
    copied = {source for *sources, _ in copies for source in sources}
    assert {p.split("/")[0] for p in packages} <= copied
    ignore = (DOCKER / f"{name}.dockerignore").read_text().split()
    assert all(f"!{source}" in ignore for source in copied)


def entrypoint(name: str) -> list[str]:
    (value,) = [rest for instruction, rest in dockerfile(name) if instruction == "ENTRYPOINT"]
    argv: list[str] = json.loads(value)
    return argv


def test_router_image_runs_the_manifests_router_command(tmp_path: Path) -> None:
    argv = entrypoint("router.Dockerfile")
    assert argv == ["kvturn", "router"]
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][
        "kvturn"] == "kvturn_server.cli:main"
    router = pod("gpu", "router", tmp_path)
    assert router.argv[:2] == argv
    build_parser().parse_args([*argv[1:], *router.argv[2:]])


@pytest.mark.parametrize(("name", "overlay"), [("vllm-connector.Dockerfile", "gpu"),
                                               ("vllm-cpu.Dockerfile", "cpu-demo")])
def test_engine_image_runs_the_manifests_vllm_command(name: str, overlay: str,
                                                      tmp_path: Path) -> None:
    argv = entrypoint(name)
    assert tuple(argv) in LAUNCHERS
    for role in ENGINES:
        engine = pod(overlay, role, tmp_path / role)
        assert engine.argv[:len(argv)] == argv
        vllm_args(engine.argv)
