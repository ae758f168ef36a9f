"""Build a LoRA adapter for the local test model: no network, byte-identical on every build.

Tests need two adapters that really change the model's output (so that KV computed under one
is wrong under the other) and that vLLM loads like any PEFT adapter: ``adapter_config.json``
plus ``adapter_model.safetensors`` with rank-``rank`` A and B matrices on every layer's query
and value projections, drawn from a seeded generator. The B matrices are large on purpose: a
random base model's logits are far apart, and a small update would leave greedy output alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvturn_server.local._model import SIZES

TARGETS = ("q_proj", "v_proj")
B_STD = 0.5
"""Scale of the B matrices. Measured on the tiny model: a 12-token greedy reply under an
adapter of seed 1 differed from the base model's from its first token."""


def build_lora_adapter(out_dir: Path, *, seed: int, size: str = "tiny", rank: int = 8) -> Path:
    """Write the adapter of ``seed`` for the model of ``size`` into ``out_dir`` and return it.
    Serve it with ``--enable-lora --max-lora-rank <rank> --lora-modules NAME=<out_dir>``."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}")
    import torch
    from safetensors.torch import save_file

    spec = SIZES[size]
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    outputs = {"q_proj": spec.hidden_size, "v_proj": spec.num_kv_heads * spec.head_dim}
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(spec.num_layers):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}."
            tensors[prefix + "lora_A.weight"] = (torch.randn(
                rank, spec.hidden_size, generator=gen) * spec.hidden_size**-0.5).to(dtype)
            tensors[prefix + "lora_B.weight"] = (torch.randn(
                outputs[target], rank, generator=gen) * B_STD).to(dtype)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
              "base_model_name_or_path": f"kvturn-{size}"}
    (out_dir / "adapter_config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out_dir
