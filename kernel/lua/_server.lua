-- The Redis server a writer began on: its run id (INFO server), a new one at every start of
-- the server process, on the master a failover promoted too. A server that restarted may have
-- lost the writes it had not fsynced (a host crash with ``appendfsync everysec``) or passed on
-- to its replica (a failover): whoever wrote there before must not write on top of what is
-- left (see onceflow.dedup.durability). '' checks nothing (tools that write no batch work).
local function server_changed(expected)
  if expected == '' then return false end
  return string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') ~= expected
end
