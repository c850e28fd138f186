-- Raise a generation's newest event time (never lower it). Used by commit.lua.
local function raise_generation(key, generation, ts)
  if tonumber(ts) > tonumber(redis.call('HGET', key, generation) or '-1') then
    redis.call('HSET', key, generation, ts)
  end
end
