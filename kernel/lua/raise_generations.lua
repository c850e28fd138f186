-- The driver folds partition scopes' generations into the namespace's (see kernel.scopes);
-- GC raises its floor field with it too (any hash whose fields only rise).
-- KEYS: 1 generations. ARGV: 1 server (see _server.lua; '' checks nothing), then g x
-- (generation, newest event time). Returns how many rose, or -1 if the server changed.
if server_changed(ARGV[1]) then return -1 end
local n = 0
for i = 2, #ARGV, 2 do
  if tonumber(ARGV[i + 1]) > tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '-1') then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    n = n + 1
  end
end
return n
