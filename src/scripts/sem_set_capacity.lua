-- Store a semaphore's capacity on purpose (the only way to change it). Lowering
-- it drains: existing permits stay until released or expired, and new ones wait
-- until fewer than the new capacity remain. Raising it wakes waiters (they track
-- the meta hash). Permits are left alone: every acquire prunes expired ones.
-- KEYS[1]  meta hash {capacity, fence, holder:<owner>}, never expires
-- KEYS[2]  permit set (sorted set: owner:slot:token -> expiry in ms), checked only
-- ARGV[1]  the new capacity (integer 1..10000)
-- returns  the previous capacity, or -1 if none was stored
-- errors   BADARG (bad ARGV); BADKEY KEYS[1] / KEYS[2] (a key of another type, a
--          stored capacity that is not a positive integer); BADFENCE KEYS[1]
--          (meta with an expiry, a fence field that is not a non-negative
--          integer); nothing is changed
local cap = ARGV[1]
local capn = cap and string.match(cap, '^[1-9]%d*$') and string.len(cap) <= 5 and tonumber(cap)
if not capn or capn > 10000 then
  return redis.error_reply('BADARG capacity must be an integer from 1 to 10000')
end
local mt = redis.call('TYPE', KEYS[1]).ok
local stored
if mt ~= 'none' then
  if mt ~= 'hash' then
    return redis.error_reply('BADKEY KEYS[1] holds a ' .. mt .. ', not a semaphore hash')
  end
  if redis.call('PTTL', KEYS[1]) ~= -1 then
    return redis.error_reply('BADFENCE KEYS[1] has an expiry; a semaphore hash must never expire')
  end
  local fence
  stored, fence = unpack(redis.call('HMGET', KEYS[1], 'capacity', 'fence'))
  if stored and not (string.match(stored, '^[1-9]%d*$') and string.len(stored) <= 9) then
    return redis.error_reply('BADKEY KEYS[1] has a capacity field that is not a positive integer')
  end
  if fence then
    local n = string.len(fence)
    if not (fence == '0' or (string.match(fence, '^[1-9]%d*$')
        and (n < 19 or (n == 19 and fence <= '9223372036854775807')))) then
      return redis.error_reply('BADFENCE KEYS[1] has a fence field that is not a non-negative integer counter')
    end
  end
end
local pt = redis.call('TYPE', KEYS[2]).ok
if pt ~= 'none' and pt ~= 'zset' then
  return redis.error_reply('BADKEY KEYS[2] holds a ' .. pt .. ', not a sorted set of permits')
end
-- No writes above this line.

if stored ~= cap then
  redis.call('HSET', KEYS[1], 'capacity', cap)
end
if stored then return tonumber(stored) end
return -1
