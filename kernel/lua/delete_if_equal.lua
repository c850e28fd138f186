-- Delete a key only if it still holds ARGV[1] (a driver's heartbeat: a newer driver may have
-- taken it over). KEYS: 1 the key. Returns 1 if deleted.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
