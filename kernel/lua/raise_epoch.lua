-- A starting driver copies its epoch into each partition scope (never lowering it), before
-- any of its tasks runs: from then on the scope fences every older driver's tasks, and a
-- task of a driver that never did (a leftover of an earlier run) finds no copy and is fenced.
-- KEYS: 1 the scope's epoch copy. ARGV: 1 epoch. Returns the copy now.
local cur = redis.call('GET', KEYS[1])
if cur and tonumber(cur) > tonumber(ARGV[1]) then return cur end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
