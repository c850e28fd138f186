-- Task tokens are "<driver epoch>:<task attempt id>" (Spark's attempt ids only grow within a
-- driver; epochs grow across drivers), compared as a pair.
local function token_pair(t)
  local e, a = string.match(t, '^(%d+):(%d+)$')
  return tonumber(e), tonumber(a)
end
