-- Layout 4's claim (docs/concepts/dedup.md; not used by the runtime yet): a source stage's
-- IDs in one ID tag (onceflow.kernel.id_tags) claimed before the chunk's commit. Each ID not
-- held in any live generation of the tag is claimed, HSETNX in the batch's generation with
-- its record's origin and fingerprint; an ID held already comes back with what holds it.
-- KEYS: 1 the tag's generations (gens), 2.. seen shards of the tag: for each shard the call
--       touches, its key in each of the g live generations, the batch's first, then older
-- ARGV: 1 server (the tag's master's run id noted when the batch started, see _server.lua),
--       2 generation (the batch's), 3 newest event time of the IDs, 4 g, 5 n ids, 6 seen
--       fields blob (grouped by shard), 7 shard runs blob (per shard: KEYS index of its key in
--       the batch's generation, uint16, its older generations' keys following it; count of
--       its fields, uint32), 8 claim values (origin and fingerprint, one width, fields' order)
-- Returns {'fenced', 'redis'} (nothing written), or {'ok', positions (1-based, in the fields
-- blob) of the IDs held already, the values that hold them}: every other ID is claimed now.
-- Fenced by the server only: a claim holds no effect, and a zombie attempt claims only
-- records of its own batch, with their own origins, which the live attempt takes back.
if server_changed(ARGV[1]) then return {'fenced', 'redis'} end
local g, n = tonumber(ARGV[4]), tonumber(ARGV[5])
if n == 0 then return {'ok', {}, {}} end
local ids, runs, values = ARGV[6], ARGV[7], ARGV[8]
local w, v = #ids / n, #values / n
local positions, held = {}, {}
local j = 0
for q = 1, #runs / 6 do
  local k, c = struct.unpack('<HI4', runs, 6 * q - 5)
  for _ = 1, c do
    j = j + 1
    local id = string.sub(ids, w * j - w + 1, w * j)
    local found = false
    for older = 1, g - 1 do
      found = redis.call('HGET', KEYS[k + older], id)
      if found then break end
    end
    if not found and redis.call('HSETNX', KEYS[k], id, string.sub(values, v * j - v + 1, v * j)) == 0 then
      found = redis.call('HGET', KEYS[k], id)
    end
    if found then
      positions[#positions + 1] = j
      held[#held + 1] = found
    end
  end
end
raise_generation(KEYS[1], ARGV[2], ARGV[3])
return {'ok', positions, held}
