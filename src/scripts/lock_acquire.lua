-- Take a plain lock if it is free, else report how long its holder has left.
-- The reads (TYPE, PTTL) also arm client tracking for waiters.
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
return {0, redis.call('PTTL', KEYS[1])}
