-- Store a semaphore's capacity on purpose (the only way to change it). Lowering
-- it drains: existing permits stay until released or expired, and new ones wait
-- until fewer than the new capacity remain. Raising it wakes waiters (they track
-- the meta hash). Expired permits are pruned, and the permit set's own expiry is
-- kept at its highest score.
-- KEYS[1]  meta hash {capacity, fence}, never expires
-- KEYS[2]  permit set (sorted set: owner:slot:token -> expiry in ms)
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

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if pt == 'zset' and redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', string.format('%d', now)) > 0 then
  local top = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
  if #top > 0 then
    local at = math.ceil(tonumber(top[2]))
    if at > now and at < 2^53 and redis.call('PEXPIRETIME', KEYS[2]) ~= at then
      redis.call('PEXPIREAT', KEYS[2], string.format('%d', at))
    end
  end
end
if stored ~= cap then
  redis.call('HSET', KEYS[1], 'capacity', cap)
end
if stored then return tonumber(stored) end
return -1
