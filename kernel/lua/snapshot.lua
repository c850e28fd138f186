-- Filters covering commits 1..seq (a prefix: partitions commit concurrently, so a task's
-- filters rarely cover every commit) replace the snapshot's generations they changed. The
-- journal keeps the commits after the previous snapshot (its seq becomes 'from'): the other
-- workers' filters are usually past it and catch up from the journal instead of reloading
-- the snapshot. Refused ('stale') if it would move the snapshot back (another worker's covers
-- more) or past the commits Redis holds.
-- KEYS: 1 epoch, 2 task token, 3 filter seq, 4 filter journal, 5 snapshot hash
-- ARGV: 1 epoch, 2 token, 3 server (see _fence.lua), 4 seq covered, 5 n, n x (field, blob), then
--       d, d x field
local old = tonumber(redis.call('HGET', KEYS[5], 'seq') or '0')
local from = tonumber(redis.call('HGET', KEYS[5], 'from') or old)
local seq = tonumber(ARGV[4])
if seq <= old or seq > tonumber(redis.call('GET', KEYS[3]) or '0') then return {'stale'} end
local n = tonumber(ARGV[5])
local i = 6
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
redis.call('HSET', KEYS[5], 'seq', ARGV[4], 'from', old)
redis.call('LTRIM', KEYS[4], old - from, -1)
return {'ok'}
