"""Build the local test/benchmark model: no network, byte-identical on every build.

A Llama-architecture config, seeded random weights in safetensors, a byte-level BPE tokenizer
trained on generated text (``_corpus``) and a ChatML/hermes chat template. Every file is written
from data we control with sorted keys, so building twice gives the same bytes.

Random weights make gibberish, but deterministic gibberish: greedy output is a function of the
exact prompt KV, which is what reuse tests compare. The ``tiny`` model is float32: in bfloat16 a
disaggregated decode (which computes the last prompt token with the decode attention kernel)
and a single instance (which computes it inside the prefill) round differently, and greedy
output of a random model parts on near-ties (measured: 12 of 18 turns of 300 tokens differed,
first at token 31-296; in float32, 0 of 18). ``bench`` stays bfloat16, as served in production.

The LM head is untied and attention weights are scaled up so that the next token depends on the
whole context rather than echoing the last token (with tied embeddings a random 2-layer model
mostly repeats its input token). The LM head can only pick whole words (a leading space and
letters, one vocabulary entry each, ``word_token_ids``): a random model otherwise emits token
sequences that the tokenizer would split differently once the reply is sent back as text, so
the next turn's prompt would not contain the tokens the decode generated. Real models mostly
emit canonical tokens; this makes the test model do the same (measured: 600 of 600 random word
sequences re-tokenize to the same ids, also after a newline). Where a grammar rules words out
(a forced tool call's envelope and JSON), the longest allowed token wins, as a trained model's
would, instead of the lowest id: a constant channel (dimension 0 of the residual stream, set by
every embedding, written by no layer) gives each non-word token a small logit proportional to
its length. ``<tool_call>`` then is one token, not eleven.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvturn_server.local._chat_template import CHAT_TEMPLATE
from kvturn_server.local._corpus import training_text

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added as ordinary (non-special) tokens: they must survive detokenisation so that vLLM's hermes
# parser sees the tags, and the parser looks them up as single vocabulary entries.
TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
              "</think>")
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "chat_template.jinja", "kvturn-model.json")


@dataclass(frozen=True)
class ModelSize:
    """Shape of one model size. ``bench`` is heavier per token so that prefill dominates TTFT."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_positions: int
    dtype: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize("tiny", 2048, 256, 512, 2, 4, 2, 8192, "float32"),
    "bench": ModelSize("bench", 4096, 512, 1536, 6, 8, 2, 32768, "bfloat16"),
    # The shape of Llama 3.1 8B (random weights, 16 GB): GPU checks without downloading a model
    # (scripts/gpu-check.sh). KV per token is a real 8B model's: 128 KiB in bfloat16.
    "8b": ModelSize("8b", 128256, 4096, 14336, 32, 32, 8, 32768, "bfloat16"),
}
SEED = 0
FORMAT = 5
CONSTANT = 2.0  # the value of the constant channel in every embedding
LENGTH_BONUS = 0.1  # non-word logit per byte of the token, times the channel after the norm
"""Bumps when a build's bytes change, so that older builds on disk are rebuilt."""


def build_model(size: str, out_dir: Path) -> Path:
    """Write the model of ``size`` into ``out_dir`` (created if needed) and return it."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}")
    spec = SIZES[size]
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _write_tokenizer(spec, out_dir)
    _write_json(out_dir / "config.json", _config(spec))
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0})
    _write_weights(spec, out_dir / "model.safetensors", word_token_ids(tokenizer),
                   _token_lengths(tokenizer, spec.vocab_size))
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    # Written last: its presence marks a complete build (see ``is_built``).
    _write_json(out_dir / "kvturn-model.json", {"size": size, "seed": SEED, "format": FORMAT})
    return out_dir


def is_built(out_dir: Path, size: str) -> bool:
    """True when ``out_dir`` holds a finished build of ``size``."""
    marker = out_dir / "kvturn-model.json"
    if not marker.is_file() or not all((out_dir / f).is_file() for f in FILES):
        return False
    try:
        data = json.loads(marker.read_text())
        return bool(data["size"] == size and data.get("format") == FORMAT)
    except (ValueError, KeyError):
        return False


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _config(spec: ModelSize) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "dtype": spec.dtype,
        "torch_dtype": spec.dtype,
    }


def word_token_ids(tokenizer: Any) -> list[int]:
    """Ids of the tokens that are one whole word with a leading space and that the tokenizer
    gives back unchanged when their text is encoded again."""
    ids = []
    for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        word = token[1:]
        if not (token.startswith("\u0120") and len(word) >= 2 and word.isascii()
                and word.isalpha()):
            continue
        if tokenizer.encode(tokenizer.decode([token_id]), add_special_tokens=False).ids == [
                token_id]:
            ids.append(token_id)
    return ids


def _token_lengths(tokenizer: Any, vocab_size: int) -> list[int]:
    """Bytes of each token id's text; 0 for whitespace (a grammar that allows whitespace
    between JSON values would otherwise fill the output with the longest run of it) and for
    the padding ids past the tokenizer's vocabulary."""
    lengths = [0] * vocab_size
    for token_id in tokenizer.get_vocab().values():
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        lengths[token_id] = 0 if text.isspace() else len(text.encode("utf-8"))
    return lengths


def _write_tokenizer(spec: ModelSize, out_dir: Path) -> Any:
    # Training is parallel in Rust; one thread keeps merge tie-breaking identical on every run.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(TAG_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(SEED), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    if tok.get_vocab_size() > spec.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, model {spec.vocab_size}")
    data = json.loads(tok.to_str())
    _write_json(out_dir / "tokenizer.json", data)
    tokenizer = Tokenizer.from_str(json.dumps(data))
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": spec.max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })
    return tokenizer


def _write_weights(spec: ModelSize, path: Path, word_ids: list[int],
                   lengths: list[int]) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED)
    dtype = getattr(torch, spec.dtype)

    def normal(*shape: int, std: float) -> torch.Tensor:
        # Drawn in float32 and rounded to bfloat16 first for every size, so the sizes share one
        # weight distribution; float32 models just keep the rounded values exactly.
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16).to(dtype)

    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": _constant_channel(normal(spec.vocab_size, h, std=1.0)),
        "lm_head.weight": _word_head(normal(spec.vocab_size, h, std=h**-0.5), word_ids,
                                     lengths),
        "model.norm.weight": torch.ones(h, dtype=dtype),
    }
    # Large q/k scales give peaked attention, so output depends on specific earlier tokens.
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(h, h, std=2.0 * h**-0.5)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, h, std=2.0 * h**-0.5)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, h, std=h**-0.5)
        tensors[p + "self_attn.o_proj.weight"] = _no_write(normal(h, h, std=h**-0.5))
        tensors[p + "mlp.gate_proj.weight"] = normal(spec.intermediate_size, h, std=h**-0.5)
        tensors[p + "mlp.up_proj.weight"] = normal(spec.intermediate_size, h, std=h**-0.5)
        tensors[p + "mlp.down_proj.weight"] = _no_write(normal(
            h, spec.intermediate_size, std=spec.intermediate_size**-0.5))
        tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _constant_channel(embeddings: Any) -> Any:
    embeddings[:, 0] = CONSTANT
    return embeddings


def _no_write(weight: Any) -> Any:
    """A layer's output projection that leaves the constant channel alone."""
    weight[0, :] = 0
    return weight


def _word_head(head: Any, word_ids: list[int], lengths: list[int]) -> Any:
    """Words keep their rows, spread out (logit std about 4 rather than 1); every other token
    gets only a small length bonus on the constant channel, so a non-word logit (at most
    about 1.5) never beats the best word logit (about 3 standard deviations) unless a grammar
    has ruled the words out, and then the longest allowed token wins."""
    import torch

    if not word_ids:
        raise RuntimeError("the tokenizer has no whole-word tokens to generate")
    words = torch.zeros(head.shape[0], 1, dtype=head.dtype)
    words[word_ids] = 4
    head = head * words
    head[:, 0] = 0
    bonus = torch.tensor(lengths, dtype=head.dtype) * LENGTH_BONUS
    bonus[word_ids] = 0
    head[:, 0] = bonus
    return head
