"""Every Lua script Onceflow runs in Redis: the registry of the commit protocol.

Nothing else in Onceflow holds Lua. Key names come from :mod:`onceflow.kernel.keyspace`.

Every script that writes first checks three fences: the Redis server the batch started on
(its run id: a restarted server, or the replica a failover promoted, may have lost writes, and
nothing may be written on top of what is left, see :mod:`onceflow.dedup.durability`), the
driver epoch (bumped when a driver starts) and the task token (the attempt that claimed the
stage partition, see :data:`CLAIM`). A zombie driver or task attempt therefore cannot commit
after its successor has started, and a zombie that starts late cannot take the partition from
a newer attempt.

:data:`COMMIT` is the heart of exactly-once: in one atomic step it checks that none of the
chunk's IDs was seen before in the batch's generation, marks them seen, stores the chunk's
outputs (the upstream backup for the next boundary) and its input IDs (how a later attempt
of the task knows what it committed), writes keyed state, appends the IDs
to the receiver's Bloom journal, raises the source lanes' event-time marks and bumps counters.
If any ID was already seen it undoes its marks before returning (the script is atomic, so
nobody sees them), returns the positions of those IDs in the chunk, and the task redoes the
chunk without them. One ``HSETNX`` per ID does the check and the mark together. It is
idempotent: run twice (a retried call after a lost reply), the second run sees its chunk
already stored and changes nothing.

Seen-IDs are fields of sharded hashes, in the seen-ID layout (see
:mod:`onceflow.kernel.keyspace`): the scripts take them as Python built them, one blob of
``n`` fields of one width (what the shard does not say of each ID), and the value to store.
"""

from __future__ import annotations

from onceflow.kernel.keyspace import GC_FLOOR_FIELD

# Task tokens are "<driver epoch>:<task attempt id>" (Spark's attempt ids only grow within a
# driver; epochs grow across drivers), compared as a pair.
_PARSE_TOKEN = """
local function token_pair(t)
  local e, a = string.match(t, '^(%d+):(%d+)$')
  return tonumber(e), tonumber(a)
end
"""

# The Redis server a writer began on: its run id (INFO server), a new one at every start of
# the server process, on the master a failover promoted too. A server that restarted may have
# lost the writes it had not fsynced (a host crash with ``appendfsync everysec``) or passed on
# to its replica (a failover): whoever wrote there before must not write on top of what is
# left (see onceflow.dedup.durability). '' checks nothing (tools that write no batch work).
_SERVER = """
local function server_changed(expected)
  if expected == '' then return false end
  return string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') ~= expected
end
"""

# The first checks of every script that writes a task's work. KEYS: 1 epoch, 2 task token.
# ARGV: 1 epoch, 2 token, 3 the server's run id when the batch started (see _SERVER).
FENCE = (
    _SERVER
    + """
if server_changed(ARGV[3]) then return {'fenced', 'redis'} end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'fenced', 'driver'} end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return {'fenced', 'task'} end
"""
)

# A task attempt claims its stage partition, unless a newer attempt already has. (In a
# partition scope the epoch key is the scope's copy of the driver epoch, see RAISE_EPOCH.)
# KEYS: 1 epoch, 2 task token. ARGV: 1 epoch, 2 this attempt's token, 3 server (see FENCE)
CLAIM = (
    _PARSE_TOKEN
    + _SERVER
    + """
if server_changed(ARGV[3]) then return {'fenced', 'redis'} end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'fenced', 'driver'} end
local cur = redis.call('GET', KEYS[2])
if cur then
  local ce, ca = token_pair(cur)
  local me, ma = token_pair(ARGV[2])
  if ce and (ce > me or (ce == me and ca > ma)) then return {'fenced', 'task'} end
end
redis.call('SET', KEYS[2], ARGV[2])
return {'ok'}
"""
)

# Seen fields travel as one blob of n fields of one width (the blob's length over n: it
# depends on the shard count), with their seen-ID shards' KEYS indices as a blob: a
# little-endian uint16 per field (LOOKUP, per generation), or, where fields come grouped by
# shard (COMMIT), one run per shard (see onceflow.dedup.addressing.RUN). A
# chunk is then a handful of arguments instead of thousands.
_SEEN_FIELDS = """
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
"""

# Raise a generation's newest event time (never lower it). Used by COMMIT.
_RAISE_GENERATION = """
local function raise_generation(key, generation, ts)
  if tonumber(ts) > tonumber(redis.call('HGET', key, generation) or '-1') then
    redis.call('HSET', key, generation, ts)
  end
end
"""

# Keyed state and timers: m, m x (state key index, field, value: '' deletes the field), then
# t, t x (timer sorted-set key index, member, score: '' removes the member). Returns the
# index of the next argument. Used by COMMIT and FINISH.
_WRITE_STATE = """
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
"""

# KEYS: 1 epoch, 2 task token, 3 backup hash, 4 filter seq, 5 filter journal, 6 stats,
#       7 generations, 8 lanes, 9 lane activity, 10 GC hash, 11.. seen shards, state hashes
#       and timer sorted sets (by index)
# ARGV: 1 epoch, 2 token, 3 server (see FENCE), 4 seen value (SEEN_MARK), 5 chunk
#       field, 6 outputs blob, 7 journal blob, 8 n ids, 9 seen fields blob (grouped by shard),
#       10 shard runs blob (see _SEEN_FIELDS), 11 generation, 12 newest event time of the
#       IDs, 13 oldest event time of the IDs, 14 inputs field, 15 input IDs blob ('': not
#       kept), 16 the seen-marks' values, 4 bytes per field in the fields' order (source
#       records' content fingerprints; '': every mark is ARGV[4]), then l, l x (lane, newest
#       event time, batch time), then the state and timers (see _WRITE_STATE), then s, s x
#       (stat field, increment)
# Returns {'ok', seq}, {'conflict', positions (1-based, in the fields blob) of the IDs
# already seen, their marks' values} (a conflict undoes the call's own writes: the values
# tell a copy from another record under the same ID), or {'floor', GC floor} when an ID
# is older than what GC already deleted (its copies' seen-marks may be gone: the task takes
# the floor and redoes the chunk, where such records are late; nothing was written).
# The generation's newest event time is what GC keeps it by (see keyspace.generations).
COMMIT = (
    FENCE
    + _RAISE_GENERATION
    + _WRITE_STATE
    + _SEEN_FIELDS
    + """
if redis.call('HEXISTS', KEYS[3], ARGV[5]) == 1 then return {'ok', '-1'} end
local n = tonumber(ARGV[8])
if n > 0 then
  local gc_floor = tonumber(redis.call('HGET', KEYS[10], '@GC_FLOOR@') or '-1')
  if tonumber(ARGV[13]) < gc_floor then return {'floor', tostring(gc_floor)} end
end
local conflicts, held = {}, {}
local values = ARGV[16]
each_field(ARGV[9], n, ARGV[10], function(own, j, id)
  local value = ARGV[4]
  if values ~= '' then value = string.sub(values, 4 * j - 3, 4 * j) end
  if redis.call('HSETNX', own, id, value) == 0 then
    conflicts[#conflicts + 1] = j
    held[#held + 1] = redis.call('HGET', own, id)
  end
end)
if #conflicts > 0 then
  local seen = {}
  for _, p in ipairs(conflicts) do seen[p] = true end
  each_field(ARGV[9], n, ARGV[10], function(own, j, id)
    if not seen[j] then redis.call('HDEL', own, id) end
  end)
  return {'conflict', conflicts, held}
end
if n > 0 then raise_generation(KEYS[7], ARGV[11], ARGV[12]) end
local i = 17
local l = tonumber(ARGV[i])
i = i + 1
for j = 1, l do
  local newest = tonumber(redis.call('HGET', KEYS[8], ARGV[i]) or '-1')
  if tonumber(ARGV[i + 1]) > newest then redis.call('HSET', KEYS[8], ARGV[i], ARGV[i + 1]) end
  redis.call('HSET', KEYS[9], ARGV[i], ARGV[i + 2])
  i = i + 3
end
i = write_state(i)
local s = tonumber(ARGV[i])
i = i + 1
for j = 1, s do
  redis.call('HINCRBY', KEYS[6], ARGV[i], ARGV[i + 1])
  i = i + 2
end
redis.call('HSET', KEYS[3], ARGV[5], ARGV[6])
if ARGV[15] ~= '' then redis.call('HSET', KEYS[3], ARGV[14], ARGV[15]) end
local seq = 0
if n > 0 then
  redis.call('RPUSH', KEYS[5], ARGV[7])
  seq = redis.call('INCR', KEYS[4])
end
return {'ok', tostring(seq)}
""".replace("@GC_FLOOR@", GC_FLOOR_FIELD)
)

# The end of a task: its end-of-task outputs (combine results, window panes) and the state
# changes that go with them (panes fired, closed windows deleted), and the done marker.
# KEYS: 1 epoch, 2 task token, 3 backup hash, 4 stats, 5.. state hashes and timer sets
# ARGV: 1 epoch, 2 token, 3 server (see FENCE), 4 final outputs blob (may be empty), then the
#       state and timers (see _WRITE_STATE), then s, s x (field, increment)
FINISH = (
    FENCE
    + _WRITE_STATE
    + """
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
"""
)

# A sink partition is about to make a delivery visible: remember it (the marker that will
# tell whether it happened, the IDs, and the micro-batch making it) until it is marked.
# KEYS: 1 epoch, 2 task token, 3 pending.
# ARGV: 1 epoch, 2 token, 3 server (see FENCE), 4 marker, 5 ids blob, 6 batch
PREPARE_DELIVERY = (
    FENCE
    + """
redis.call('HSET', KEYS[3], 'marker', ARGV[4], 'ids', ARGV[5], 'batch', ARGV[6])
return {'ok'}
"""
)

# A delivery became visible (or, with no IDs, a pending one is dropped): its IDs go
# to the backup of the task that made it, as field <prefix><k><suffix> (k counted in the
# counter field), and the pending delivery ends (when asked).
# KEYS: 1 epoch, 2 task token, 3 backup hash, 4 stats, 5 pending
# ARGV: 1 epoch, 2 token, 3 server (see FENCE), 4 counter field, 5 field prefix, 6 field
#       suffix, 7 ids blob, 8 n, 9 '1' to delete the pending delivery, 10 possible copies
LOG_DELIVERY = (
    FENCE
    + """
local n = tonumber(ARGV[8])
if n > 0 then
  local k = redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
  redis.call('HSET', KEYS[3], ARGV[5] .. k .. ARGV[6], ARGV[7])
  redis.call('HINCRBY', KEYS[4], 'delivered', n)
end
if ARGV[9] == '1' then redis.call('DEL', KEYS[5]) end
if tonumber(ARGV[10]) > 0 then redis.call('HINCRBY', KEYS[4], 'possible_copies', ARGV[10]) end
return {'ok'}
"""
)

# A transactional sink writer is about to begin a transaction for a sink partition: record
# its identity (a field of the partition's pending hash, deleted with it by LOG_DELIVERY)
# so that a later attempt settles it if this one never finishes. ARGV[4] '0' forgets it
# instead (its transaction was aborted before anything of it could become visible).
# KEYS: 1 epoch, 2 task token, 3 pending.
# ARGV: 1 epoch, 2 token, 3 server (see FENCE), 4 field, 5 '1' or '0'
NOTE_WRITER = (
    FENCE
    + """
if ARGV[5] == '1' then
  redis.call('HSET', KEYS[3], ARGV[4], '1')
else
  redis.call('HDEL', KEYS[3], ARGV[4])
end
return {'ok'}
"""
)

# The seen value of each ID, in any live generation (newest first,
# stopping at the first hit). KEYS: seen shards. ARGV: 1 n, 2 g (generations per ID), 3 seen
# fields blob, 4 index blob of n x g little-endian uint16 KEYS indices (0: no such shard).
# Returns one value (or false) per ID.
LOOKUP = (
    _SEEN_FIELDS
    + """
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
"""
)

# What a receiver's Bloom filters need to catch up, read in one atomic step: read apart, a
# snapshot another worker takes in between trims the journal under the offset. The journal
# holds the commits after the snapshot hash's 'from' (the snapshot before it; absent: its
# 'seq'), so filters a snapshot overtook catch up from it too.
# KEYS: 1 filter seq, 2 filter journal, 3 snapshot hash
# ARGV: 1 the commit sequence the filters cover
# Returns {commits, snapshot seq, journal entries after the covered commit} when the journal
# reaches back that far, else {commits, snapshot seq, the journal after the snapshot, the
# snapshot hash as field, value, ...} (filters behind the journal, or ahead of Redis: start
# from the snapshot; a covered of -1 asks for that, see onceflow.dedup.trust.RELOAD).
CATCH_UP = """
local commits = tonumber(redis.call('GET', KEYS[1]) or '0')
local base = tonumber(redis.call('HGET', KEYS[3], 'seq') or '0')
local from = tonumber(redis.call('HGET', KEYS[3], 'from') or base)
local covered = tonumber(ARGV[1])
if from <= covered and covered <= commits then
  return {commits, base, redis.call('LRANGE', KEYS[2], covered - from, -1)}
end
local after = redis.call('LRANGE', KEYS[2], base - from, -1)
return {commits, base, after, redis.call('HGETALL', KEYS[3])}
"""

# Filters covering commits 1..seq (a prefix: partitions commit concurrently, so a task's
# filters rarely cover every commit) replace the snapshot's generations they changed. The
# journal keeps the commits after the previous snapshot (its seq becomes 'from'): the other
# workers' filters are usually past it and catch up from the journal instead of reloading
# the snapshot. Refused ('stale') if it would move the snapshot back (another worker's covers
# more) or past the commits Redis holds.
# KEYS: 1 epoch, 2 task token, 3 filter seq, 4 filter journal, 5 snapshot hash
# ARGV: 1 epoch, 2 token, 3 server (see FENCE), 4 seq covered, 5 n, n x (field, blob), then
#       d, d x field
SNAPSHOT = (
    FENCE
    + """
local old = tonumber(redis.call('HGET', KEYS[5], 'seq') or '0')
local from = tonumber(redis.call('HGET', KEYS[5], 'from') or old)
local seq = tonumber(ARGV[4])
if seq <= old or seq > tonumber(redis.call('GET', KEYS[3]) or '0') then return {'stale'} end
local n = tonumber(ARGV[5])
local i = 6
for j = 1, n do
  redis.call('HSET', KEYS[5], ARGV[i], ARGV[i + 1])
  i = i + 2
end
local d = tonumber(ARGV[i])
i = i + 1
for j = 1, d do
  redis.call('HDEL', KEYS[5], ARGV[i])
  i = i + 1
end
redis.call('HSET', KEYS[5], 'seq', ARGV[4], 'from', old)
redis.call('LTRIM', KEYS[4], old - from, -1)
return {'ok'}
"""
)

# A micro-batch's parameters: the first attempt's stand; later attempts get them back. The
# clock hash follows the newest batch (its watermark, dedup time and time).
# KEYS: 1 epoch, 2 batch hash, 3 clock. ARGV: 1 epoch, 2 server (see FENCE: the one whose
# run id the batch's tasks check), 3 watermark, 4 dedup time, 5 time, then field, value ...
BATCH_PARAMS = (
    _SERVER
    + """
if server_changed(ARGV[2]) then return {'fenced', 'redis'} end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'fenced', 'driver'} end
if redis.call('EXISTS', KEYS[2]) == 0 then
  for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
  redis.call('HSET', KEYS[3], 'watermark', ARGV[3], 'dedup_time', ARGV[4], 'time', ARGV[5])
end
return redis.call('HGETALL', KEYS[2])
"""
)

# Spark committed every micro-batch up to ARGV[1] (never moves back).
# KEYS: 1 acked. ARGV: 1 batch
ACK = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
if tonumber(ARGV[1]) > cur then redis.call('SET', KEYS[1], ARGV[1]) return 1 end
return 0
"""

# GC forgets a generation whose newest event time is older than ARGV[2] (re-checked here,
# atomically: a commit raising it meanwhile keeps it); its seen-ID keys are deleted after.
# KEYS: 1 generations. ARGV: 1 generation, 2 threshold. Returns 1 if forgotten.
FORGET_GENERATION = """
local newest = redis.call('HGET', KEYS[1], ARGV[1])
if newest and tonumber(newest) < tonumber(ARGV[2]) then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


# A starting driver copies its epoch into each partition scope (never lowering it), before
# any of its tasks runs: from then on the scope fences every older driver's tasks, and a
# task of a driver that never did (a leftover of an earlier run) finds no copy and is fenced.
# KEYS: 1 the scope's epoch copy. ARGV: 1 epoch. Returns the copy now.
RAISE_EPOCH = """
local cur = redis.call('GET', KEYS[1])
if cur and tonumber(cur) > tonumber(ARGV[1]) then return cur end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
"""

# The driver folds partition scopes' generations into the namespace's (see kernel.scopes);
# GC raises its floor field with it too (any hash whose fields only rise).
# KEYS: 1 generations. ARGV: 1 server (see _SERVER; '' checks nothing), then g x
# (generation, newest event time). Returns how many rose, or -1 if the server changed.
RAISE_GENERATIONS = (
    _SERVER
    + """
if server_changed(ARGV[1]) then return -1 end
local n = 0
for i = 2, #ARGV, 2 do
  if tonumber(ARGV[i + 1]) > tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '-1') then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    n = n + 1
  end
end
return n
"""
)

# The at-least-once baseline raises source lanes' event-time marks (what the watermark is
# computed from) without anything else. KEYS: 1 lanes, 2 lane activity.
# ARGV: l x (lane, newest event time, batch time)
RAISE_LANES = """
for i = 1, #ARGV, 3 do
  local newest = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '-1')
  if tonumber(ARGV[i + 1]) > newest then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 2])
end
return 1
"""

# GC deletes keyed state whose time-to-live ran out before ARGV[1] (re-checked here: a commit
# that updated the key meanwhile moved its expiry on, and keeps it).
# KEYS: 1 state hash, 2 expiry sorted set. ARGV: 1 threshold, 2.. keys. Returns how many went.
EXPIRE_STATE = """
local n = 0
for i = 2, #ARGV do
  local at = redis.call('ZSCORE', KEYS[2], ARGV[i])
  if at and tonumber(at) <= tonumber(ARGV[1]) then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
    n = n + 1
  end
end
return n
"""


# Delete a key only if it still holds ARGV[1] (a driver's heartbeat: a newer driver may have
# taken it over). KEYS: 1 the key. Returns 1 if deleted.
DELETE_IF_EQUAL = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Scripts:
    """The scripts registered on one client (EVALSHA, reloaded after a Redis restart)."""

    def __init__(self, client: object) -> None:
        register = client.register_script  # type: ignore[attr-defined]
        self.claim = register(CLAIM)
        self.commit = register(COMMIT)
        self.finish = register(FINISH)
        self.prepare_delivery = register(PREPARE_DELIVERY)
        self.log_delivery = register(LOG_DELIVERY)
        self.note_writer = register(NOTE_WRITER)
        self.lookup = register(LOOKUP)
        self.snapshot = register(SNAPSHOT)
        self.catch_up = register(CATCH_UP)
        self.batch_params = register(BATCH_PARAMS)
        self.ack = register(ACK)
        self.forget_generation = register(FORGET_GENERATION)
        self.raise_lanes = register(RAISE_LANES)
        self.raise_generations = register(RAISE_GENERATIONS)
        self.raise_epoch = register(RAISE_EPOCH)
        self.expire_state = register(EXPIRE_STATE)
        self.delete_if_equal = register(DELETE_IF_EQUAL)


_REGISTERED: dict[int, Scripts] = {}


def scripts_for(client: object) -> Scripts:
    """The registry bound to ``client`` (one per client and process)."""
    found = _REGISTERED.get(id(client))
    if found is None:
        found = Scripts(client)
        _REGISTERED[id(client)] = found
    return found
