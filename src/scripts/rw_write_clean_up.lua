-- Delete whatever an unanswered write acquire of this owner may have set: the
-- writer lease if it holds owner:token, and the owner's intent. Run after the
-- connections those attempts went out on were killed, so no late attempt can
-- set either again. Expired intents of others are pruned too.
-- KEYS[1]  writer lease (string owner:token, PX)
-- KEYS[2]  waiting-writer intents (sorted set: writer owner -> intent expiry in ms)
-- ARGV[1]  owner (non-empty, no colon)
-- returns  1 the lease or the intent was removed; 0 neither was there
-- errors   BADARG (bad ARGV), BADKEY KEYS[n] (a key of another type); nothing
--          is changed
local owner = ARGV[1]
if owner == nil or owner == '' or string.find(owner, ':', 1, true) then
  return redis.error_reply('BADARG owner must be non-empty and contain no colon')
end
local wt = redis.call('TYPE', KEYS[1]).ok
if wt ~= 'none' and wt ~= 'string' then
  return redis.error_reply('BADKEY KEYS[1] holds a ' .. wt .. ', not a writer lease')
end
local qt = redis.call('TYPE', KEYS[2]).ok
if qt ~= 'none' and qt ~= 'zset' then
  return redis.error_reply('BADKEY KEYS[2] holds a ' .. qt .. ', not a sorted set of writer intents')
end
-- No writes above this line.

local removed = 0
if wt == 'string' then
  local mine = owner .. ':'
  local held = redis.call('GET', KEYS[1])
  if string.sub(held, 1, string.len(mine)) == mine then
    removed = redis.call('DEL', KEYS[1])
  end
end
if qt == 'zset' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local gone = redis.call('ZREM', KEYS[2], owner)
  local pruned = redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', string.format('%d', now))
  if gone + pruned > 0 then
    local top = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
    if #top > 0 then
      local at = math.ceil(tonumber(top[2]))
      if at > now and at < 2^53 and redis.call('PEXPIRETIME', KEYS[2]) ~= at then
        redis.call('PEXPIREAT', KEYS[2], string.format('%d', at))
      end
    end
  end
  removed = removed + gone
end
if removed > 0 then return 1 end
return 0
