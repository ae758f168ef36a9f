"""Where each NIXL region of a decode's KV lies in its host tier (no vLLM, no torch).

vLLM's NIXL worker advertises a decode's KV as regions: one per attention layer on a
block-major layout (K and V packed in one page), each a base address, the bytes a block
transfers (``block_lens``) and the distance between blocks (``block_strides``). The host tier
keeps one host tensor per KV tensor of the engine (``_worker.py``), block ``b`` of device tensor
``t`` copied to row ``r`` of host tensor ``t``. A prefill reads host rows over NIXL exactly as it
reads device blocks if every region has a host twin: same block length, the host tensor's row
stride, the host tensor's base. :func:`host_regions` finds the twins, or says why there are none
(a layout that interleaves layers in one allocation, a region that is not one tensor's pages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorPair:
    """One KV tensor of the engine and its host twin, as addresses and byte strides."""

    device_base: int
    device_stride: int
    device_blocks: int
    host_base: int
    host_stride: int
    page: int
    """Bytes of each block that the host tier copies."""


@dataclass(frozen=True)
class HostRegions:
    """The host twins of a decode's NIXL regions, in the decode's region order."""

    bases: list[int]
    block_lens: list[int]
    strides: list[int]


def host_regions(bases: Sequence[int], block_lens: Sequence[int],
                 block_strides: Sequence[int], tensors: Sequence[TensorPair]) -> HostRegions:
    """Map each NIXL region (``bases[i]``, ``block_lens[i]``, ``block_strides[i]``) onto the
    host tensor of the KV tensor it lies in.

    A region must start at the first block of one KV tensor (or a fixed offset into its page)
    and step by that tensor's block stride, and what it transfers of a block must lie within the
    page the host tier copies: otherwise host rows would not hold what the region names, and a
    read would return other bytes. Raises ValueError saying which region does not fit.
    """
    if not len(bases) == len(block_lens) == len(block_strides):
        raise ValueError(f"{len(bases)} region bases for {len(block_lens)} block lengths and "
                         f"{len(block_strides)} strides")
    out = HostRegions([], [], [])
    for i, (base, length, stride) in enumerate(zip(bases, block_lens, block_strides,
                                                   strict=True)):
        pair = next((t for t in tensors
                     if t.device_base <= base < t.device_base + t.device_stride), None)
        if pair is None:
            raise ValueError(f"region {i} (at {base:#x}) is not in the first block of any "
                             "KV tensor the host tier copies")
        if stride != pair.device_stride:
            raise ValueError(f"region {i} steps {stride} bytes a block, its KV tensor "
                             f"{pair.device_stride}: not one tensor's pages")
        offset = base - pair.device_base
        if offset + length > pair.page:
            raise ValueError(f"region {i} transfers bytes {offset}..{offset + length} of a "
                             f"block, the host tier copies {pair.page}")
        out.bases.append(pair.host_base + offset)
        out.block_lens.append(length)
        out.strides.append(pair.host_stride)
    return out
