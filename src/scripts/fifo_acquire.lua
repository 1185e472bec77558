-- Take a lock in the order its waiters queued (Fairness::Fifo): the lock is
-- set only when it is free and the caller heads the queue, or the queue is
-- empty. A busy caller that asks to queue (ARGV[3] > 0) joins the tail, or
-- keeps its place, and its entry's expiry is moved to ARGV[3] ms from now:
-- a waiter that stops refreshing (it crashed, or gave up without a word)
-- drops out of the queue by itself once its entry expires. Dead entries are
-- pruned first, by the server's clock (TIME); a head whose expiry entry is
-- missing (the expiry set was lost) is given one entry lifetime.
-- The order set is written only when a waiter joins or leaves (and its key
-- expiry is moved at most once per entry lifetime), so waiters that refresh
-- do not wake each other; every key whose change could free a busy caller
-- (the lock, the order) is read after the script's last write to it, which
-- arms client tracking for waiters.
-- Idempotent for one owner: if the lock already holds ARGV[1] (an earlier
-- attempt whose reply was lost), that grant is returned again, unchanged.
-- KEYS[1]  the lock (string owner, PX)
-- KEYS[2]  queue order (sorted set: owner -> arrival number)
-- KEYS[3]  queue entry expiries (sorted set: owner -> expiry in ms)
-- ARGV[1]  owner (non-empty)
-- ARGV[2]  ttl in milliseconds (positive integer)
-- ARGV[3]  queue entry lifetime in milliseconds (0: one attempt, do not queue)
-- returns  {1} granted; {0, wait_ms, place} busy: wait_ms until the first
--          thing ahead that can free it by itself does (the holder's PTTL,
--          the head entry's expiry), -1 if none; place the caller's 1-based
--          place in the queue, 0 if not queued
-- errors   BADARG (bad ARGV), BADKEY KEYS[n] (a key of another type); nothing
--          is changed
local owner = ARGV[1]
if owner == nil or owner == '' then
  return redis.error_reply('BADARG owner must be non-empty')
end
local ttl = ARGV[2] and string.match(ARGV[2], '^[1-9]%d*$') and string.len(ARGV[2]) <= 13
  and tonumber(ARGV[2])
if not ttl then
  return redis.error_reply('BADARG ttl must be a positive integer of milliseconds')
end
local entry = ARGV[3] and string.match(ARGV[3], '^%d+$') and string.len(ARGV[3]) <= 13
  and tonumber(ARGV[3])
if not entry then
  return redis.error_reply('BADARG entry lifetime must be a non-negative integer of milliseconds')
end

local function want(i, kind, what)
  local t = redis.call('TYPE', KEYS[i]).ok
  if t ~= 'none' and t ~= kind then
    return redis.error_reply('BADKEY KEYS[' .. i .. '] holds a ' .. t .. ', not ' .. what)
  end
end
local err = want(1, 'string', 'a lock')
  or want(2, 'zset', 'a sorted set of waiters')
  or want(3, 'zset', 'a sorted set of waiter expiries')
if err then return err end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Waiters whose entries expired are gone.
local dead = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, w in ipairs(dead) do
  redis.call('ZREM', KEYS[2], w)
end
if #dead > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
end

-- A head with no expiry entry (the expiry set was evicted or deleted by
-- hand) would block the queue for good if it crashed: it is given one entry
-- lifetime from now, which a live head refreshes on its next attempt. Only
-- a caller that queues knows the lifetime.
if entry > 0 then
  local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if head and head ~= owner and not redis.call('ZSCORE', KEYS[3], head) then
    redis.call('ZADD', KEYS[3], now + entry, head)
    if redis.call('PTTL', KEYS[3]) < entry then
      redis.call('PEXPIRE', KEYS[3], 2 * entry)
    end
  end
end

local held = redis.call('GET', KEYS[1])
if held == owner then
  return {1}
end
if not held then
  local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if head == nil or head == owner then
    redis.call('SET', KEYS[1], owner, 'PX', ttl)
    if head == owner then
      redis.call('ZREM', KEYS[2], owner)
      redis.call('ZREM', KEYS[3], owner)
    end
    return {1}
  end
end

if entry > 0 then
  if not redis.call('ZSCORE', KEYS[2], owner) then
    local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')[2]
    redis.call('ZADD', KEYS[2], (last and tonumber(last) or 0) + 1, owner)
  end
  redis.call('ZADD', KEYS[3], now + entry, owner)
  -- Both sets outlive every live entry: their key expiry is moved to two
  -- entry lifetimes from now whenever less than one is left.
  for i = 2, 3 do
    if redis.call('PTTL', KEYS[i]) < entry then
      redis.call('PEXPIRE', KEYS[i], 2 * entry)
    end
  end
end

local wait = redis.call('PTTL', KEYS[1])
if wait < 0 then wait = -1 end
local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
if head and head ~= owner then
  local expiry = redis.call('ZSCORE', KEYS[3], head)
  if expiry then
    local left = math.max(0, tonumber(expiry) - now)
    if wait < 0 or left < wait then wait = left end
  end
end
local place = redis.call('ZRANK', KEYS[2], owner)
return {0, wait, place and place + 1 or 0}
