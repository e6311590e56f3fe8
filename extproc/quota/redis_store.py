"""``RedisStore``: quotas shared by every replica, one atomic Lua script per call (one round trip).

Keys of a tenant all carry the hash tag ``{tenant}``, so they live in one Redis Cluster slot and
one script may touch them all. Per scope (``t`` for the tenant, ``q:<class>`` for a QoS class)::

    llmgw:quota:{T}:<scope>:rq   HASH   bucket -> requests        (TTL 62 s after the last write)
    llmgw:quota:{T}:<scope>:tk   HASH   bucket -> tokens          (TTL 62 s)
                                        (and n: the live buckets' sum, p: the oldest not purged)
    llmgw:quota:{T}:<scope>:ls   ZSET   lease id -> expiry ms     (TTL: the newest lease's)
    llmgw:quota:{T}:<scope>:dy   HASH   UTC day -> tokens         (TTL 2 days)
    llmgw:quota:{T}:<scope>:dc   HASH   UTC day -> micro-dollars  (TTL 2 days)
    llmgw:quota:{T}:<scope>:mc   HASH   UTC month -> micro-dollars (TTL 62 days)
    llmgw:quota:{T}:open         HASH   lease id -> "tokens cost" charged (entries leave on release/expiry)

The scripts read the time with ``TIME`` (Redis's clock, not the replicas'), purge what has expired
(buckets that left the window, leases past their expiry: a dead worker's slot frees itself) and
mirror ``extproc.quota.limits`` exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

from redis import exceptions as redis_errors

from extproc.quota.cluster import ClusterConnection, pipelined
from extproc.quota.limits import (
    Admission,
    Figure,
    Lease,
    LimitKind,
    Limits,
    Quota,
    Verdict,
    scopes_of,
)
from extproc.quota.resp import PipelinedConnection, RedisReplyError
from extproc.quota.store import StoreUnavailable, tag

_ADMIT_KEYS = ("rq", "tk", "ls", "dy", "dc", "mc")
_KINDS = tuple(LimitKind)  # iterating the enum class itself is slow on the hot path
_SETTLE_KEYS = ("tk", "ls", "dy", "dc", "mc")
# A settlement that frees nothing another request waits for (no concurrency slot) may wait this
# long to share a write with others.
SETTLE_BATCH_S = 0.05

# Shared by the scripts: the clock and the window constants of extproc.quota.limits.
_PRELUDE = """
if redis.replicate_commands then pcall(redis.replicate_commands) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local BUCKET, SPAN, DAY, WINDOW_TTL, DAY_TTL, CONC_RETRY = 1000, 61, 86400000, 62000, 172800000, 1000
local MONTH_TTL = 62 * DAY
local b = math.floor(now / BUCKET)
local oldest = b - SPAN + 1
local today = math.floor(now / DAY)
local function month_of_day(z)  -- the UTC month (year * 12 + month - 1) of a day number (Hinnant's civil_from_days)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local y, m = yoe + era * 400, mp + 3
  if mp >= 10 then m = mp - 9; y = y + 1 end
  return y * 12 + m - 1
end
local function month_first_day(index)  -- the day number of the 1st of a month (Hinnant's days_from_civil)
  local y, m = math.floor(index / 12), index % 12 + 1
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m + 9
  if m > 2 then mp = m - 3 end
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + math.floor((153 * mp + 2) / 5)
  return era * 146097 + doe - 719468
end
local month = month_of_day(today)
local function extend(key, ms)  -- PEXPIRE that never shortens (a replica with a shorter lease TTL)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
end
local function each_chunk(list, fn)  -- unpack() has a stack limit: pass long lists in chunks
  for i = 1, #list, 1000 do fn(unpack(list, i, math.min(i + 999, #list))) end
end
"""

# KEYS: open, then per scope rq, tk, ls, dy, dc, mc.  ARGV: lease id, reserve, lease ttl ms, reserve
# cost, then per scope the six limits (rpm, tpm, concurrency, daily tokens, daily cost, monthly
# cost; -1 = none).
# Reply: admitted, refused kind, refused scope (1-based), retry ms (-1 none, -2 never), now,
# then per scope and kind: limit (-1 none), remaining, reset ms.
ADMIT = _PRELUDE + """
local lease, reserve, ttl, cost = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local KINDS, NKEYS = 6, 6
local nscopes = (#KEYS - 1) / NKEYS

local dead = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
each_chunk(dead, function(...) redis.call('HDEL', KEYS[1], ...) end)

-- What a window counts now. Purges the buckets that left since the last call (usually none or
-- one) and reads the running sum 'n': O(1), where summing the window would read 61 fields.
local function window_used(key)
  local state = redis.call('HMGET', key, 'n', 'p')
  local used, cursor = tonumber(state[1] or '0'), tonumber(state[2] or oldest)
  if not state[2] or cursor < oldest then
    if oldest - cursor > SPAN then  -- quiet for over a window (only settlements kept it): recount
      used = 0
      local flat, stale = redis.call('HGETALL', key), {}
      for i = 1, #flat, 2 do
        local bucket = tonumber(flat[i])
        if bucket ~= nil and bucket < oldest then stale[#stale + 1] = flat[i]
        elseif bucket ~= nil then used = used + tonumber(flat[i + 1]) end
      end
      each_chunk(stale, function(...) redis.call('HDEL', key, ...) end)
    elseif cursor < oldest then
      local gone = {}
      for bucket = cursor, oldest - 1 do gone[#gone + 1] = bucket end
      for _, count in ipairs(redis.call('HMGET', key, unpack(gone))) do
        if count then used = used - tonumber(count) end
      end
      redis.call('HDEL', key, unpack(gone))
    end
    redis.call('HSET', key, 'n', used, 'p', oldest)
  end
  return used
end

-- the live buckets of a window, oldest first (only to work out a refusal's wait)
local function window_items(key)
  local flat, items = redis.call('HGETALL', key), {}
  for i = 1, #flat, 2 do
    local bucket = tonumber(flat[i])
    if bucket ~= nil and bucket >= oldest then items[#items + 1] = {bucket, tonumber(flat[i + 1])} end
  end
  table.sort(items, function(x, y) return x[1] < y[1] end)
  return items
end

-- add to a window's bucket and to its running sum (window_used has set its cursor 'p')
local function window_add(key, bucket, n)
  redis.call('HINCRBY', key, bucket, n)
  redis.call('HINCRBY', key, 'n', n)
  redis.call('PEXPIRE', key, WINDOW_TTL)
end

-- what a per-period counter holds for the current period; periods before keep_from are purged
local function period_used(key, current, keep_from)
  if redis.call('HLEN', key) > 2 then
    for _, index in ipairs(redis.call('HKEYS', key)) do
      if tonumber(index) < keep_from then redis.call('HDEL', key, index) end
    end
  end
  return tonumber(redis.call('HGET', key, current) or '0')
end

-- returns fits, used, retry (-1 none, -2 never), reset
local function check_window(key, used, limit, need)
  if need > 0 and used + need <= limit then  -- it fits: full again when the current bucket leaves
    return true, used, -1, (b + SPAN) * BUCKET - now
  end
  local items = window_items(key)
  local newest = nil
  for _, item in ipairs(items) do if item[2] ~= 0 then newest = item[1] end end
  if used + need <= limit then
    local last = newest
    if need > 0 then last = b end
    if last == nil then return true, used, -1, 0 end
    return true, used, -1, (last + SPAN) * BUCKET - now
  end
  local reset = 0
  if newest ~= nil then reset = (newest + SPAN) * BUCKET - now end
  if need > limit then return false, used, -2, reset end
  local freed = 0
  for _, item in ipairs(items) do
    freed = freed + item[2]
    if used - freed + need <= limit then return false, used, (item[1] + SPAN) * BUCKET - now, reset end
  end
  return false, used, -2, reset
end

local reply = {1, -1, -1, -1, now}
local needs = {}  -- reply index of a remaining figure -> what this admission takes of it
local best = nil  -- the refusal with the longest wait (never = infinite)
for s = 1, nscopes do
  local k = NKEYS * (s - 1) + 1
  local rq, tk, ls, dy, dc, mc = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], KEYS[k + 5], KEYS[k + 6]
  local first = 4 + KINDS * (s - 1)  -- ARGV index before this scope's first limit
  local rq_used, tk_used = window_used(rq), window_used(tk)
  redis.call('ZREMRANGEBYSCORE', ls, '-inf', now)
  local live = redis.call('ZCARD', ls)
  local day_used = period_used(dy, today, today - 1)
  local day_cost, month_cost = 0, 0
  if cost > 0 or tonumber(ARGV[first + 5]) >= 0 or tonumber(ARGV[first + 6]) >= 0 then
    day_cost, month_cost = period_used(dc, today, today - 1), period_used(mc, month, month - 1)
  end
  for kind = 0, KINDS - 1 do
    local limit = tonumber(ARGV[first + kind + 1])
    local fits, used, retry, reset, need = true, 0, -1, 0, 0
    if limit >= 0 then
      if kind == 0 then
        need = 1
        fits, used, retry, reset = check_window(rq, rq_used, limit, 1)
      elseif kind == 1 then
        need = reserve
        fits, used, retry, reset = check_window(tk, tk_used, limit, reserve)
      elseif kind == 2 then
        need, used = 1, live
        fits = live + 1 <= limit
        if not fits and limit > 0 then retry = CONC_RETRY elseif not fits then retry = -2 end
      else  -- a budget per calendar period: tokens or cost per day, cost per month
        need, used, reset = reserve, day_used, (today + 1) * DAY - now
        if kind == 4 then need, used = cost, day_cost end
        if kind == 5 then need, used, reset = cost, month_cost, month_first_day(month + 1) * DAY - now end
        fits = used + need <= limit
        if not fits then
          if need > limit then retry = -2 else retry = reset end
        end
      end
      -- remaining is limit - used for now; the need is taken off below once all limits agreed
      reply[#reply + 1] = limit; reply[#reply + 1] = limit - used; reply[#reply + 1] = reset
      needs[#reply - 1] = need
      if not fits then
        local wait = retry
        if retry == -2 then wait = math.huge end
        if best == nil or wait > best then
          best = wait
          reply[1], reply[2], reply[3], reply[4] = 0, kind, s, retry
        end
      end
    else
      reply[#reply + 1] = -1; reply[#reply + 1] = 0; reply[#reply + 1] = 0
    end
  end
end
for i = 6, #reply, 3 do
  if reply[i] >= 0 then
    if reply[1] == 1 then reply[i + 1] = reply[i + 1] - needs[i + 1] end
    if reply[i + 1] < 0 then reply[i + 1] = 0 end
  end
end
if reply[1] == 0 then return reply end

local expires = now + ttl
for s = 1, nscopes do
  local k = NKEYS * (s - 1) + 1
  local rq, tk, ls, dy, dc, mc = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], KEYS[k + 5], KEYS[k + 6]
  window_add(rq, b, 1)
  if reserve > 0 then window_add(tk, b, reserve) end
  redis.call('HINCRBY', dy, today, reserve)
  redis.call('PEXPIRE', dy, DAY_TTL)
  if cost > 0 then
    redis.call('HINCRBY', dc, today, cost)
    redis.call('PEXPIRE', dc, DAY_TTL)
    redis.call('HINCRBY', mc, month, cost)
    redis.call('PEXPIRE', mc, MONTH_TTL)
  end
  redis.call('ZADD', ls, expires, lease)
  extend(ls, ttl)
end
redis.call('HSET', KEYS[1], lease, reserve .. ' ' .. cost)
extend(KEYS[1], ttl)
return reply
"""

# KEYS: open, then per scope tk, ls, dy, dc, mc.  ARGV: lease id, actual tokens (-1 = none),
# admitted ms, free (0/1), actual cost (-1 = none).  Reply: 1 if the lease was open.
SETTLE = _PRELUDE + """
local lease, actual, admitted, free = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4] == '1'
local actual_cost = tonumber(ARGV[5])
local NKEYS = 5
local nscopes = (#KEYS - 1) / NKEYS
local charged = redis.call('HGET', KEYS[1], lease)
-- move a per-period counter by delta; a refund to a period already purged has nothing to return to
local function move(key, period, delta, ttl)
  if delta > 0 or redis.call('HEXISTS', key, period) == 1 then
    redis.call('HINCRBY', key, period, delta)
    redis.call('PEXPIRE', key, ttl)
  end
end
if charged then
  local tokens, spent = string.match(charged, '^(%-?%d+) (%-?%d+)$')
  tokens, spent = tonumber(tokens), tonumber(spent)
  local day = math.floor(admitted / DAY)
  if actual >= 0 and actual ~= tokens then
    local delta = actual - tokens
    local bucket = math.floor(admitted / BUCKET)
    if bucket < oldest then
      if delta > 0 then bucket = b else bucket = nil end
    end
    for s = 1, nscopes do
      local k = NKEYS * (s - 1) + 1
      if bucket ~= nil then
        redis.call('HINCRBY', KEYS[k + 1], bucket, delta)
        redis.call('HINCRBY', KEYS[k + 1], 'n', delta)
        redis.call('HSETNX', KEYS[k + 1], 'p', oldest)
        redis.call('PEXPIRE', KEYS[k + 1], WINDOW_TTL)
      end
      move(KEYS[k + 3], day, delta, DAY_TTL)
    end
    tokens = actual
  end
  if actual_cost >= 0 and actual_cost ~= spent then
    local delta = actual_cost - spent
    for s = 1, nscopes do
      local k = NKEYS * (s - 1) + 1
      move(KEYS[k + 4], day, delta, DAY_TTL)
      move(KEYS[k + 5], month_of_day(day), delta, MONTH_TTL)
    end
    spent = actual_cost
  end
  redis.call('HSET', KEYS[1], lease, tokens .. ' ' .. spent)
end
if free then
  redis.call('HDEL', KEYS[1], lease)
  for s = 1, nscopes do redis.call('ZREM', KEYS[NKEYS * (s - 1) + 3], lease) end
end
if charged then return 1 end
return 0
"""

# KEYS: open, then per scope ls.  ARGV: lease id, ttl ms.  Reply: the new expiry, or 0 if expired.
RENEW = _PRELUDE + """
local lease, ttl = ARGV[1], tonumber(ARGV[2])
local expiry = redis.call('ZSCORE', KEYS[2], lease)
if not expiry or tonumber(expiry) <= now then return 0 end
local expires = now + ttl
for s = 2, #KEYS do
  redis.call('ZADD', KEYS[s], 'XX', expires, lease)
  extend(KEYS[s], ttl)
end
extend(KEYS[1], ttl)
return expires
"""

# What an outage looks like from redis-py: we answer StoreUnavailable (503 or local fallback).
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ClusterDownError,
    redis_errors.TryAgainError, ConnectionError, TimeoutError,
)


class RedisStore:
    """The shared quota store: every admission, reconciliation and release is one EVALSHA.

    The scripts travel over one pipelined connection (``extproc.quota.resp``): the calls of one
    event-loop turn leave in one write. Settlements that free no concurrency slot may wait up to
    ``settle_batch_s`` to share a write with others. Each script stays atomic on its own.
    """

    name = "redis"

    def __init__(self, connection: PipelinedConnection | ClusterConnection, *, lease_ttl_s: float = 60.0,
                 prefix: str = "llmgw:quota") -> None:
        self.connection = connection
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.prefix = prefix
        self._sha = {script: hashlib.sha1(script.encode()).hexdigest() for script in (ADMIT, SETTLE, RENEW)}
        self._key_cache: dict[tuple[str, str, tuple[str, ...]], tuple[str, ...]] = {}

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 0.5, lease_ttl_s: float = 60.0,
                 settle_batch_s: float = SETTLE_BATCH_S) -> RedisStore:
        """A store on ``redis://[user:password@]host:port/db`` (or ``rediss://``, ``unix://``), or
        on a Redis Cluster (``redis+cluster://host:port,...``: ``extproc.quota.cluster``); a call
        without a reply within ``timeout_s`` is an outage."""
        connection = pipelined(url, timeout_s=timeout_s, connect_timeout_s=timeout_s, batch_s=settle_batch_s)
        return cls(connection, lease_ttl_s=lease_ttl_s)

    def domain(self, tenant: str) -> str:
        """Where ``tenant``'s keys live, as a failure domain (``FallbackStore``): on a Redis Cluster
        the primary serving their slot, else the one server ("")."""
        connection = self.connection
        if isinstance(connection, ClusterConnection):
            return connection.owner(f"{self.prefix}:{{{tag(tenant)}}}")
        return ""

    def _keys(self, tenant: str, qos: str, suffixes: tuple[str, ...]) -> tuple[str, ...]:
        found = self._key_cache.get((tenant, qos, suffixes))
        if found is None:
            base = f"{self.prefix}:{{{tag(tenant)}}}"
            keys = [f"{base}:open"]
            for scope in ("t", f"q:{tag(qos)}") if qos else ("t",):
                keys += [f"{base}:{scope}:{suffix}" for suffix in suffixes]
            if len(self._key_cache) >= 10_000:  # bounded: tenants x classes x scripts
                self._key_cache.clear()
            found = self._key_cache[(tenant, qos, suffixes)] = tuple(keys)
        return found

    async def _run(self, script: str, keys: Sequence[str], args: list[str | int], *, later: bool = False) -> object:
        sha = self._sha[script]
        try:
            try:
                return await self.connection.call("EVALSHA", sha, len(keys), *keys, *args, later=later)
            except RedisReplyError as error:
                if not str(error).startswith("NOSCRIPT"):
                    raise
                # After a restart, failover or SCRIPT FLUSH the server has forgotten the script.
                await self.connection.call("SCRIPT", "LOAD", script, key=keys[0])  # a cluster: that node
                return await self.connection.call("EVALSHA", sha, len(keys), *keys, *args)
        except OUTAGE_ERRORS as error:
            raise StoreUnavailable(f"redis: {type(error).__name__}: {error}") from error

    async def admit(self, admission: Admission, quota: Quota) -> Verdict:
        """See ``QuotaStore.admit``."""
        scopes = scopes_of(quota, admission.qos)
        args: list[str | int] = [admission.lease_id, admission.reserve_tokens, self.lease_ttl_ms,
                                 admission.reserve_cost]
        for _, limits in scopes:
            args += [-1 if limit is None else limit for limit in limits.as_tuple()]
        reply = await self._run(ADMIT, self._keys(admission.tenant, admission.qos, _ADMIT_KEYS), args)
        assert isinstance(reply, list)
        admitted, kind, scope, retry, now, *raw = reply  # Lua numbers arrive as Redis integers
        figures = []
        for index, (scope_name, _) in enumerate(scopes):
            base = 3 * len(_KINDS) * index
            for limit_kind in _KINDS:
                at = base + 3 * limit_kind
                if raw[at] >= 0:
                    figures.append(Figure(scope_name, limit_kind, raw[at], raw[at + 1], raw[at + 2]))
        if not admitted:
            return Verdict(False, tuple(figures), LimitKind(kind), scopes[scope - 1][0],
                            None if retry < 0 else retry)
        lease = Lease(admission.tenant, admission.qos, admission.lease_id, admission.reserve_tokens,
                      now, now + self.lease_ttl_ms, self.name, admission.reserve_cost, _holds_slot(scopes))
        return Verdict(True, tuple(figures), lease=lease)

    async def _settle(self, lease: Lease, actual_tokens: int | None, actual_cost: int | None, free: bool) -> None:
        args: list[str | int] = [lease.lease_id, -1 if actual_tokens is None else actual_tokens,
                                 lease.admitted_ms, int(free), -1 if actual_cost is None else actual_cost]
        await self._run(SETTLE, self._keys(lease.tenant, lease.qos, _SETTLE_KEYS), args, later=not lease.holds_slot)

    async def reconcile(self, lease: Lease, actual_tokens: int, actual_cost: int | None = None) -> None:
        """See ``QuotaStore.reconcile``."""
        await self._settle(lease, actual_tokens, actual_cost, free=False)

    async def release(self, lease: Lease, actual_tokens: int | None = None, actual_cost: int | None = None) -> None:
        """See ``QuotaStore.release``."""
        await self._settle(lease, actual_tokens, actual_cost, free=True)

    async def renew(self, lease: Lease) -> Lease | None:
        """See ``QuotaStore.renew``."""
        expires = await self._run(RENEW, self._keys(lease.tenant, lease.qos, ("ls",)),
                                  [lease.lease_id, self.lease_ttl_ms])
        assert isinstance(expires, int)
        return replace(lease, expires_ms=expires) if expires else None

    async def close(self) -> None:
        """See ``QuotaStore.close``: send what is queued, then close the connection."""
        await self.connection.close()


def _holds_slot(scopes: Sequence[tuple[str, Limits]]) -> bool:
    return any(limits.concurrency is not None for _, limits in scopes)
