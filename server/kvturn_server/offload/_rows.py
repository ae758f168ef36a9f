"""Which host rows and device blocks one offloading transfer copies (no vLLM, no torch).

vLLM's offloading connector describes a transfer as device block ids (``GPULoadStoreSpec``: one
list for all KV-cache groups, ``group_sizes`` blocks per group, each group starting at logical
block ``block_indices[g]`` of its request) and host chunk ids (``CPULoadStoreSpec``), where a chunk
holds ``blocks_per_chunk`` device blocks. The host tier here keeps chunk ``c``'s block ``j`` in
row ``c * blocks_per_chunk + j``; a group whose first block is not chunk-aligned starts that many
rows into its first chunk, exactly as vLLM's own CUDA worker skips sub-blocks
(``vllm/v1/kv_offload/cpu/gpu_worker.py``, ``transfer_async``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupRows:
    """One KV-cache group's part of a transfer: ``device[i]`` pairs with ``host[i]``."""

    group: int
    device: tuple[int, ...]
    host: tuple[int, ...]

    def runs(self) -> list[tuple[int, int, int]]:
        """``(device start, host start, length)`` of each stretch where both sides are
        consecutive: one slice copy each instead of a gather into a temporary (the block pool and
        the host tier both hand out runs of consecutive ids most of the time)."""
        out: list[tuple[int, int, int]] = []
        for d, h in zip(self.device, self.host, strict=True):
            if out:
                d0, h0, n = out[-1]
                if d == d0 + n and h == h0 + n:
                    out[-1] = (d0, h0, n + 1)
                    continue
            out.append((d, h, 1))
        return out


def transfer_rows(device_blocks: Sequence[int], host_chunks: Sequence[int],
                  group_sizes: Sequence[int], block_indices: Sequence[int],
                  blocks_per_chunk: int) -> list[GroupRows]:
    """Pair every device block of a transfer with its host row, group by group.

    Raises ValueError when the two specs do not describe the same blocks (a count that does not
    add up would copy the wrong KV, never silently).
    """
    if blocks_per_chunk < 1:
        raise ValueError(f"blocks_per_chunk must be at least 1, got {blocks_per_chunk}")
    if len(group_sizes) != len(block_indices):
        raise ValueError(f"{len(group_sizes)} group sizes for {len(block_indices)} groups")
    if sum(group_sizes) != len(device_blocks):
        raise ValueError(f"group sizes {list(group_sizes)} do not add up to "
                         f"{len(device_blocks)} device blocks")
    out: list[GroupRows] = []
    device_at = host_at = 0
    for group, (size, first) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if size == 0:
            continue
        skip = first % blocks_per_chunk
        chunks = -(-(size + skip) // blocks_per_chunk)
        group_chunks = host_chunks[host_at:host_at + chunks]
        if len(group_chunks) != chunks:
            raise ValueError(f"group {group} needs {chunks} host chunks, the spec has "
                             f"{len(host_chunks) - host_at} left")
        rows = [c * blocks_per_chunk + j for c in group_chunks for j in range(blocks_per_chunk)]
        out.append(GroupRows(group, tuple(device_blocks[device_at:device_at + size]),
                             tuple(rows[skip:skip + size])))
        device_at += size
        host_at += chunks
    if host_at != len(host_chunks):
        raise ValueError(f"{len(host_chunks) - host_at} host chunks left over")
    return out
