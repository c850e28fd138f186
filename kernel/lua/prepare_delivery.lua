-- A sink partition is about to make a delivery visible: remember it (the marker that will
-- tell whether it happened, the IDs, and the micro-batch making it) until it is marked.
-- KEYS: 1 epoch, 2 task token, 3 pending.
-- ARGV: 1 epoch, 2 token, 3 server (see _fence.lua), 4 marker, 5 ids blob, 6 batch
redis.call('HSET', KEYS[3], 'marker', ARGV[4], 'ids', ARGV[5], 'batch', ARGV[6])
return {'ok'}
