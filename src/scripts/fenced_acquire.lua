-- Take a fenced lease if it is free: increment the persistent counter and set the
-- lease to owner:token. Else report how long its holder has left.
-- The counter is never given an expiry, never deleted and never reset here.
-- Idempotent for one owner: if the lease already holds ARGV[1]:token (an earlier
-- attempt of the same acquire whose reply was lost), that grant is returned
-- again, with its expiry set anew from now and no new increment.
-- KEYS[1]  lease key
-- KEYS[2]  fence counter key (same cluster slot as the lease)
-- ARGV[1]  owner value
-- ARGV[2]  ttl in milliseconds
-- returns  {1, token} when granted; {0, pttl} when held (pttl -1: no expiry)
-- errors   BADKEY (lease of another type), BADFENCE (counter of another type, with
--          an expiry, or not a non-negative integer); nothing is changed
local ft = redis.call('TYPE', KEYS[2]).ok
if ft ~= 'none' then
  if ft ~= 'string' then
    return redis.error_reply('BADFENCE holds a ' .. ft .. ', not a counter')
  end
  if redis.call('PTTL', KEYS[2]) ~= -1 then
    return redis.error_reply('BADFENCE has an expiry; a fencing counter must never expire')
  end
  local v = redis.call('GET', KEYS[2])
  if not (v == '0' or (string.match(v, '^[1-9]%d*$') and string.len(v) <= 18)) then
    return redis.error_reply('BADFENCE is not a non-negative integer counter')
  end
end
local lt = redis.call('TYPE', KEYS[1]).ok
if lt == 'none' then
  local token = redis.call('INCR', KEYS[2])
  redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token, 'PX', ARGV[2])
  return {1, token}
end
if lt ~= 'string' then
  return redis.error_reply('BADKEY holds a ' .. lt .. ', not a lease')
end
local mine = ARGV[1] .. ':'
local held = redis.call('GET', KEYS[1])
if string.sub(held, 1, string.len(mine)) == mine then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(string.sub(held, string.len(mine) + 1))}
end
return {0, redis.call('PTTL', KEYS[1])}
