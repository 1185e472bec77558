-- Check, without changing anything, whether a lease still holds this owner's value.
-- KEYS[1]  lease key
-- ARGV[1]  the value the holder set
-- returns  {1, pttl} held (pttl -1: no expiry); {0} the key is gone; {-1} someone
--          else holds it (a value of another type included)
local v = redis.pcall('GET', KEYS[1])
if not v then return {0} end
if type(v) == 'table' or v ~= ARGV[1] then return {-1} end
return {1, redis.call('PTTL', KEYS[1])}
