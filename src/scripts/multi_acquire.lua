-- Take several leases at once, all or none: every lease must be free or already
-- this owner's; then each free one is set (a fenced one after incrementing its
-- counter) and each of this owner's keeps its grant. If any is held by someone
-- else, nothing is changed.
-- Idempotent for one owner: a lease that already holds this owner's value (an
-- earlier attempt of the same acquire whose reply was lost) is granted again
-- with the same token, its expiry moved to ttl from now if that is later (never
-- earlier).
-- KEYS[1..n]     lease keys (one cluster slot, all of them)
-- KEYS[n+1..2n]  with ARGV[3] = 'fenced': the fence counter of each lease, in
--                the same order
-- ARGV[1]  owner value (a plain lease holds it; a fenced one holds owner:token)
-- ARGV[2]  ttl in milliseconds
-- ARGV[3]  'plain' or 'fenced'
-- returns  {1, token1, ..., tokenn} when granted (tokens as strings; '0' for a
--          plain lease); {0, i, pttl} when lease i is held by someone else (pttl
--          -1: no expiry)
-- errors   BADKEY KEYS[i] (a lease of another type), BADFENCE KEYS[i] (a counter
--          of another type, with an expiry, or not a non-negative integer),
--          INCR's overflow error at a counter's maximum; nothing is changed
local fenced = ARGV[3] == 'fenced'
local n = fenced and #KEYS / 2 or #KEYS
local owner = ARGV[1]
local mine = owner .. ':'
local held = {}
for i = 1, n do
  local lt = redis.call('TYPE', KEYS[i]).ok
  if lt ~= 'none' and lt ~= 'string' then
    return redis.error_reply('BADKEY KEYS[' .. i .. '] holds a ' .. lt .. ', not a lease')
  end
  if fenced then
    local f = n + i
    local ft = redis.call('TYPE', KEYS[f]).ok
    if ft ~= 'none' then
      if ft ~= 'string' then
        return redis.error_reply('BADFENCE KEYS[' .. f .. '] holds a ' .. ft .. ', not a counter')
      end
      if redis.call('PTTL', KEYS[f]) ~= -1 then
        return redis.error_reply('BADFENCE KEYS[' .. f .. '] has an expiry; a fencing counter must never expire')
      end
      local v = redis.call('GET', KEYS[f])
      if not (v == '0' or (string.match(v, '^[1-9]%d*$') and string.len(v) <= 19)) then
        return redis.error_reply('BADFENCE KEYS[' .. f .. '] is not a non-negative integer counter')
      end
      if v == '9223372036854775807' and lt == 'none' then
        return redis.error_reply('BADFENCE KEYS[' .. f .. '] is at the largest value a counter can hold')
      end
    end
  end
  if lt == 'string' then
    local v = redis.call('GET', KEYS[i])
    if fenced then
      if string.sub(v, 1, string.len(mine)) ~= mine then
        return {0, i, redis.call('PTTL', KEYS[i])}
      end
      held[i] = string.sub(v, string.len(mine) + 1)
    else
      if v ~= owner then
        return {0, i, redis.call('PTTL', KEYS[i])}
      end
      held[i] = '0'
    end
  end
end
local reply = {1}
for i = 1, n do
  local token = held[i]
  if token then
    local left = redis.call('PTTL', KEYS[i])
    if left >= 0 and left < tonumber(ARGV[2]) then
      redis.call('PEXPIRE', KEYS[i], ARGV[2])
    end
  elseif fenced then
    redis.call('INCR', KEYS[n + i])
    token = redis.call('GET', KEYS[n + i])
    redis.call('SET', KEYS[i], mine .. token, 'PX', ARGV[2])
  else
    token = '0'
    redis.call('SET', KEYS[i], owner, 'PX', ARGV[2])
  end
  reply[i + 1] = token
end
return reply
