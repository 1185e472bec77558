-- Read who leads an election, without changing anything.
-- KEYS[1]  lease key (holds owner:term while a leader holds it)
-- KEYS[2]  value key (term:value, set by the leader's grant and proclamations)
-- returns  {0} no leader; {1, term, value, pttl} the leader's term (a string),
--          its advertised value (false when the value key does not belong to
--          that term) and the lease's remaining time in milliseconds (-1: no
--          expiry)
-- errors   BADKEY KEYS[1] (a lease key of another type or shape); nothing is
--          changed
local lt = redis.call('TYPE', KEYS[1]).ok
if lt == 'none' then return {0} end
if lt ~= 'string' then
  return redis.error_reply('BADKEY KEYS[1] holds a ' .. lt .. ', not a leader lease')
end
local held = redis.call('GET', KEYS[1])
local term = string.match(held, ':([1-9]%d*)$')
if not term then
  return redis.error_reply('BADKEY KEYS[1] does not hold an owner:term leader lease')
end
local pttl = redis.call('PTTL', KEYS[1])
local value = false
local v = redis.pcall('GET', KEYS[2])
if type(v) == 'string' and string.sub(v, 1, string.len(term) + 1) == term .. ':' then
  value = string.sub(v, string.len(term) + 2)
end
return {1, term, value, pttl}
