"""What besides token ids decides a block's KV, per block, as vLLM's own prefix cache sees it.

Equal token ids do not mean equal KV: a LoRA adapter changes every layer's projections, the
placeholder tokens of an image are the same ids for every image, and ``cache_salt`` exists to
keep tenants from sharing cached KV at all. vLLM's prefix cache chains each block's hash over
"extra keys" for exactly these (the adapter's name and path, each multimodal item's hash and
offset in the block, the salt on block 0, a hash of the block's prompt embeddings). kvturn
asks vLLM for the same keys, with vLLM's own function, so that a retained block verifies
against a prompt only where vLLM would have let the two share a prefix-cache block.

The keys are reduced to one digest per block with vLLM's CBOR hash (canonical, the same on
every process and host). Anything that cannot be reduced that way (a key of a type CBOR does
not know, a multimodal item without an identifier) raises :class:`UncoverableInput`: the
caller then reads nothing (prefill) or retains nothing (decode), never hashes tokens alone.

The engine seed starts every chain from the model's identity, so that two engines serving
different weights never verify against each other even where NIXL's handshake check is off.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvturn_server.connector._hashing import DEFAULT_SEED


class UncoverableInput(ValueError):
    """The request carries input whose effect on the KV the chain cannot express."""


def block_extras(request: Any, num_blocks: int, block_size: int) -> list[bytes | None] | None:
    """One digest of vLLM's extra hash keys per full block of ``request``, or None if no
    block has any (a plain text request: its hashes stay those of its token ids).

    ``request`` is vLLM's ``Request``; blocks ``0 .. num_blocks`` are described.

    Raises:
        UncoverableInput: vLLM could not produce the keys, or they are not CBOR-encodable.
    """
    if num_blocks <= 0 or not _has_extra_inputs(request):
        return None
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    out: list[bytes | None] = []
    mm_index = 0
    try:
        for block in range(num_blocks):
            start = block * block_size
            keys, mm_index = generate_block_hash_extra_keys(
                request, start, start + block_size, mm_index)
            out.append(sha256_cbor(keys) if keys else None)
    except Exception as exc:  # any failure means: not verifiable, never "tokens only"
        raise UncoverableInput(
            f"the request's {_kinds(request)} cannot be covered by the verification hashes: "
            f"{type(exc).__name__}: {exc}") from exc
    return out if any(out) else None


def _has_extra_inputs(request: Any) -> bool:
    return bool(request.lora_request or request.mm_features or request.cache_salt
                or request.prompt_embeds is not None)


def _kinds(request: Any) -> str:
    kinds = [name for name, present in (
        ("LoRA adapter", request.lora_request), ("multimodal inputs", request.mm_features),
        ("cache_salt", request.cache_salt),
        ("prompt embeddings", request.prompt_embeds is not None)) if present]
    return ", ".join(kinds) or "inputs"


def engine_seed(vllm_config: Any) -> bytes:
    """The chain's seed for this engine: kvturn's seed plus what decides the weights and the
    KV's numbers (model, revision, dtype, quantization, KV-cache dtype, the model's config).

    Every member of a fleet must agree on these for any read to verify; they are what NIXL's
    own handshake compares too (model, dtypes), plus revision and config overrides.
    """
    model = vllm_config.model_config
    factors = {
        "model": str(model.model),
        "revision": model.revision,
        "dtype": str(model.dtype),
        "quantization": model.quantization,
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        # hf_config reflects --hf-overrides (rope scaling, layer counts): same path, other KV.
        "hf_config": model.hf_config.to_json_string(use_diff=False),
    }
    digest = hashlib.blake2b(json.dumps(factors, sort_keys=True, default=str).encode(),
                             digest_size=16).digest()
    return DEFAULT_SEED + b"/" + digest
