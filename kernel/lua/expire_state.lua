-- GC deletes keyed state whose time-to-live ran out before ARGV[1] (re-checked here: a commit
-- that updated the key meanwhile moved its expiry on, and keeps it).
-- KEYS: 1 state hash, 2 expiry sorted set. ARGV: 1 threshold, 2.. keys. Returns how many went.
local n = 0
for i = 2, #ARGV do
  local at = redis.call('ZSCORE', KEYS[2], ARGV[i])
  if at and tonumber(at) <= tonumber(ARGV[1]) then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
    n = n + 1
  end
end
return n
