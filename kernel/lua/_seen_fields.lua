-- Seen fields travel as one blob of n fields of one width (the blob's length over n: it
-- depends on the shard count), with their seen-ID shards' KEYS indices as a blob: a
-- little-endian uint16 per field (LOOKUP, per generation), or, where fields come grouped by
-- shard (COMMIT), one run per shard (see onceflow.dedup.addressing.RUN). A
-- chunk is then a handful of arguments instead of thousands.
local function width_of(blob, n)
  if n > 0 then return #blob / n end
  return 0
end
local function field_at(blob, w, j) return string.sub(blob, w * j - w + 1, w * j) end
-- Fields grouped by shard: runs of (KEYS index uint16, count uint32), 6 bytes each; calls
-- visit(key, position, field) for each of the n fields, in order.
local function each_field(ids, n, runs, visit)
  local w = width_of(ids, n)
  local j = 0
  for q = 1, #runs / 6 do
    local k, c = struct.unpack('<HI4', runs, 6 * q - 5)
    local key = KEYS[k]
    for _ = 1, c do
      j = j + 1
      visit(key, j, field_at(ids, w, j))
    end
  end
end
