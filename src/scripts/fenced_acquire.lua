-- Take a fenced lease if it is free: increment the persistent counter and set the
-- lease to owner:token. Else report how long its holder has left.
-- The counter is never given an expiry, never deleted and never reset here.
-- Idempotent for one owner: if the lease already holds ARGV[1]:token (an earlier
-- attempt of the same acquire whose reply was lost), that grant is returned
-- again, with no new increment and its expiry moved to ttl from now if that is
-- later (never earlier: a late duplicate of an acquire must not shorten a lease
-- that was extended since).
-- KEYS[1]  lease key
-- KEYS[2]  fence counter key (same cluster slot as the lease)
-- KEYS[3]  optional: a value key (same slot), set to token:ARGV[3] with every
--          grant, the repeated one included; it never expires, and the token
--          ties it to the grant that set it
-- ARGV[1]  owner value
-- ARGV[2]  ttl in milliseconds
-- ARGV[3]  with KEYS[3]: the value
-- returns  {1, token} when granted, the token as a string (a Lua number would
--          print 1e+14 and lose digits above 2^53); {0, pttl} when held (pttl -1:
--          no expiry)
-- errors   BADKEY (lease of another type), BADFENCE (counter of another type, with
--          an expiry, or not a non-negative integer), and INCR's overflow error
--          at the counter's maximum; BADKEY KEYS[3] (a value key of another
--          type); nothing is changed
if KEYS[3] then
  local vt = redis.call('TYPE', KEYS[3]).ok
  if vt ~= 'none' and vt ~= 'string' then
    return redis.error_reply('BADKEY KEYS[3] holds a ' .. vt .. ', not a value')
  end
end
local ft = redis.call('TYPE', KEYS[2]).ok
if ft ~= 'none' then
  if ft ~= 'string' then
    return redis.error_reply('BADFENCE holds a ' .. ft .. ', not a counter')
  end
  if redis.call('PTTL', KEYS[2]) ~= -1 then
    return redis.error_reply('BADFENCE has an expiry; a fencing counter must never expire')
  end
  local v = redis.call('GET', KEYS[2])
  if not (v == '0' or (string.match(v, '^[1-9]%d*$') and string.len(v) <= 19)) then
    return redis.error_reply('BADFENCE is not a non-negative integer counter')
  end
end
local lt = redis.call('TYPE', KEYS[1]).ok
if lt == 'none' then
  redis.call('INCR', KEYS[2])
  local token = redis.call('GET', KEYS[2])
  redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token, 'PX', ARGV[2])
  if KEYS[3] then redis.call('SET', KEYS[3], token .. ':' .. ARGV[3]) end
  return {1, token}
end
if lt ~= 'string' then
  return redis.error_reply('BADKEY holds a ' .. lt .. ', not a lease')
end
local mine = ARGV[1] .. ':'
local held = redis.call('GET', KEYS[1])
if string.sub(held, 1, string.len(mine)) == mine then
  local left = redis.call('PTTL', KEYS[1])
  if left >= 0 and left < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  local token = string.sub(held, string.len(mine) + 1)
  if KEYS[3] then redis.call('SET', KEYS[3], token .. ':' .. ARGV[3]) end
  return {1, token}
end
return {0, redis.call('PTTL', KEYS[1])}
