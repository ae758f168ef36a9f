"""Stored Responses: what the router keeps so that ``previous_response_id`` can be expanded.

The prefill and decode that served a response are different instances, and any of them may
serve the next turn, so neither can hold ``store``d responses (vLLM's own store is per process
and keeps no tool calls of the previous output). The router holds them instead: per stored
response, the full input it was given (already expanded) plus its output items, as one JSON
record (``_responses.py`` writes and reads them).

Two implementations with the same semantics (one test suite runs against both), beside the
conversation store and opened from the same ``state`` setting:

- a record lives ``ttl`` seconds from its last write, then ``get`` returns None;
- the table is bounded: past ``max_entries`` records or ``max_bytes`` of values in all the least
  recently used records go; ``put`` says how many; a record larger than ``max_bytes`` on its
  own is not kept (and evicts nothing: one huge record must not empty every tenant's table);
- keys are the caller's (tenant-scoped by ``_responses.py``); values are opaque bytes.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol


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
        if len(value) > self.max_bytes:
            return 0
        self._entries[key] = (value, self._clock() + ttl)
        self._bytes += len(value)
        evicted = 0
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, (blob, _expires) = self._entries.popitem(last=False)
            self._bytes -= len(blob)
            evicted += 1
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


# Sizes are kept per member in a hash and summed in a counter, so that the byte cap holds across
# replicas as the entry cap does. A member whose value Redis expired keeps its size until the LRU
# order reaches it (the total then overstates: the cap errs on the side of evicting).
_FORGET = """
local function forget(m)
  redis.call('ZREM', KEYS[2], m)
  local s = redis.call('HGET', KEYS[4], m)
  if s then
    redis.call('HDEL', KEYS[4], m)
    redis.call('DECRBY', KEYS[5], s)
  end
end
"""

# KEYS: value, lru, seq, sizes, bytes.  ARGV: member, value, ttl_ms, cap, value prefix, max bytes.
_PUT = _FORGET + """
redis.call('DEL', KEYS[1])
forget(ARGV[1])
local size = string.len(ARGV[2])
if size > tonumber(ARGV[6]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('HSET', KEYS[4], ARGV[1], size)
redis.call('INCRBY', KEYS[5], size)
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), ARGV[1])
local gone = 0
while redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[4])
    or tonumber(redis.call('GET', KEYS[5]) or '0') > tonumber(ARGV[6]) do
  local m = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not m then break end
  if redis.call('DEL', ARGV[5] .. m) == 1 then gone = gone + 1 end
  forget(m)
end
return gone
"""

# KEYS: value, lru, seq, sizes, bytes.  ARGV: member.
_GET = _FORGET + """
local v = redis.call('GET', KEYS[1])
if not v then
  forget(ARGV[1])
  return false
end
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), ARGV[1])
return v
"""

# KEYS: value, lru, seq, sizes, bytes.  ARGV: member.
_DELETE = _FORGET + """
local removed = redis.call('DEL', KEYS[1])
forget(ARGV[1])
return removed
"""


class RedisResponseStore:
    """Records in Redis under ``{prefix}r:{key}`` (Redis expires them), with an LRU sorted set
    ``{prefix}rlru`` and their sizes (``{prefix}rsize``, summed in ``{prefix}rbytes``) for the
    caps. Shared by router replicas, like the conversation store."""

    kind = "redis"

    def __init__(self, url: str, *, max_entries: int = 100_000, max_bytes: int = 1 << 30,
                 prefix: str = "kvturn:", timeout: float = 2.0) -> None:
        import redis.asyncio as aioredis

        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._values = f"{prefix}r:"
        self._lru = f"{prefix}rlru"
        self._seq = f"{prefix}rseq"
        self._sizes = f"{prefix}rsize"
        self._bytes = f"{prefix}rbytes"
        self._redis: Any = aioredis.Redis.from_url(url, socket_timeout=timeout,
                                                   socket_connect_timeout=timeout)
        self._get = self._redis.register_script(_GET)
        self._put = self._redis.register_script(_PUT)
        self._delete = self._redis.register_script(_DELETE)

    def _keys(self, key: str) -> list[str]:
        return [self._values + key, self._lru, self._seq, self._sizes, self._bytes]

    async def get(self, key: str) -> bytes | None:
        raw = await self._run(self._get, self._keys(key), [key])
        return None if raw is None else bytes(raw)

    async def put(self, key: str, value: bytes, ttl: float) -> int:
        ttl_ms = max(1, math.ceil(ttl * 1000))
        return int(await self._run(self._put, self._keys(key),
                                   [key, value, ttl_ms, self.max_entries, self._values,
                                    self.max_bytes]))

    async def delete(self, key: str) -> bool:
        return bool(await self._run(self._delete, self._keys(key), [key]))

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        from kvturn_server.router._state_redis import run_script

        return await run_script(script, keys, args, store="response store")


def open_response_store(url: str, *, max_entries: int, max_bytes: int, prefix: str = "kvturn:",
                        timeout: float = 2.0,
                        clock: Callable[[], float] = time.time) -> ResponseStore:
    """``memory`` or a Redis URL (the router's ``state``) -> a response store."""
    if url == "memory":
        return MemoryResponseStore(max_entries=max_entries, max_bytes=max_bytes, clock=clock)
    return RedisResponseStore(url, max_entries=max_entries, max_bytes=max_bytes, prefix=prefix,
                              timeout=timeout)
