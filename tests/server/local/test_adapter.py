"""The local LoRA adapter: deterministic, PEFT-shaped, sized for the local model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from kvturn_server.local import SIZES, build_lora_adapter


def test_building_twice_gives_the_same_bytes_and_seeds_differ(tmp_path: Path) -> None:
    files = ("adapter_model.safetensors", "adapter_config.json")
    one, two, other = (build_lora_adapter(tmp_path / name, seed=seed)
                       for name, seed in (("one", 1), ("two", 1), ("other", 2)))
    assert all((one / f).read_bytes() == (two / f).read_bytes() for f in files)
    assert (one / files[0]).read_bytes() != (other / files[0]).read_bytes()


def test_the_adapter_fits_the_tiny_model(tmp_path: Path) -> None:
    spec = SIZES["tiny"]
    out = build_lora_adapter(tmp_path, seed=1, rank=4)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
        assert len(keys) == spec.num_layers * 2 * 2
        v_b = f.get_tensor("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight")
        q_a = f.get_tensor("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight")
    assert tuple(v_b.shape) == (spec.num_kv_heads * spec.head_dim, 4)
    assert tuple(q_a.shape) == (4, spec.hidden_size)


def test_an_unknown_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model size"):
        build_lora_adapter(tmp_path, seed=1, size="huge")
