-- A task attempt claims its stage partition, unless a newer attempt already has. (In a
-- partition scope the epoch key is the scope's copy of the driver epoch, see raise_epoch.lua.)
-- KEYS: 1 epoch, 2 task token. ARGV: 1 epoch, 2 this attempt's token, 3 server (see _fence.lua)
if server_changed(ARGV[3]) then return {'fenced', 'redis'} end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'fenced', 'driver'} end
local cur = redis.call('GET', KEYS[2])
if cur then
  local ce, ca = token_pair(cur)
  local me, ma = token_pair(ARGV[2])
  if ce and (ce > me or (ce == me and ca > ma)) then return {'fenced', 'task'} end
end
redis.call('SET', KEYS[2], ARGV[2])
return {'ok'}
