-- Take a semaphore permit: the lowest free slot in 0..capacity and a new fencing
-- token from the semaphore's counter, as the member owner:slot:token of the
-- permit set with its own expiry (server TIME). Expired permits are pruned first.
-- The capacity is stored beside the permits on first use; a different one is
-- refused. After the capacity was lowered, existing permits stay until released
-- or expired and new ones wait until fewer than the capacity remain.
-- Every step costs O(log n) or less, whatever the number of permits: the meta
-- hash indexes each holder (field holder:<owner> = slot:token) and the slot
-- bitmap marks the slots taken, so neither the owner's permit nor the lowest
-- free slot needs a scan. Both are kept in step with the permit set by every
-- script that removes a permit; a bitmap found out of step (keys changed by
-- hand) is rebuilt from the permit set.
-- Idempotent for one owner: an unexpired permit of ARGV[1] (an earlier attempt
-- whose reply was lost) is returned again, with no new increment and its expiry
-- moved to ttl from now if that is later (never earlier: a late duplicate of an
-- acquire must not shorten a permit that was extended since).
-- A busy attempt reads both the permit set and the meta hash after its last
-- write to them, which arms client tracking.
-- KEYS[1]  permit set (sorted set: owner:slot:token -> expiry in ms)
-- KEYS[2]  meta hash {capacity, fence, holder:<owner>}, never expires
-- KEYS[3]  slot bitmap (string: bit n set while slot n is taken)
-- ARGV[1]  owner (non-empty, no colon)
-- ARGV[2]  ttl in milliseconds (positive integer)
-- ARGV[3]  capacity (integer 1..10000)
-- returns  {1, slot, token} granted, slot an integer, token a string;
--          {0, wait_ms} all slots taken: ms until enough permits have expired by
--          themselves for one to be free
-- errors   BADARG (bad ARGV); BADKEY KEYS[n] (a key of another type, a stored
--          capacity that is not a positive integer); BADFENCE KEYS[2] (meta with
--          an expiry, a fence field that is not a non-negative integer, or at
--          9223372036854775807 when a new token is needed);
--          CAPMISMATCH <stored> <requested>; nothing is changed
local owner, cap = ARGV[1], ARGV[3]
if owner == nil or owner == '' or string.find(owner, ':', 1, true) then
  return redis.error_reply('BADARG owner must be non-empty and contain no colon')
end
local ttl = ARGV[2] and string.match(ARGV[2], '^[1-9]%d*$') and string.len(ARGV[2]) <= 13
  and tonumber(ARGV[2])
if not ttl then
  return redis.error_reply('BADARG ttl must be a positive integer of milliseconds')
end
local capn = cap and string.match(cap, '^[1-9]%d*$') and string.len(cap) <= 5 and tonumber(cap)
if not capn or capn > 10000 then
  return redis.error_reply('BADARG capacity must be an integer from 1 to 10000')
end

local pt = redis.call('TYPE', KEYS[1]).ok
if pt ~= 'none' and pt ~= 'zset' then
  return redis.error_reply('BADKEY KEYS[1] holds a ' .. pt .. ', not a sorted set of permits')
end
local st = redis.call('TYPE', KEYS[3]).ok
if st ~= 'none' and st ~= 'string' then
  return redis.error_reply('BADKEY KEYS[3] holds a ' .. st .. ', not a slot bitmap')
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
    if fence == '9223372036854775807' then
      -- Only a retry of a holder's own unexpired permit needs no new token.
      local t = redis.call('TIME')
      local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
      local mine = redis.call('HGET', KEYS[2], 'holder:' .. owner)
      local score = mine and pt == 'zset' and redis.call('ZSCORE', KEYS[1], owner .. ':' .. mine)
      if not (score and math.ceil(tonumber(score)) > now) then
        return redis.error_reply('BADFENCE KEYS[2] has a fence field at its maximum that cannot issue another token')
      end
    end
  end
  if stored and stored ~= cap then
    return redis.error_reply('CAPMISMATCH ' .. stored .. ' ' .. cap)
  end
end
-- No writes above this line.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Removes one permit with its index entry and its slot bit.
local function forget(member)
  redis.call('ZREM', KEYS[1], member)
  local who, slot, token = string.match(member, '^([^:]*):(%d+):(%d+)$')
  if who then
    if redis.call('HGET', KEYS[2], 'holder:' .. who) == slot .. ':' .. token then
      redis.call('HDEL', KEYS[2], 'holder:' .. who)
    end
    redis.call('SETBIT', KEYS[3], slot, 0)
  end
end
if pt == 'zset' then
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now))) do
    forget(m)
  end
  if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('DEL', KEYS[3]) end
elseif st == 'string' then
  -- No permit at all: no slot is taken.
  redis.call('DEL', KEYS[3])
end
if not stored then
  redis.call('HSET', KEYS[2], 'capacity', cap)
end

local expiry = string.format('%d', now + ttl)
local mine = redis.call('HGET', KEYS[2], 'holder:' .. owner)
if mine then
  local member = owner .. ':' .. mine
  if redis.call('ZSCORE', KEYS[1], member) then
    redis.call('ZADD', KEYS[1], 'XX', 'GT', expiry, member)
    local slot, token = string.match(mine, '^(%d+):(%d+)$')
    return {1, tonumber(slot), token}
  end
  -- An index entry whose permit is gone (keys changed by hand).
  redis.call('HDEL', KEYS[2], 'holder:' .. owner)
end

local count = redis.call('ZCARD', KEYS[1])
if count >= capn then
  -- The (count - capacity + 1)-th earliest expiry frees a slot. Re-read the
  -- capacity: a raised capacity could free this attempt.
  local at = redis.call('ZRANGE', KEYS[1], count - capn, count - capn, 'WITHSCORES')
  redis.call('HGET', KEYS[2], 'capacity')
  return {0, math.ceil(tonumber(at[2])) - now}
end
local slot = redis.call('BITPOS', KEYS[3], 0)
if slot < 0 or slot >= capn then
  -- Fewer permits than the capacity, so a slot below it is free: the bitmap is
  -- out of step with the permit set. Rebuild it.
  redis.call('DEL', KEYS[3])
  for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    local s = string.match(m, '^[^:]*:(%d+):%d+$')
    if s then redis.call('SETBIT', KEYS[3], s, 1) end
  end
  slot = redis.call('BITPOS', KEYS[3], 0)
end
redis.call('HINCRBY', KEYS[2], 'fence', 1)
local token = redis.call('HGET', KEYS[2], 'fence')
redis.call('ZADD', KEYS[1], expiry, owner .. ':' .. slot .. ':' .. token)
redis.call('HSET', KEYS[2], 'holder:' .. owner, slot .. ':' .. token)
redis.call('SETBIT', KEYS[3], slot, 1)
return {1, slot, token}
