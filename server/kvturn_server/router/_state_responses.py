"""Stored Responses: what the router keeps so that ``previous_response_id`` can be expanded.

The prefill and decode that served a response are different instances, and any of them may
serve the next turn, so neither can hold ``store``d responses (vLLM's own store is per process
and keeps no tool calls of the previous output). The router holds them instead: per stored
response, the full input it was given (already expanded) plus its output items, as one JSON
record (``_responses.py`` writes and reads them).

Two implementations with the same semantics (one test suite runs against both), beside the
conversation store and opened from the same ``state`` setting:

- a record lives ``ttl`` seconds from its last write, then ``get`` returns None;
- the table is bounded: past ``max_entries`` (and, in memory, ``max_bytes`` in all) the least
  recently used records go; ``put`` says how many;
- keys are the caller's (tenant-scoped by ``_responses.py``); values are opaque bytes.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from kvturn_server.router._state import StoreError


class ResponseStore(Protocol):
    """Key -> bytes with a TTL and an LRU cap; see the module docstring."""

    kind: str

    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes, ttl: float) -> int:
        """Insert or replace; returns how many records the cap evicted."""
        ...

    async def delete(self, key: str) -> bool: ...

    async def aclose(self) -> None: ...


class MemoryResponseStore:
    """In-process records, LRU-ordered, bounded by count and by total bytes."""

    kind = "memory"

    def __init__(self, *, max_entries: int = 100_000, max_bytes: int = 1 << 30,
                 clock: Callable[[], float] = time.time) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return entry[0]

    async def put(self, key: str, value: bytes, ttl: float) -> int:
        self._remove(key)
        self._entries[key] = (value, self._clock() + ttl)
        self._bytes += len(value)
        evicted = 0
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            old, (blob, _) = self._entries.popitem(last=False)
            self._bytes -= len(blob)
            evicted += 1
            if old == key:
                break  # a single record larger than max_bytes is not kept
        return evicted

    async def delete(self, key: str) -> bool:
        return self._remove(key)

    def _remove(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._bytes -= len(entry[0])
        return entry[1] > self._clock()

    async def aclose(self) -> None:
        return None


# KEYS: value, lru, seq.  ARGV: member, value, ttl_ms, cap, value prefix.
_PUT = """
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), ARGV[1])
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if over <= 0 then return 0 end
local victims = redis.call('ZRANGE', KEYS[2], 0, over - 1)
local gone = 0
for _, m in ipairs(victims) do
  if redis.call('DEL', ARGV[5] .. m) == 1 then gone = gone + 1 end
  redis.call('ZREM', KEYS[2], m)
end
return gone
"""

# KEYS: value, lru, seq.  ARGV: member.
_GET = """
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return false
end
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), ARGV[1])
return v
"""


class RedisResponseStore:
    """Records in Redis under ``{prefix}r:{key}`` (Redis expires them), with an LRU sorted set
    ``{prefix}rlru`` for the cap. Shared by router replicas, like the conversation store."""

    kind = "redis"

    def __init__(self, url: str, *, max_entries: int = 100_000, prefix: str = "kvturn:",
                 timeout: float = 2.0) -> None:
        import redis.asyncio as aioredis

        self.max_entries = max_entries
        self._values = f"{prefix}r:"
        self._lru = f"{prefix}rlru"
        self._seq = f"{prefix}rseq"
        self._redis: Any = aioredis.Redis.from_url(url, socket_timeout=timeout,
                                                   socket_connect_timeout=timeout)
        self._get = self._redis.register_script(_GET)
        self._put = self._redis.register_script(_PUT)

    async def get(self, key: str) -> bytes | None:
        raw = await self._run(self._get, [self._values + key, self._lru, self._seq], [key])
        return None if raw is None else bytes(raw)

    async def put(self, key: str, value: bytes, ttl: float) -> int:
        ttl_ms = max(1, math.ceil(ttl * 1000))
        return int(await self._run(self._put, [self._values + key, self._lru, self._seq],
                                   [key, value, ttl_ms, self.max_entries, self._values]))

    async def delete(self, key: str) -> bool:
        from redis.exceptions import RedisError

        try:
            removed = await self._redis.delete(self._values + key)
            await self._redis.zrem(self._lru, key)
        except RedisError as exc:
            raise StoreError(f"Redis response store: {type(exc).__name__}: {exc}") from exc
        return bool(removed)

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        from redis.exceptions import RedisError

        try:
            return await script(keys=keys, args=args)
        except RedisError as exc:
            raise StoreError(f"Redis response store: {type(exc).__name__}: {exc}") from exc


def open_response_store(url: str, *, max_entries: int, max_bytes: int, prefix: str = "kvturn:",
                        timeout: float = 2.0,
                        clock: Callable[[], float] = time.time) -> ResponseStore:
    """``memory`` or a Redis URL (the router's ``state``) -> a response store."""
    if url == "memory":
        return MemoryResponseStore(max_entries=max_entries, max_bytes=max_bytes, clock=clock)
    return RedisResponseStore(url, max_entries=max_entries, prefix=prefix, timeout=timeout)
