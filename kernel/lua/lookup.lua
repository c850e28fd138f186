-- The seen value of each ID, in any live generation (newest first,
-- stopping at the first hit). KEYS: seen shards. ARGV: 1 n, 2 g (generations per ID), 3 seen
-- fields blob, 4 index blob of n x g little-endian uint16 KEYS indices (0: no such shard).
-- Returns one value (or false) per ID.
local n, g = tonumber(ARGV[1]), tonumber(ARGV[2])
local ids, index = ARGV[3], ARGV[4]
local w = width_of(ids, n)
local out = {}
for j = 1, n do
  local id = field_at(ids, w, j)
  local value = false
  for k = 1, g do
    local at = struct.unpack('<H', index, 2 * ((j - 1) * g + k) - 1)
    if at > 0 then
      value = redis.call('HGET', KEYS[at], id)
      if value then break end
    end
  end
  out[j] = value or false
end
return out
