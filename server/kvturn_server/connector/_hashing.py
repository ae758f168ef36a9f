"""Content hashes of a token sequence, one per full KV block, chained.

A prefill may only read a retained block from a decode if that block holds the KV of exactly the
tokens the prefill would compute there, *and* everything before it is identical too (attention
makes block i's KV depend on every earlier token). Chaining each block's hash over the previous
hash gives that in one comparison: equal hash ``i`` means equal tokens
``0 .. (i + 1) * block_size``. So a verified prefix is found by comparing hashes left to right and
stopping at the first miss, with no token lists crossing the wire.

Token ids are not all that decides a block's KV: a LoRA adapter, an image behind placeholder
tokens, a ``cache_salt`` or prompt embeddings do too. Each block may therefore carry extra bytes
(``_extra_keys.py`` derives them from vLLM's own prefix-cache keys), hashed after its tokens; a
block without any hashes exactly as before, so plain text keeps its hashes.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Sequence

HASH_SIZE = 16
"""Bytes per block hash. 128 bits keeps accidental collisions out of reach for any realistic
number of blocks while halving what travels in ``kv_transfer_params`` compared with 256 bits."""

DEFAULT_SEED = b"kvturn-v1"

_MAX_TOKEN_ID = 2**32 - 1


def block_hashes(
    token_ids: Sequence[int], block_size: int, seed: bytes = DEFAULT_SEED,
    extras: Sequence[bytes | None] | None = None,
) -> list[bytes]:
    """Return one chained hash per *full* block of ``token_ids``.

    A trailing partial block gets no hash: its KV is incomplete, so no one can reuse it, and its
    tokens are always recomputed. Every token id is still range-checked, so a bad id is reported
    wherever it sits.

    The chain starts from a hash of ``seed`` and ``block_size``: sequences hashed with another
    seed (a future encoding, another model) or another block size never verify against each
    other, instead of matching by accident of layout.

    ``extras[i]``, when given and not empty, is hashed after block ``i``'s tokens. The token
    part has a fixed length, so a block with extras never hashes like one without, and two
    different extras never hash alike. ``extras`` must cover every full block.

    Raises:
        ValueError: ``block_size`` is not a positive int, a token id is not an int in
            ``0 .. 2**32 - 1`` (the encoding is little-endian uint32), or ``extras`` is
            shorter than the full blocks or holds something other than bytes or None.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(seed, bytes):
        raise ValueError(f"seed must be bytes, got {type(seed).__name__}")
    count = len(token_ids)
    try:
        # One pack call for the whole sequence keeps 16k tokens near half a millisecond, and
        # struct does the range and type check in C.
        packed = struct.pack(f"<{count}I", *token_ids)
    except struct.error as exc:
        raise ValueError(_describe_bad_token(token_ids)) from exc
    full = count // block_size
    if extras is not None:
        _check_extras(extras, full)
    view = memoryview(packed)
    stride = 4 * block_size
    prev = hashlib.blake2b(
        seed + struct.pack("<I", block_size), digest_size=HASH_SIZE).digest()
    out: list[bytes] = []
    for block, start in enumerate(range(0, full * stride, stride)):
        h = hashlib.blake2b(prev, digest_size=HASH_SIZE)
        h.update(view[start:start + stride])
        extra = extras[block] if extras is not None else None
        if extra:
            h.update(extra)
        prev = h.digest()
        out.append(prev)
    return out


def verified_prefix_blocks(local: Sequence[bytes], retained: Sequence[bytes]) -> int:
    """Return how many leading blocks have equal hashes in ``local`` and ``retained``.

    Because the hashes are chained, the first mismatch ends the verified prefix for good: any
    later equal hash would be a collision, not shared history, so the scan stops there.
    """
    verified = 0
    for mine, theirs in zip(local, retained, strict=False):
        if mine != theirs:
            break
        verified += 1
    return verified


def _check_extras(extras: Sequence[bytes | None], full: int) -> None:
    if len(extras) < full:
        raise ValueError(f"extras cover {len(extras)} blocks, the tokens {full} full blocks")
    for index, extra in enumerate(extras[:full]):
        if extra is not None and not isinstance(extra, bytes):
            raise ValueError(f"extras[{index}] must be bytes or None, got "
                             f"{type(extra).__name__}")


def _describe_bad_token(token_ids: Sequence[int]) -> str:
    # Only runs on the error path, so the per-item Python loop costs nothing in the common case.
    # operator.index accepts exactly what struct accepts (ints and int-like scalars such as
    # numpy's), so the message names the token struct actually choked on.
    for index, token in enumerate(token_ids):
        try:
            value = operator.index(token)
        except TypeError:
            return f"token id at position {index} is not an int: {token!r}"
        if not 0 <= value <= _MAX_TOKEN_ID:
            return f"token id at position {index} is outside 0..2**32-1: {value}"
    return "token ids cannot be encoded as uint32"
