-- Give a permit a new expiry, counted from now (server TIME), only if it is still
-- in the permit set and has not expired. An expired permit is removed instead
-- (with its index entry and slot bit) and never comes back. Never adds a missing
-- permit. Other permits are left alone: every acquire prunes them.
-- KEYS[1]  permit set (sorted set: owner:slot:token -> expiry in ms)
-- KEYS[2]  meta hash {capacity, fence, holder:<owner>}
-- KEYS[3]  slot bitmap
-- ARGV[1]  the permit's member, owner:slot:token
-- ARGV[2]  new ttl in milliseconds (positive integer)
-- returns  1 extended; 0 the permit is gone (expired, released or never there)
-- errors   BADARG (bad ARGV), BADKEY KEYS[n] (a key of another type); nothing is
--          changed
local member = ARGV[1]
if member == nil or member == '' then
  return redis.error_reply('BADARG the permit must be non-empty')
end
local ttl = ARGV[2] and string.match(ARGV[2], '^[1-9]%d*$') and string.len(ARGV[2]) <= 13
  and tonumber(ARGV[2])
if not ttl then
  return redis.error_reply('BADARG ttl must be a positive integer of milliseconds')
end
local kinds = {'zset', 'hash', 'string'}
local what = {'a sorted set of permits', 'a semaphore hash', 'a slot bitmap'}
for i = 1, 3 do
  local t = redis.call('TYPE', KEYS[i]).ok
  if t ~= 'none' and t ~= kinds[i] then
    return redis.error_reply('BADKEY KEYS[' .. i .. '] holds a ' .. t .. ', not ' .. what[i])
  end
end
-- No writes above this line.

local score = redis.call('ZSCORE', KEYS[1], member)
if not score then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if math.ceil(tonumber(score)) <= now then
  redis.call('ZREM', KEYS[1], member)
  local who, slot, token = string.match(member, '^([^:]*):(%d+):(%d+)$')
  if who then
    if redis.call('HGET', KEYS[2], 'holder:' .. who) == slot .. ':' .. token then
      redis.call('HDEL', KEYS[2], 'holder:' .. who)
    end
    redis.call('SETBIT', KEYS[3], slot, 0)
  end
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', string.format('%d', now + ttl), member)
return 1
