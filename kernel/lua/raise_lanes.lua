-- The at-least-once baseline raises source lanes' event-time marks (what the watermark is
-- computed from) without anything else. KEYS: 1 lanes, 2 lane activity.
-- ARGV: l x (lane, newest event time, batch time)
for i = 1, #ARGV, 3 do
  local newest = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '-1')
  if tonumber(ARGV[i + 1]) > newest then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 2])
end
return 1
