-- Spark committed every micro-batch up to ARGV[1] (never moves back).
-- KEYS: 1 acked. ARGV: 1 batch
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
if tonumber(ARGV[1]) > cur then redis.call('SET', KEYS[1], ARGV[1]) return 1 end
return 0
