-- Take the write lease if no writer holds it and no unexpired reader remains:
-- increment the persistent counter, set the lease to owner:token and drop the
-- owner's intent. Expired readers and intents are pruned first. When busy and
-- ARGV[3] > 0, record the owner's intent, or refresh it once a quarter of its
-- lifetime has passed (so that a writer retrying often does not wake the
-- readers it holds back each time); the intent holds new readers back under
-- writer preference; current readers are not revoked.
-- The counter is never given an expiry, never deleted and never reset here.
-- Idempotent for one owner: if the lease already holds ARGV[1]:token (an earlier
-- attempt whose reply was lost), that grant is returned again, with no new
-- increment and its expiry moved to ttl from now if that is later (never
-- earlier: a late duplicate of an acquire must not shorten a lease that was
-- extended since).
-- Times are the server's (TIME). The reader and intent sets carry their own key
-- expiry at their highest score. Every key whose change could free a busy
-- attempt is read after the script's last write to it, which arms client
-- tracking for waiters.
-- KEYS[1]  writer lease (string owner:token, PX)
-- KEYS[2]  reader set (sorted set: reader owner -> expiry in ms)
-- KEYS[3]  waiting-writer intents (sorted set: writer owner -> intent expiry in ms)
-- KEYS[4]  write fence counter (string, never expires)
-- ARGV[1]  owner (non-empty, no colon)
-- ARGV[2]  ttl in milliseconds (positive integer)
-- ARGV[3]  intent lifetime in milliseconds when busy (0: record no intent)
-- returns  {1, token} granted, the token as a string; {0, wait_ms} busy: ms
--          until what blocks it expires by itself (the writer's PTTL, or the
--          latest reader expiry), -1 if it has no expiry
-- errors   BADARG (bad ARGV), BADKEY KEYS[n] (a key of another type),
--          BADFENCE KEYS[4] (counter of another type, with an expiry, not a
--          non-negative integer, or at 9223372036854775807 when a new token is
--          needed); nothing is changed
local owner = ARGV[1]
if owner == nil or owner == '' or string.find(owner, ':', 1, true) then
  return redis.error_reply('BADARG owner must be non-empty and contain no colon')
end
local ttl = ARGV[2] and string.match(ARGV[2], '^[1-9]%d*$') and string.len(ARGV[2]) <= 13
  and tonumber(ARGV[2])
if not ttl then
  return redis.error_reply('BADARG ttl must be a positive integer of milliseconds')
end
local intent = ARGV[3] and string.match(ARGV[3], '^%d+$') and string.len(ARGV[3]) <= 13
  and tonumber(ARGV[3])
if not intent then
  return redis.error_reply('BADARG intent must be a non-negative integer of milliseconds')
end

local function want(i, kind, what)
  local t = redis.call('TYPE', KEYS[i]).ok
  if t ~= 'none' and t ~= kind then
    return nil, redis.error_reply('BADKEY KEYS[' .. i .. '] holds a ' .. t .. ', not ' .. what)
  end
  return t
end
local wt, err = want(1, 'string', 'a writer lease')
if err then return err end
local rt
rt, err = want(2, 'zset', 'a sorted set of readers')
if err then return err end
local qt
qt, err = want(3, 'zset', 'a sorted set of writer intents')
if err then return err end
local ft = redis.call('TYPE', KEYS[4]).ok
if ft ~= 'none' then
  if ft ~= 'string' then
    return redis.error_reply('BADFENCE KEYS[4] holds a ' .. ft .. ', not a counter')
  end
  if redis.call('PTTL', KEYS[4]) ~= -1 then
    return redis.error_reply('BADFENCE KEYS[4] has an expiry; a fencing counter must never expire')
  end
  local v = redis.call('GET', KEYS[4])
  local n = string.len(v)
  if not (v == '0' or (string.match(v, '^[1-9]%d*$')
      and (n < 19 or (n == 19 and v <= '9223372036854775807')))) then
    return redis.error_reply('BADFENCE KEYS[4] is not a non-negative integer counter')
  end
  if v == '9223372036854775807' then
    -- Only a retry of the holder's own grant needs no new token.
    local held = wt == 'string' and redis.call('GET', KEYS[1])
    if not (held and string.sub(held, 1, string.len(owner) + 1) == owner .. ':') then
      return redis.error_reply('BADFENCE KEYS[4] is at its maximum and cannot issue another token')
    end
  end
end
-- No writes above this line.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Sets a sorted set's own expiry to its highest score; writes only on a change.
local function keep_expiry(key)
  local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #top == 0 then return end
  local at = math.ceil(tonumber(top[2]))
  if at > now and at < 2^53 and redis.call('PEXPIRETIME', key) ~= at then
    redis.call('PEXPIREAT', key, string.format('%d', at))
  end
end
local function prune(key)
  if redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now)) > 0 then
    keep_expiry(key)
  end
end
local function drop_intent()
  if redis.call('ZREM', KEYS[3], owner) > 0 then keep_expiry(KEYS[3]) end
end
if rt == 'zset' then prune(KEYS[2]) end
if qt == 'zset' then prune(KEYS[3]) end

local wait
if wt == 'string' then
  local mine = owner .. ':'
  local held = redis.call('GET', KEYS[1])
  if string.sub(held, 1, string.len(mine)) == mine then
    local left = redis.call('PTTL', KEYS[1])
    if left >= 0 and left < ttl then
      redis.call('PEXPIRE', KEYS[1], ARGV[2])
    end
    drop_intent()
    return {1, string.sub(held, string.len(mine) + 1)}
  end
  wait = redis.call('PTTL', KEYS[1])
else
  local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
  if #last == 0 then
    redis.call('INCR', KEYS[4])
    local token = redis.call('GET', KEYS[4])
    redis.call('SET', KEYS[1], owner .. ':' .. token, 'PX', ARGV[2])
    drop_intent()
    return {1, token}
  end
  wait = math.ceil(tonumber(last[2])) - now
end
if intent > 0 then
  -- Refreshed only once a quarter of it has passed: every write to the intent
  -- set wakes the readers waiting on it.
  local score = redis.call('ZSCORE', KEYS[3], owner)
  if not score or tonumber(score) - now < intent * 3 / 4 then
    redis.call('ZADD', KEYS[3], string.format('%d', now + intent), owner)
    keep_expiry(KEYS[3])
  end
end
return {0, wait}
