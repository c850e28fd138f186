-- What a receiver's Bloom filters need to catch up, read in one atomic step: read apart, a
-- snapshot another worker takes in between trims the journal under the offset. The journal
-- holds the commits after the snapshot hash's 'from' (the snapshot before it; absent: its
-- 'seq'), so filters a snapshot overtook catch up from it too.
-- KEYS: 1 filter seq, 2 filter journal, 3 snapshot hash
-- ARGV: 1 the commit sequence the filters cover
-- Returns {commits, snapshot seq, journal entries after the covered commit} when the journal
-- reaches back that far, else {commits, snapshot seq, the journal after the snapshot, the
-- snapshot hash as field, value, ...} (filters behind the journal, or ahead of Redis: start
-- from the snapshot; a covered of -1 asks for that, see onceflow.dedup.trust.RELOAD).
local commits = tonumber(redis.call('GET', KEYS[1]) or '0')
local base = tonumber(redis.call('HGET', KEYS[3], 'seq') or '0')
local from = tonumber(redis.call('HGET', KEYS[3], 'from') or base)
local covered = tonumber(ARGV[1])
if from <= covered and covered <= commits then
  return {commits, base, redis.call('LRANGE', KEYS[2], covered - from, -1)}
end
local after = redis.call('LRANGE', KEYS[2], base - from, -1)
return {commits, base, after, redis.call('HGETALL', KEYS[3])}
