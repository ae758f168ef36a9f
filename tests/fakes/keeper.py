"""A fake of vLLM's block pool and a manual clock, for the retention keeper and what sits on it.

``FakeBlockPool`` keeps vLLM's reference-count rules (``vllm/v1/core/block_pool.py``): block 0
is the null block and never free; ``touch`` takes a reference (a block at 0 leaves the free
queue); ``free_blocks`` drops one (a block reaching 0 joins it, its hash kept: still in the
prefix cache); ``allocate`` takes free blocks for new content (their hashes go). It is stricter
than vLLM in two ways that catch keeper bugs: a reference count going below zero raises, and, when
``owner`` is set, so does any call from a thread other than that one (the pool belongs to the
engine thread).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvturn_server.connector._keeper import RetentionKeeper
from kvturn_server.connector._lease import Retention
from kvturn_server.connector._params import HostRead, ReadCoordinates
from kvturn_server.connector._tiers import HostCounters, HostLoad

BS = 4


@dataclass
class FakeBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: object | None = None  # vLLM's once the block is full; None: not cached


class FakeBlockPool:
    def __init__(self, num_gpu_blocks: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.blocks: Sequence[FakeBlock] = [FakeBlock(i) for i in range(num_gpu_blocks)]
        self._free = set(range(1, num_gpu_blocks))
        self.freed: list[list[int]] = []  # block ids of each free_blocks call, in call order
        self.owner: int | None = None

    def _check_thread(self) -> None:
        if self.owner is not None and threading.get_ident() != self.owner:
            raise AssertionError("block pool used off the engine thread")

    def touch(self, blocks: Sequence[FakeBlock]) -> None:
        self._check_thread()
        for block in blocks:
            if block.ref_cnt == 0:
                self._free.discard(block.block_id)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[FakeBlock]) -> None:
        self._check_thread()
        ids = []
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and block.block_id != 0:
                self._free.add(block.block_id)
            ids.append(block.block_id)
        self.freed.append(ids)

    def get_num_free_blocks(self) -> int:
        return len(self._free)

    # What a live request does with the pool.

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (lowest ids first) for a request: one reference each."""
        ids = sorted(self._free)[:n]
        if len(ids) < n:
            raise AssertionError(f"pool has {len(ids)} free blocks, asked for {n}")
        self.touch([self.blocks[b] for b in ids])
        for b in ids:
            self.blocks[b].block_hash = None  # evicted from the prefix cache for new content
        return ids

    def hash_blocks(self, ids: Sequence[int]) -> None:
        """The request filled these blocks: vLLM gives each a hash of its own."""
        for b in ids:
            self.blocks[b].block_hash = ("hash", b, object())

    def share(self, ids: Sequence[int]) -> None:
        """A request hits these blocks in the prefix cache (one more reference each)."""
        self.touch([self.blocks[b] for b in ids])

    def release(self, ids: Sequence[int]) -> None:
        """The request is done with these blocks (vLLM frees a finished request's blocks)."""
        self.free_blocks([self.blocks[b] for b in ids])

    def refs(self, ids: Iterable[int] | None = None) -> list[int]:
        ids = range(1, self.num_gpu_blocks) if ids is None else ids
        return [self.blocks[b].ref_cnt for b in ids]

    @property
    def usable(self) -> int:
        return self.num_gpu_blocks - 1


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class FakeHostTier:
    """The decode's host tier as the keeper sees it (``_tiers.HostTier``): what it holds of
    each conversation is set by the test. Strict where the keeper could go wrong: it raises
    when called with the keeper's lock held (the real one takes its own lock and calls the
    keeper's ``standings`` with it), and, with ``owner`` set, when ``discard`` runs off the
    engine thread."""

    tokens_per_block = BS

    def __init__(self) -> None:
        self.resident: dict[str, int] = {}  # conversation -> tokens held
        self.discarded: list[list[str]] = []
        self.loads: dict[str, HostLoad] = {}
        self.counters = HostCounters()
        self.keeper: RetentionKeeper | None = None
        self.owner: int | None = None
        self.read_port: int | None = None  # serves host reads once set
        self.rows: dict[str, tuple[int, ...]] = {}  # conversation -> host rows of its blocks
        self.read_turns: list[str] = []  # the turn (request id) each host_read asked for

    def _check(self) -> None:
        if self.keeper is not None and self.keeper._lock.locked():
            raise AssertionError("host tier called with the keeper's lock held")

    def resident_tokens(self, conversation: str) -> int:
        self._check()
        return self.resident.get(conversation, 0)

    def discard(self, conversations: Iterable[str]) -> int:
        self._check()
        if self.owner is not None and threading.get_ident() != self.owner:
            raise AssertionError("host tier discard off the engine thread")
        conversations = list(conversations)
        self.discarded.append(conversations)
        for conversation in conversations:
            self.resident.pop(conversation, None)
        return len(conversations)

    def take_loaded(self, request_id: str) -> HostLoad | None:
        return self.loads.pop(request_id, None)

    def take_counters(self) -> HostCounters:
        counters, self.counters = self.counters, HostCounters()
        return counters

    def usage(self) -> dict[str, int]:
        return {"blocks": 64, "blocks_used": len(self.resident)}

    def host_read(self, conversation: str, request_id: str) -> HostRead | None:
        self._check()
        self.read_turns.append(request_id)
        rows = self.rows.get(conversation, ())
        if self.read_port is None or not rows:
            return None
        return HostRead("127.0.0.1", self.read_port, rows)


def coordinates(engine_id: str = "decode-engine",
                control_url: str | None = "http://127.0.0.1:8201") -> ReadCoordinates:
    """Where a prefill would read the fake decode (what the scheduler passes to the keeper)."""
    return ReadCoordinates(engine_id=engine_id, block_size=BS, host="10.0.0.7", port=5600,
                           tp_size=1, dcp_size=1, pp_size=1, transfer_mode="pull",
                           control_url=control_url)


def make_keeper(pool: FakeBlockPool | None, clock: Callable[[], float], *,
                budget: float = 1.0, ttl: float = 60.0, max_hold: float = 600.0,
                max_pin: float = 30.0, block_bytes: int = 1024,
                engine_id: str = "decode-engine",
                host: FakeHostTier | None = None) -> RetentionKeeper:
    keeper = RetentionKeeper(block_bytes=block_bytes, budget=budget, ttl=ttl,
                             max_hold=max_hold, max_pin=max_pin, clock=clock)
    if host is not None:
        host.keeper = keeper
    if pool is not None:
        keeper.bind(pool, coordinates(engine_id), host)
    return keeper


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def finish(pool: FakeBlockPool, keeper: RetentionKeeper, key: str, request_id: str,
           n_blocks: int, *, shared: Sequence[int] = (), num_tokens: int | None = None,
           token_ids: Sequence[int] | None = None) -> tuple[list[int], Retention | None]:
    """Run one request through the pool the way vLLM does on a decode, retaining it.

    The request hits ``shared`` in the prefix cache, allocates ``n_blocks`` more, finishes
    (the connector retains it), and then vLLM frees the request's own references. Returns the
    request's block ids and what ``retain`` returned.
    """
    pool.share(shared)
    new = pool.allocate(n_blocks)
    pool.hash_blocks(new)
    ids = [*shared, *new]
    num_tokens = len(ids) * BS if num_tokens is None else num_tokens
    token_ids = tokens(num_tokens + 1) if token_ids is None else token_ids
    try:
        kept = keeper.retain(key, request_id, ids, token_ids, num_tokens)
    finally:
        pool.release(ids)
    return ids, kept
