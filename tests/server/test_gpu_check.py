"""scripts/gpu-check.sh, which only a GPU machine runs: its syntax, its options, and that every
kvturn command it would run is accepted by kvturn's own parser (its --dry-run prints them)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

from kvturn_server.bench import bench_config
from kvturn_server.bench._fleet import fleet_config
from kvturn_server.bench._fleet import settings_from_args as fleet_settings_from_args
from kvturn_server.bench._fleet_plan import scenarios
from kvturn_server.bench._reuse_cli import settings_from_args
from kvturn_server.cli import build_parser
from kvturn_server.local import SIZES
from kvturn_server.local._launch import kv_transfer_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True,
                          text=True, timeout=60, check=False, cwd=ROOT)


def test_the_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=60)
    if shutil.which("shellcheck"):
        out = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True,
                             timeout=60, check=False)
        assert out.returncode == 0, out.stdout


def test_dry_run_commands_parse_with_kvturns_cli(tmp_path: Path) -> None:
    out = dry_run("--out", str(tmp_path), "--runs", "2", "--gpu-share", "0.45",
                  "--fleet-share", "0.3")
    assert out.returncode == 0, out.stderr
    steps = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert {"install", "contract", "model", "bench-reuse", "bench-fleet"} <= set(steps)
    assert "[gpu," in shlex.split(steps["install"])[-1]

    model = shlex.split(steps["model"])
    build = build_parser().parse_args(model[1:])
    assert model[0].endswith("/kvturn") and build.func.__name__ == "cmd_model_build"
    assert build.size == "8b"

    bench = shlex.split(steps["bench-reuse"])
    args = build_parser().parse_args(bench[1:])
    assert args.func.__name__ == "cmd_bench_reuse"
    settings = settings_from_args(args)
    assert settings.gpu and settings.size == "8b" and settings.runs == 2
    assert settings.vllm_args == ("--gpu-memory-utilization=0.45",)
    # The bench stack serves the model directory the model step builds.
    cfg = bench_config(settings.state_dir, {}, size=settings.size)
    assert cfg.model_path == build.dir
    settings.check(cfg.max_model_len)

    fleet = shlex.split(steps["bench-fleet"])
    args = build_parser().parse_args(fleet[1:])
    assert args.func.__name__ == "cmd_bench_fleet"
    assert args.json == tmp_path / "bench-fleet.json"  # beside bench-reuse.json
    fleet_settings = fleet_settings_from_args(args)
    assert fleet_settings.gpu and fleet_settings.size == "8b"
    assert fleet_settings.vllm_args == ("--gpu-memory-utilization=0.3",)
    # Three instances (two prefills, a decode) fit their shares of the one GPU.
    assert (fleet_settings.prefills + fleet_settings.decodes) * 0.3 <= 0.9
    for scenario in scenarios(fleet_settings):  # every scenario fits the 8b model's context
        fleet_cfg = fleet_config(fleet_settings, scenario)
        assert fleet_cfg.model_path == build.dir  # the model the model step builds
        assert fleet_cfg.kv_buffer_device is None  # the GPU's memory, not a host buffer
        # roomy: no block count computed for the CPU build's 128-token blocks
        assert scenario.prefill_num_blocks is None
        assert fleet_cfg.stack_config().extra_vllm_args == (
            "--enable-prompt-tokens-details", *fleet_settings.vllm_args)


def test_bad_options_are_refused() -> None:
    for args in (["--bogus"], ["--runs"], ["--gpu-share", "1.5"], ["--runs", "x"],
                 ["--fleet-share", "1"], ["--fleet-agents", "-1"]):
        out = dry_run(*args)
        assert out.returncode == 2, args
        assert "gpu-check:" in out.stderr


def test_the_gpu_bench_stack_keeps_kv_on_the_gpu(tmp_path: Path) -> None:
    gpu = bench_config(tmp_path, {}, size="8b", gpu=True,
                       vllm_args=("--gpu-memory-utilization=0.4",))
    cpu = bench_config(tmp_path, {})
    # The connector refuses a host staging buffer on an accelerator (docs/connector.md).
    for role in ("kv_producer", "kv_consumer"):
        assert "kv_buffer_device" not in kv_transfer_config(gpu, role)
        assert kv_transfer_config(cpu, role)["kv_buffer_device"] == "cpu"
    assert gpu.extra_vllm_args == ("--gpu-memory-utilization=0.4",)
    assert gpu.model_size == "8b" and gpu.served_model_name == "kvturn-8b"


def test_the_8b_size_has_a_real_8b_models_kv_shape() -> None:
    spec = SIZES["8b"]
    # Llama 3.1 8B: 32 layers, 8 KV heads of 128 dims: 128 KiB of bfloat16 KV per token.
    kv_bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2
    assert kv_bytes_per_token == 128 * 1024
    params = (spec.vocab_size * spec.hidden_size * 2 + spec.num_layers * (
        2 * spec.hidden_size ** 2 + 2 * spec.hidden_size * spec.num_kv_heads * spec.head_dim
        + 3 * spec.hidden_size * spec.intermediate_size))
    assert 7.9e9 < params < 8.1e9
