-- Delete a lease only if it still holds this owner's value.
-- KEYS[1]  lease key
-- ARGV[1]  the value the holder set, or with ARGV[2] = 'prefix' the owner part of
--          it (used after an acquire whose reply was lost, when the token is unknown)
-- ARGV[2]  'exact' or 'prefix'
-- returns  1 deleted; 0 the key is gone (expired or deleted); -1 someone else holds
--          it (a value of another type included)
-- The holder's own release, the common case, is the first test: a value equal
-- to ARGV[1] is this owner's in both modes.
local v = redis.pcall('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
if not v then return 0 end
if type(v) == 'table' or ARGV[2] ~= 'prefix' then return -1 end
if string.sub(v, 1, string.len(ARGV[1])) ~= ARGV[1] then return -1 end
redis.call('DEL', KEYS[1])
return 1
