-- Take a read lease: add the owner to the reader set with its own expiry, unless
-- a writer holds the lease or (writer preference) a waiting writer's unexpired
-- intent holds new readers back. Expired readers and intents are pruned first.
-- Idempotent for one owner: an owner already in the reader set (an earlier
-- attempt whose reply was lost) is granted again, its expiry moved to ttl from
-- now if that is later (never earlier: a late duplicate of an acquire must not
-- shorten a reader that was extended since).
-- Times are the server's (TIME). The reader and intent sets carry their own key
-- expiry at their highest score, so a set nobody prunes any more disappears.
-- Every key whose change could free a busy attempt is read after the script's
-- last write to it, which arms client tracking for waiters.
-- KEYS[1]  writer lease (string owner:token, PX)
-- KEYS[2]  reader set (sorted set: reader owner -> expiry in ms)
-- KEYS[3]  waiting-writer intents (sorted set: writer owner -> intent expiry in ms)
-- KEYS[4]  write fence counter (string, never expires)
-- ARGV[1]  owner (non-empty, no colon)
-- ARGV[2]  ttl in milliseconds (positive integer)
-- ARGV[3]  'writer' (intents hold new readers back) or 'reader' (intents ignored)
-- returns  {1, write_epoch} granted: the fence counter as a string ("0" if none),
--          the token of the last write; {0, wait_ms} busy: ms until what blocks
--          it expires by itself (the writer's PTTL, or the latest intent), -1 if
--          it has no expiry
-- errors   BADARG (bad ARGV), BADKEY KEYS[n] (a key of another type),
--          BADFENCE KEYS[4] (counter of another type, with an expiry, or not a
--          non-negative integer); nothing is changed
local owner, pref = ARGV[1], ARGV[3]
if owner == nil or owner == '' or string.find(owner, ':', 1, true) then
  return redis.error_reply('BADARG owner must be non-empty and contain no colon')
end
local ttl = ARGV[2] and string.match(ARGV[2], '^[1-9]%d*$') and string.len(ARGV[2]) <= 13
  and tonumber(ARGV[2])
if not ttl then
  return redis.error_reply('BADARG ttl must be a positive integer of milliseconds')
end
if pref ~= 'writer' and pref ~= 'reader' then
  return redis.error_reply("BADARG preference must be 'writer' or 'reader'")
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
local epoch = '0'
if ft ~= 'none' then
  if ft ~= 'string' then
    return redis.error_reply('BADFENCE KEYS[4] holds a ' .. ft .. ', not a counter')
  end
  if redis.call('PTTL', KEYS[4]) ~= -1 then
    return redis.error_reply('BADFENCE KEYS[4] has an expiry; a fencing counter must never expire')
  end
  epoch = redis.call('GET', KEYS[4])
  local n = string.len(epoch)
  if not (epoch == '0' or (string.match(epoch, '^[1-9]%d*$')
      and (n < 19 or (n == 19 and epoch <= '9223372036854775807')))) then
    return redis.error_reply('BADFENCE KEYS[4] is not a non-negative integer counter')
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
if rt == 'zset' then prune(KEYS[2]) end
if qt == 'zset' then prune(KEYS[3]) end

if wt == 'string' then
  return {0, redis.call('PTTL', KEYS[1])}
end
local expiry = string.format('%d', now + ttl)
if redis.call('ZSCORE', KEYS[2], owner) then
  redis.call('ZADD', KEYS[2], 'XX', 'GT', expiry, owner)
  keep_expiry(KEYS[2])
  return {1, epoch}
end
if pref == 'writer' then
  local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
  if #last > 0 then
    return {0, math.ceil(tonumber(last[2])) - now}
  end
end
redis.call('ZADD', KEYS[2], expiry, owner)
keep_expiry(KEYS[2])
return {1, epoch}
