-- A delivery became visible (or, with no IDs, a pending one is dropped): its IDs go
-- to the backup of the task that made it, as field <prefix><k><suffix> (k counted in the
-- counter field), and the pending delivery ends (when asked). A transactional delivery's
-- marker stays in the pending hash as field 'last' (the partition's last delivery Redis
-- knows: where a read of the sink's own markers starts, see onceflow.dedup.delivery).
-- KEYS: 1 epoch, 2 task token, 3 backup hash, 4 stats, 5 pending
-- ARGV: 1 epoch, 2 token, 3 server (see _fence.lua), 4 counter field, 5 field prefix, 6 field
--       suffix, 7 ids blob, 8 n, 9 '1' to delete the pending delivery, 10 possible copies,
--       11 the delivery's marker ('' for none)
local n = tonumber(ARGV[8])
if n > 0 then
  local k = redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
  redis.call('HSET', KEYS[3], ARGV[5] .. k .. ARGV[6], ARGV[7])
  redis.call('HINCRBY', KEYS[4], 'delivered', n)
end
if ARGV[9] == '1' then redis.call('DEL', KEYS[5]) end
if ARGV[11] ~= '' then redis.call('HSET', KEYS[5], 'last', ARGV[11]) end
if tonumber(ARGV[10]) > 0 then redis.call('HINCRBY', KEYS[4], 'possible_copies', ARGV[10]) end
return {'ok'}
