-- Change the value a leader advertises, only while the lease still holds this
-- leader's owner:term value.
-- KEYS[1]  lease key
-- KEYS[2]  value key (same cluster slot)
-- ARGV[1]  the lease value the leader set (owner:term)
-- ARGV[2]  the term
-- ARGV[3]  the new value
-- returns  {1, pttl} set (pttl -1: no expiry); {0} the lease is gone; {-1}
--          someone else holds it (a value of another type included); in both
--          of the latter nothing is changed
-- errors   BADKEY KEYS[2] (a value key of another type); nothing is changed
local v = redis.pcall('GET', KEYS[1])
if not v then return {0} end
if type(v) == 'table' or v ~= ARGV[1] then return {-1} end
local vt = redis.call('TYPE', KEYS[2]).ok
if vt ~= 'none' and vt ~= 'string' then
  return redis.error_reply('BADKEY KEYS[2] holds a ' .. vt .. ', not a value')
end
redis.call('SET', KEYS[2], ARGV[2] .. ':' .. ARGV[3])
return {1, redis.call('PTTL', KEYS[1])}
