-- The first checks of every script that writes a task's work. KEYS: 1 epoch, 2 task token.
-- ARGV: 1 epoch, 2 token, 3 the server's run id when the batch started (see _server.lua).
if server_changed(ARGV[3]) then return {'fenced', 'redis'} end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'fenced', 'driver'} end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return {'fenced', 'task'} end
