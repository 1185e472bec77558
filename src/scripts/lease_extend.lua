-- Set a new expiry on a lease only if it still holds this owner's value.
-- Never re-creates a missing key.
-- KEYS[1]  lease key
-- ARGV[1]  the value the holder set
-- ARGV[2]  new ttl in milliseconds, counted from now
-- returns  1 extended; 0 the key is gone; -1 someone else holds it (a value of
--          another type included)
local v = redis.pcall('GET', KEYS[1])
if not v then return 0 end
if type(v) == 'table' or v ~= ARGV[1] then return -1 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
