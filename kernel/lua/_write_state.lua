-- Keyed state and timers: m, m x (state key index, field, value: '' deletes the field), then
-- t, t x (timer sorted-set key index, member, score: '' removes the member). Returns the
-- index of the next argument. Used by commit.lua and finish.lua.
local function write_state(i)
  local m = tonumber(ARGV[i])
  i = i + 1
  for j = 1, m do
    if ARGV[i + 2] == '' then
      redis.call('HDEL', KEYS[tonumber(ARGV[i])], ARGV[i + 1])
    else
      redis.call('HSET', KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2])
    end
    i = i + 3
  end
  local t = tonumber(ARGV[i])
  i = i + 1
  for j = 1, t do
    if ARGV[i + 2] == '' then
      redis.call('ZREM', KEYS[tonumber(ARGV[i])], ARGV[i + 1])
    else
      redis.call('ZADD', KEYS[tonumber(ARGV[i])], ARGV[i + 2], ARGV[i + 1])
    end
    i = i + 3
  end
  return i
end
