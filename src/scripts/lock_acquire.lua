-- Take a plain lock if it is free, else report how long its holder has left.
-- The reads (TYPE, GET, PTTL) also arm client tracking for waiters.
-- Idempotent for one owner: if the key already holds ARGV[1] (an earlier
-- attempt of the same acquire whose reply was lost), it is granted again, its
-- expiry moved to ttl from now if that is later (never earlier: a late
-- duplicate of an acquire must not shorten a lock that was extended since).
-- KEYS[1]  lock key
-- ARGV[1]  owner value
-- ARGV[2]  ttl in milliseconds
-- returns  {1} when the lock was set; {0, pttl} when it is held (pttl -1: no expiry)
-- errors   BADKEY when the key holds another type; nothing is changed
local t = redis.call('TYPE', KEYS[1]).ok
if t == 'none' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {1}
end
if t ~= 'string' then
  return redis.error_reply('BADKEY holds a ' .. t .. ', not a lock')
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  local left = redis.call('PTTL', KEYS[1])
  if left >= 0 and left < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  return {1}
end
return {0, redis.call('PTTL', KEYS[1])}
