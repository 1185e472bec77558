-- A waiting writer stops waiting: remove its intent, so the readers it held back
-- (they track this key) are woken. Expired intents of others are pruned too.
-- KEYS[1]  waiting-writer intents (sorted set: writer owner -> intent expiry in ms)
-- ARGV[1]  owner (non-empty, no colon)
-- returns  1 the owner's intent was removed; 0 it had none
-- errors   BADARG (bad ARGV), BADKEY KEYS[1] (a key of another type); nothing is
--          changed
local owner = ARGV[1]
if owner == nil or owner == '' or string.find(owner, ':', 1, true) then
  return redis.error_reply('BADARG owner must be non-empty and contain no colon')
end
local qt = redis.call('TYPE', KEYS[1]).ok
if qt == 'none' then return 0 end
if qt ~= 'zset' then
  return redis.error_reply('BADKEY KEYS[1] holds a ' .. qt .. ', not a sorted set of writer intents')
end
-- No writes above this line.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local removed = redis.call('ZREM', KEYS[1], owner)
local pruned = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now))
if removed + pruned > 0 then
  -- Keep the set's own expiry at its highest score.
  local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  if #top > 0 then
    local at = math.ceil(tonumber(top[2]))
    if at > now and at < 2^53 and redis.call('PEXPIRETIME', KEYS[1]) ~= at then
      redis.call('PEXPIREAT', KEYS[1], string.format('%d', at))
    end
  end
end
return removed
