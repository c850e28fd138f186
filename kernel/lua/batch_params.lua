-- A micro-batch's parameters: the first attempt's stand; later attempts get them back. The
-- clock hash follows the newest batch (its watermark, dedup time and time).
-- KEYS: 1 epoch, 2 batch hash, 3 clock. ARGV: 1 epoch, 2 server (see _fence.lua: the one whose
-- run id the batch's tasks check), 3 watermark, 4 dedup time, 5 time, then field, value ...
if server_changed(ARGV[2]) then return {'fenced', 'redis'} end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'fenced', 'driver'} end
if redis.call('EXISTS', KEYS[2]) == 0 then
  for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
  redis.call('HSET', KEYS[3], 'watermark', ARGV[3], 'dedup_time', ARGV[4], 'time', ARGV[5])
end
return redis.call('HGETALL', KEYS[2])
