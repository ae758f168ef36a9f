"""The Redis state store: ``MemoryStore``'s semantics, shared by replicas, kept across restarts.

Layout under ``prefix`` (default ``kvturn:``):

- ``{prefix}c:{key}``: the placement as JSON, with a Redis TTL at its deadline (so Redis
  cleans up after itself even if no router purges);
- ``{prefix}lru``: sorted set key -> use sequence number (the LRU order; a counter rather than
  a time, so that uses within one clock tick keep their order);
- ``{prefix}exp``: sorted set key -> deadline (store clock), for ``get`` and ``purge``;
- ``{prefix}seq``: the use counter.

Every operation is one Lua script, so it is atomic and one round trip. The scripts touch keys
they compute from the prefix, which a single Redis (or a replicated primary) allows; Redis
Cluster is not supported.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvturn_server.router._state import Placement, StoreError

# Forget member ``m``: its value (``key``) and its places in both sets; ``forget_all`` the
# members ``ms`` whose values are under prefix ``vp``.
_FORGET = """
local function forget(key, m, lru, exp)
  redis.call('DEL', key)
  redis.call('ZREM', lru, m)
  redis.call('ZREM', exp, m)
end
local function forget_all(ms, vp, lru, exp)
  for _, m in ipairs(ms) do forget(vp .. m, m, lru, exp) end
  return #ms
end
"""

# KEYS: value, lru, exp, seq.  ARGV: member, now.
_GET = _FORGET + """
local v = redis.call('GET', KEYS[1])
local dl = redis.call('ZSCORE', KEYS[3], ARGV[1])
if (not v) or (dl and tonumber(dl) <= tonumber(ARGV[2])) then
  forget(KEYS[1], ARGV[1], KEYS[2], KEYS[3])
  return false
end
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), ARGV[1])
return v
"""

# KEYS: value, lru, exp, seq.  ARGV: member, value, deadline, ttl_ms, cap, value prefix,
# version, now. -1: the live entry is newer (compare-and-set on the version).
_PUT = _FORGET + """
local old = redis.call('GET', KEYS[1])
local dl = redis.call('ZSCORE', KEYS[3], ARGV[1])
if old and ((not dl) or tonumber(dl) > tonumber(ARGV[8])) then
  local ok, rec = pcall(cjson.decode, old)
  if ok and type(rec) == 'table' and tonumber(rec['version'] or 0) > tonumber(ARGV[7]) then
    return -1
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if over <= 0 then return 0 end
return forget_all(redis.call('ZRANGE', KEYS[2], 0, over - 1), ARGV[6], KEYS[2], KEYS[3])
"""

# KEYS: value, lru, exp.  ARGV: member, turn ('' = any), now.
_DELETE = _FORGET + """
local v = redis.call('GET', KEYS[1])
if not v then
  forget(KEYS[1], ARGV[1], KEYS[2], KEYS[3])
  return 0
end
if ARGV[2] ~= '' and cjson.decode(v)['turn'] ~= ARGV[2] then return 0 end
local dl = redis.call('ZSCORE', KEYS[3], ARGV[1])
forget(KEYS[1], ARGV[1], KEYS[2], KEYS[3])
if dl and tonumber(dl) <= tonumber(ARGV[3]) then return 0 end
return 1
"""

# KEYS: lru, exp.  ARGV: now, value prefix, batch.
_PURGE = _FORGET + """
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
return forget_all(dead, ARGV[2], KEYS[1], KEYS[2])
"""


class RedisStore:
    """Conversation placements in Redis; see ``_state.py`` for the semantics."""

    kind = "redis"

    def __init__(self, url: str, *, max_entries: int = 100_000, remember_expired: float = 600.0,
                 prefix: str = "kvturn:", timeout: float = 2.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.url = url
        self.max_entries = max_entries
        self.remember_expired = remember_expired
        self.prefix = prefix
        self._clock = clock
        self._values = f"{prefix}c:"
        self._lru = f"{prefix}lru"
        self._exp = f"{prefix}exp"
        self._seq = f"{prefix}seq"
        self._redis: Any = aioredis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._get = self._redis.register_script(_GET)
        self._put = self._redis.register_script(_PUT)
        self._delete = self._redis.register_script(_DELETE)
        self._purge = self._redis.register_script(_PURGE)

    async def ping(self) -> None:
        try:
            await self._redis.ping()
        except RedisError as exc:
            raise StoreError(f"cannot reach the Redis state store at {_safe(self.url)}: "
                             f"{exc}") from exc

    async def get(self, key: str) -> Placement | None:
        raw = await self._run(self._get, [self._values + key, self._lru, self._exp, self._seq],
                              [key, repr(self._clock())])
        return None if raw is None else Placement.from_json(raw)

    async def put(self, key: str, placement: Placement) -> int:
        deadline = placement.expires_at + self.remember_expired
        ttl_ms = max(1, math.ceil((deadline - self._clock()) * 1000))
        evicted = await self._run(
            self._put, [self._values + key, self._lru, self._exp, self._seq],
            [key, placement.to_json(), repr(deadline), ttl_ms, self.max_entries, self._values,
             repr(placement.version), repr(self._clock())])
        return int(evicted)

    async def delete(self, key: str, *, turn: str | None = None) -> bool:
        removed = await self._run(self._delete, [self._values + key, self._lru, self._exp],
                                  [key, turn or "", repr(self._clock())])
        return bool(removed)

    async def size(self) -> int:
        try:
            return int(await self._redis.zcard(self._lru))
        except RedisError as exc:
            raise StoreError(f"Redis state store: {exc}") from exc

    async def purge(self) -> int:
        total = 0
        while True:
            removed = int(await self._run(self._purge, [self._lru, self._exp],
                                          [repr(self._clock()), self._values, 1000]))
            total += removed
            if removed < 1000:
                return total

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        return await run_script(script, keys, args, store="state store")


async def run_script(script: Any, keys: list[str], args: list[Any], *, store: str) -> Any:
    """Run a registered Lua script; a Redis fault comes out as a StoreError naming ``store``."""
    try:
        return await script(keys=keys, args=args)
    except RedisError as exc:
        raise StoreError(f"Redis {store}: {type(exc).__name__}: {exc}") from exc


def _safe(url: str) -> str:
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"
