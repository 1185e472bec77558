-- Take a semaphore permit: the lowest free slot in 0..capacity and a new fencing
-- token from the semaphore's counter, as the member owner:slot:token of the
-- permit set with its own expiry (server TIME). Expired permits are pruned first.
-- The capacity is stored beside the permits on first use; a different one is
-- refused. After the capacity was lowered, existing permits stay until released
-- or expired and new ones wait until fewer than the capacity remain.
-- Idempotent for one owner: an unexpired permit of ARGV[1] (an earlier attempt
-- whose reply was lost) is returned again, with no new increment and its expiry
-- moved to ttl from now if that is later (never earlier: a late duplicate of an
-- acquire must not shorten a permit that was extended since).
-- The permit set carries its own key expiry at its highest score. A busy attempt
-- reads both keys after its last write to them, which arms client tracking.
-- KEYS[1]  permit set (sorted set: owner:slot:token -> expiry in ms)
-- KEYS[2]  meta hash {capacity, fence}, never expires
-- ARGV[1]  owner (non-empty, no colon)
-- ARGV[2]  ttl in milliseconds (positive integer)
-- ARGV[3]  capacity (integer 1..10000)
-- returns  {1, slot, token} granted, slot an integer, token a string;
--          {0, wait_ms} all slots taken: ms until enough permits have expired by
--          themselves for one to be free
-- errors   BADARG (bad ARGV); BADKEY KEYS[1] / KEYS[2] (a key of another type,
--          a stored capacity that is not a positive integer); BADFENCE KEYS[2]
--          (meta with an expiry, a fence field that is not a non-negative
--          integer, or at 9223372036854775807 when a new token is needed);
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
      local live = pt == 'zset' and redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. string.format('%d', now), '+inf') or {}
      local retry = false
      for _, m in ipairs(live) do
        if string.sub(m, 1, string.len(owner) + 1) == owner .. ':' then retry = true end
      end
      if not retry then
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

-- Sets the permit set's own expiry to its highest score; writes only on a change.
local function keep_expiry()
  local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  if #top == 0 then return end
  local at = math.ceil(tonumber(top[2]))
  if at > now and at < 2^53 and redis.call('PEXPIRETIME', KEYS[1]) ~= at then
    redis.call('PEXPIREAT', KEYS[1], string.format('%d', at))
  end
end
if pt == 'zset' and redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now)) > 0 then
  keep_expiry()
end
if not stored then
  redis.call('HSET', KEYS[2], 'capacity', cap)
end

local expiry = string.format('%d', now + ttl)
local held = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local count = #held / 2
local used = {}
for i = 1, #held, 2 do
  local who, slot, token = string.match(held[i], '^([^:]*):(%d+):(%d+)$')
  if who == owner then
    redis.call('ZADD', KEYS[1], 'XX', 'GT', expiry, held[i])
    keep_expiry()
    return {1, tonumber(slot), token}
  end
  if slot then used[tonumber(slot)] = true end
end
if count >= capn then
  -- Re-read the capacity: a raised capacity could free this attempt.
  redis.call('HGET', KEYS[2], 'capacity')
  return {0, math.ceil(tonumber(held[2 * (count - capn) + 2])) - now}
end
local slot = 0
while used[slot] do slot = slot + 1 end
redis.call('HINCRBY', KEYS[2], 'fence', 1)
local token = redis.call('HGET', KEYS[2], 'fence')
redis.call('ZADD', KEYS[1], expiry, owner .. ':' .. slot .. ':' .. token)
keep_expiry()
return {1, slot, token}
