-- The end of a task: its end-of-task outputs (combine results, window panes) and the state
-- changes that go with them (panes fired, closed windows deleted), and the done marker.
-- KEYS: 1 epoch, 2 task token, 3 backup hash, 4 stats, 5.. state hashes and timer sets
-- ARGV: 1 epoch, 2 token, 3 server (see _fence.lua), 4 final outputs blob (may be empty), then the
--       state and timers (see _write_state.lua), then s, s x (field, increment)
if redis.call('HEXISTS', KEYS[3], 'done') == 1 then return {'ok', 'again'} end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[3], 'final', ARGV[4]) end
redis.call('HSET', KEYS[3], 'done', '1')
local i = write_state(5)
local s = tonumber(ARGV[i])
i = i + 1
for j = 1, s do
  redis.call('HINCRBY', KEYS[4], ARGV[i], ARGV[i + 1])
  i = i + 2
end
return {'ok', 'done'}
