"""Every Lua script Onceflow runs in Redis: the registry of the commit protocol.

Nothing else in Onceflow holds Lua. Key names come from :mod:`onceflow.kernel.keyspace`.

Every script that writes first checks two fencing tokens: the driver epoch (bumped when a
driver starts) and the task token (bumped when a task attempt starts). A zombie driver or
task attempt therefore cannot commit after its successor has started.

``COMMIT`` is the heart of exactly-once: in one atomic step it checks that none of the chunk's
IDs was seen before, marks them seen, stores the chunk's outputs (the upstream backup for the
next boundary), writes keyed state, appends the IDs to the Bloom journal and bumps counters.
If any ID was already seen it undoes its marks before returning (the script is atomic, so
nobody sees them), returns those IDs with their owners, and the task redoes the chunk without
them. One ``HSETNX`` per ID does the check and the mark together. It is idempotent: run
twice (a retried call after a lost reply), the second run sees its chunk already stored and
changes nothing.
"""

from __future__ import annotations

FENCE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'fenced', 'driver'} end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return {'fenced', 'task'} end
"""

# IDs travel as one blob of 16-byte IDs, with the KEYS index of each ID's shard (and of its
# neighbour-bucket shard, or 0) as blobs of little-endian uint16: a chunk is then a handful of
# arguments instead of thousands.
# KEYS: 1 epoch, 2 task token, 3 backup hash, 4 filter seq, 5 filter journal, 6 stats,
#       7 watermark, 8 GC floor, 9.. seen shards and state hashes (referenced by index)
# ARGV: 1 epoch, 2 token, 3 owner, 4 chunk field, 5 outputs blob, 6 journal blob,
#       7 max event time, 8 n ids, 9 ids blob, 10 shard index blob, 11 neighbour index blob
#       (or ''), 12 the task's dedup floor (oldest bucket it treats as deduplicated),
#       then m, m x (state key, field, value), then s, s x (stat field, increment)
# The GC floor check makes GC safe against a concurrent commit: GC raises the floor before it
# deletes seen-ID buckets below it, so a task that still counts such a bucket as inside the
# horizon (its floor is older) is refused and redoes the chunk with the new floor.
COMMIT = (
    FENCE
    + """
if redis.call('HEXISTS', KEYS[3], ARGV[4]) == 1 then return {'ok', '-1'} end
local gc_floor = tonumber(redis.call('GET', KEYS[8]) or '-1')
if gc_floor > tonumber(ARGV[12]) then return {'floor', tostring(gc_floor)} end
local n = tonumber(ARGV[8])
local ids, owns, alts = ARGV[9], ARGV[10], ARGV[11]
local conflicts = {}
local written = {}
for j = 1, n do
  local id = string.sub(ids, 16 * j - 15, 16 * j)
  local own = KEYS[struct.unpack('<H', owns, 2 * j - 1)]
  local alt = 0
  if alts ~= '' then alt = struct.unpack('<H', alts, 2 * j - 1) end
  local owner = false
  if alt > 0 then owner = redis.call('HGET', KEYS[alt], id) end
  if not owner then
    if redis.call('HSETNX', own, id, ARGV[3]) == 1 then
      written[#written + 1] = own
      written[#written + 1] = id
    else
      owner = redis.call('HGET', own, id)
    end
  end
  if owner then
    conflicts[#conflicts + 1] = id
    conflicts[#conflicts + 1] = owner
  end
end
if #conflicts > 0 then
  for k = 1, #written, 2 do redis.call('HDEL', written[k], written[k + 1]) end
  return {'conflict', conflicts}
end
local i = 13
local m = tonumber(ARGV[i])
i = i + 1
for j = 1, m do
  redis.call('HSET', KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2])
  i = i + 3
end
local s = tonumber(ARGV[i])
i = i + 1
for j = 1, s do
  redis.call('HINCRBY', KEYS[6], ARGV[i], ARGV[i + 1])
  i = i + 2
end
redis.call('HSET', KEYS[3], ARGV[4], ARGV[5])
local seq = 0
if n > 0 then
  redis.call('RPUSH', KEYS[5], ARGV[6])
  seq = redis.call('INCR', KEYS[4])
end
local ts = tonumber(ARGV[7])
if ts > tonumber(redis.call('GET', KEYS[7]) or '0') then redis.call('SET', KEYS[7], ARGV[7]) end
return {'ok', tostring(seq)}
"""
)

# KEYS: 1 epoch, 2 task token, 3 backup hash, 4 stats
# ARGV: 1 epoch, 2 token, 3 final outputs blob (may be empty), then s, s x (field, increment)
FINISH = (
    FENCE
    + """
if redis.call('HEXISTS', KEYS[3], 'done') == 1 then return {'ok', 'again'} end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[3], 'final', ARGV[3]) end
redis.call('HSET', KEYS[3], 'done', '1')
local s = tonumber(ARGV[4])
local i = 5
for j = 1, s do
  redis.call('HINCRBY', KEYS[4], ARGV[i], ARGV[i + 1])
  i = i + 2
end
return {'ok', 'done'}
"""
)

# KEYS: 1 epoch, 2 task token, 3 filter seq, 4 filter journal, 5 stats, 6.. seen shards
# ARGV: 1 epoch, 2 token, 3 owner, 4 journal blob, 5 n, 6 ids blob, 7 shard index blob
# Returns {'ok', seq, how many were already marked (delivered twice)}.
MARK_DELIVERED = (
    FENCE
    + """
local n = tonumber(ARGV[5])
local ids, owns = ARGV[6], ARGV[7]
local again = 0
for j = 1, n do
  local key = KEYS[struct.unpack('<H', owns, 2 * j - 1)]
  if redis.call('HSET', key, string.sub(ids, 16 * j - 15, 16 * j), ARGV[3]) == 0 then
    again = again + 1
  end
end
local seq = 0
if n > 0 then
  redis.call('RPUSH', KEYS[4], ARGV[4])
  seq = redis.call('INCR', KEYS[3])
end
redis.call('HINCRBY', KEYS[5], 'delivered', n - again)
if again > 0 then redis.call('HINCRBY', KEYS[5], 'delivered_again', again) end
return {'ok', tostring(seq), tostring(again)}
"""
)

# KEYS: seen shards. ARGV: n, then n x (id, own key index, neighbour key index or 0)
# Returns one owner (or false) per ID.
LOOKUP = """
local n = tonumber(ARGV[1])
local out = {}
local i = 2
for j = 1, n do
  local owner = redis.call('HGET', KEYS[tonumber(ARGV[i + 1])], ARGV[i])
  local alt = tonumber(ARGV[i + 2])
  if (not owner) and alt > 0 then owner = redis.call('HGET', KEYS[alt], ARGV[i]) end
  out[j] = owner or false
  i = i + 3
end
return out
"""

# KEYS: 1 epoch, 2 task token, 3 filter seq, 4 filter journal, 5 snapshot hash
# ARGV: 1 epoch, 2 token, 3 seq covered, 4 n, n x (bucket field, blob), then d, d x field
SNAPSHOT = (
    FENCE
    + """
if tonumber(redis.call('GET', KEYS[3]) or '0') ~= tonumber(ARGV[3]) then return {'stale'} end
local old = tonumber(redis.call('HGET', KEYS[5], 'seq') or '0')
local n = tonumber(ARGV[4])
local i = 5
for j = 1, n do
  redis.call('HSET', KEYS[5], ARGV[i], ARGV[i + 1])
  i = i + 2
end
local d = tonumber(ARGV[i])
i = i + 1
for j = 1, d do
  redis.call('HDEL', KEYS[5], ARGV[i])
  i = i + 1
end
redis.call('HSET', KEYS[5], 'seq', ARGV[3])
redis.call('LTRIM', KEYS[4], tonumber(ARGV[3]) - old, -1)
return {'ok'}
"""
)


# Spark committed every micro-batch up to ARGV[1] (never moves back); the watermark then is
# the one the dedup floor and GC are measured from.
# KEYS: 1 acked, 2 watermark, 3 acked watermark. ARGV: 1 batch
ACK = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
if tonumber(ARGV[1]) > cur then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('SET', KEYS[3], redis.call('GET', KEYS[2]) or '0')
  return 1
end
return 0
"""

# GC raises the floor, never lowers it; returns the floor in force.
# KEYS: 1 GC floor. ARGV: 1 wanted floor
RAISE_FLOOR = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
local want = tonumber(ARGV[1])
if want > cur then redis.call('SET', KEYS[1], ARGV[1]) return want end
return cur
"""


class Scripts:
    """The scripts registered on one client (EVALSHA, reloaded after a Redis restart)."""

    def __init__(self, client: object) -> None:
        register = client.register_script  # type: ignore[attr-defined]
        self.commit = register(COMMIT)
        self.finish = register(FINISH)
        self.mark_delivered = register(MARK_DELIVERED)
        self.lookup = register(LOOKUP)
        self.snapshot = register(SNAPSHOT)
        self.ack = register(ACK)
        self.raise_floor = register(RAISE_FLOOR)


_REGISTERED: dict[int, Scripts] = {}


def scripts_for(client: object) -> Scripts:
    """The registry bound to ``client`` (one per client and process)."""
    found = _REGISTERED.get(id(client))
    if found is None:
        found = Scripts(client)
        _REGISTERED[id(client)] = found
    return found
