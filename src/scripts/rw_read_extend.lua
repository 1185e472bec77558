-- Give a reader a new expiry, counted from now (server TIME), only if it is still
-- in the reader set and has not expired. An expired reader is removed instead and
-- never comes back. Never adds a missing reader. Expired readers of others are
-- pruned too, and the set's own expiry is kept at its highest score.
-- KEYS[1]  reader set (sorted set: reader owner -> expiry in ms)
-- ARGV[1]  owner (non-empty, no colon)
-- ARGV[2]  new ttl in milliseconds (positive integer)
-- returns  1 extended; 0 the reader is gone (expired, released or never there)
-- errors   BADARG (bad ARGV), BADKEY KEYS[1] (a key of another type); nothing is
--          changed
local owner = ARGV[1]
if owner == nil or owner == '' or string.find(owner, ':', 1, true) then
  return redis.error_reply('BADARG owner must be non-empty and contain no colon')
end
local ttl = ARGV[2] and string.match(ARGV[2], '^[1-9]%d*$') and string.len(ARGV[2]) <= 13
  and tonumber(ARGV[2])
if not ttl then
  return redis.error_reply('BADARG ttl must be a positive integer of milliseconds')
end
local rt = redis.call('TYPE', KEYS[1]).ok
if rt == 'none' then return 0 end
if rt ~= 'zset' then
  return redis.error_reply('BADKEY KEYS[1] holds a ' .. rt .. ', not a sorted set of readers')
end
-- No writes above this line.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local changed = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now)) > 0
local held = redis.call('ZSCORE', KEYS[1], owner) ~= false
if held then
  redis.call('ZADD', KEYS[1], 'XX', string.format('%d', now + ttl), owner)
  changed = true
end
if changed then
  local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  if #top > 0 then
    local at = math.ceil(tonumber(top[2]))
    if at > now and at < 2^53 and redis.call('PEXPIRETIME', KEYS[1]) ~= at then
      redis.call('PEXPIREAT', KEYS[1], string.format('%d', at))
    end
  end
end
if held then return 1 end
return 0
