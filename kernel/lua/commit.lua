-- KEYS: 1 epoch, 2 task token, 3 backup hash, 4 filter seq, 5 filter journal, 6 stats,
--       7 generations, 8 lanes, 9 lane activity, 10 GC hash, 11.. seen shards, state hashes
--       and timer sorted sets (by index)
-- ARGV: 1 epoch, 2 token, 3 server (see _fence.lua), 4 seen value (SEEN_MARK), 5 chunk
--       field, 6 outputs blob, 7 journal blob, 8 n ids, 9 seen fields blob (grouped by shard),
--       10 shard runs blob (see _seen_fields.lua), 11 generation, 12 newest event time of the
--       IDs, 13 oldest event time of the IDs, 14 inputs field, 15 input IDs blob ('': not
--       kept), 16 the seen-marks' values, 4 bytes per field in the fields' order (source
--       records' content fingerprints; '': every mark is ARGV[4]), then l, l x (lane, newest
--       event time, batch time), then the state and timers (see _write_state.lua), then s, s x
--       (stat field, increment)
-- Returns {'ok', seq}, {'conflict', positions (1-based, in the fields blob) of the IDs
-- already seen, their marks' values} (a conflict undoes the call's own writes: the values
-- tell a copy from another record under the same ID), or {'floor', GC floor} when an ID
-- is older than what GC already deleted (its copies' seen-marks may be gone: the task takes
-- the floor and redoes the chunk, where such records are late; nothing was written).
-- The generation's newest event time is what GC keeps it by (see keyspace.generations).
if redis.call('HEXISTS', KEYS[3], ARGV[5]) == 1 then return {'ok', '-1'} end
local n = tonumber(ARGV[8])
if n > 0 then
  local gc_floor = tonumber(redis.call('HGET', KEYS[10], '@GC_FLOOR@') or '-1')
  if tonumber(ARGV[13]) < gc_floor then return {'floor', tostring(gc_floor)} end
end
local conflicts, held = {}, {}
local values = ARGV[16]
each_field(ARGV[9], n, ARGV[10], function(own, j, id)
  local value = ARGV[4]
  if values ~= '' then value = string.sub(values, 4 * j - 3, 4 * j) end
  if redis.call('HSETNX', own, id, value) == 0 then
    conflicts[#conflicts + 1] = j
    held[#held + 1] = redis.call('HGET', own, id)
  end
end)
if #conflicts > 0 then
  local seen = {}
  for _, p in ipairs(conflicts) do seen[p] = true end
  each_field(ARGV[9], n, ARGV[10], function(own, j, id)
    if not seen[j] then redis.call('HDEL', own, id) end
  end)
  return {'conflict', conflicts, held}
end
if n > 0 then raise_generation(KEYS[7], ARGV[11], ARGV[12]) end
local i = 17
local l = tonumber(ARGV[i])
i = i + 1
for j = 1, l do
  local newest = tonumber(redis.call('HGET', KEYS[8], ARGV[i]) or '-1')
  if tonumber(ARGV[i + 1]) > newest then redis.call('HSET', KEYS[8], ARGV[i], ARGV[i + 1]) end
  redis.call('HSET', KEYS[9], ARGV[i], ARGV[i + 2])
  i = i + 3
end
i = write_state(i)
local s = tonumber(ARGV[i])
i = i + 1
for j = 1, s do
  redis.call('HINCRBY', KEYS[6], ARGV[i], ARGV[i + 1])
  i = i + 2
end
redis.call('HSET', KEYS[3], ARGV[5], ARGV[6])
if ARGV[15] ~= '' then redis.call('HSET', KEYS[3], ARGV[14], ARGV[15]) end
local seq = 0
if n > 0 then
  redis.call('RPUSH', KEYS[5], ARGV[7])
  seq = redis.call('INCR', KEYS[4])
end
return {'ok', tostring(seq)}
