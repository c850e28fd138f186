-- GC forgets a generation whose newest event time is older than ARGV[2] (re-checked here,
-- atomically: a commit raising it meanwhile keeps it); its seen-ID keys are deleted after.
-- KEYS: 1 generations. ARGV: 1 generation, 2 threshold. Returns 1 if forgotten.
local newest = redis.call('HGET', KEYS[1], ARGV[1])
if newest and tonumber(newest) < tonumber(ARGV[2]) then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 1
end
return 0
