-- A transactional sink writer is about to begin a transaction for a sink partition: record
-- its identity (a field of the partition's pending hash, deleted with it by log_delivery.lua)
-- so that a later attempt settles it if this one never finishes. ARGV[4] '0' forgets it
-- instead (its transaction was aborted before anything of it could become visible).
-- KEYS: 1 epoch, 2 task token, 3 pending.
-- ARGV: 1 epoch, 2 token, 3 server (see _fence.lua), 4 field, 5 '1' or '0'
if ARGV[5] == '1' then
  redis.call('HSET', KEYS[3], ARGV[4], '1')
else
  redis.call('HDEL', KEYS[3], ARGV[4])
end
return {'ok'}
