-- Prune expired permits (server TIME, with their index entries and slot bits)
-- and report the semaphore's state.
-- KEYS[1]  permit set (sorted set: owner:slot:token -> expiry in ms)
-- KEYS[2]  meta hash {capacity, fence, holder:<owner>}, never expires
-- KEYS[3]  slot bitmap
-- returns  {capacity or -1 if none stored, count, member1, remaining_ms1,
--          member2, remaining_ms2, ...}: the unexpired permits, soonest to expire
--          first, each with the ms left until it expires
-- errors   BADKEY KEYS[1] / KEYS[2] (a key of another type, a stored capacity
--          that is not a positive integer); BADFENCE KEYS[2] (meta with an
--          expiry, a fence field that is not a non-negative integer); nothing
--          is changed
local pt = redis.call('TYPE', KEYS[1]).ok
if pt ~= 'none' and pt ~= 'zset' then
  return redis.error_reply('BADKEY KEYS[1] holds a ' .. pt .. ', not a sorted set of permits')
end
local mt = redis.call('TYPE', KEYS[2]).ok
local stored
if mt ~= 'none' then
  if mt ~= 'hash' then
    return redis.error_reply('BADKEY KEYS[2] holds a ' .. mt .. ', not a semaphore hash')
  end
  if redis.call('PTTL', KEYS[2]) ~= -1 then
    return redis.error_reply('BADFENCE KEYS[2] has an expiry; a semaphore hash must never expire')
  end
  local fence
  stored, fence = unpack(redis.call('HMGET', KEYS[2], 'capacity', 'fence'))
  if stored and not (string.match(stored, '^[1-9]%d*$') and string.len(stored) <= 9) then
    return redis.error_reply('BADKEY KEYS[2] has a capacity field that is not a positive integer')
  end
  if fence then
    local n = string.len(fence)
    if not (fence == '0' or (string.match(fence, '^[1-9]%d*$')
        and (n < 19 or (n == 19 and fence <= '9223372036854775807')))) then
      return redis.error_reply('BADFENCE KEYS[2] has a fence field that is not a non-negative integer counter')
    end
  end
end
-- No writes above this line.

local st = redis.call('TYPE', KEYS[3]).ok
if st ~= 'none' and st ~= 'string' then
  return redis.error_reply('BADKEY KEYS[3] holds a ' .. st .. ', not a slot bitmap')
end
-- No writes above this line.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local reply = {-1, 0}
if stored then reply[1] = tonumber(stored) end
if pt ~= 'zset' then return reply end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now))) do
  redis.call('ZREM', KEYS[1], m)
  local who, slot, token = string.match(m, '^([^:]*):(%d+):(%d+)$')
  if who then
    if redis.call('HGET', KEYS[2], 'holder:' .. who) == slot .. ':' .. token then
      redis.call('HDEL', KEYS[2], 'holder:' .. who)
    end
    redis.call('SETBIT', KEYS[3], slot, 0)
  end
end
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('DEL', KEYS[3]) end
local held = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
reply[2] = #held / 2
for i = 1, #held, 2 do
  reply[#reply + 1] = held[i]
  reply[#reply + 1] = math.ceil(tonumber(held[i + 1])) - now
end
return reply
