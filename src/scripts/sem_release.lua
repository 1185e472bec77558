-- Remove a permit, with its index entry and its slot bit. With ARGV[2] =
-- 'prefix', ARGV[1] is the owner alone and that owner's permit is removed (after
-- an acquire whose reply was lost, when the slot and token are unknown).
-- Expired permits of others are pruned too; the last permit out deletes the set
-- and the bitmap (which wakes waiters).
-- KEYS[1]  permit set (sorted set: owner:slot:token -> expiry in ms)
-- KEYS[2]  meta hash {capacity, fence, holder:<owner>}
-- KEYS[3]  slot bitmap
-- ARGV[1]  the permit's member owner:slot:token, or with 'prefix' the owner
-- ARGV[2]  'exact' or 'prefix'
-- returns  1 removed while unexpired; 0 it had expired (removed now) or was gone
-- errors   BADARG (bad ARGV), BADKEY KEYS[n] (a key of another type); nothing is
--          changed
local arg, mode = ARGV[1], ARGV[2]
if mode ~= 'exact' and mode ~= 'prefix' then
  return redis.error_reply("BADARG mode must be 'exact' or 'prefix'")
end
if arg == nil or arg == '' or (mode == 'prefix' and string.find(arg, ':', 1, true)) then
  return redis.error_reply('BADARG the permit (or owner, with prefix) must be non-empty')
end
local kinds = {'zset', 'hash', 'string'}
local what = {'a sorted set of permits', 'a semaphore hash', 'a slot bitmap'}
local types = {}
for i = 1, 3 do
  types[i] = redis.call('TYPE', KEYS[i]).ok
  if types[i] ~= 'none' and types[i] ~= kinds[i] then
    return redis.error_reply('BADKEY KEYS[' .. i .. '] holds a ' .. types[i] .. ', not ' .. what[i])
  end
end
if types[1] == 'none' then return 0 end
-- No writes above this line.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function forget(member)
  redis.call('ZREM', KEYS[1], member)
  local who, slot, token = string.match(member, '^([^:]*):(%d+):(%d+)$')
  if who then
    if redis.call('HGET', KEYS[2], 'holder:' .. who) == slot .. ':' .. token then
      redis.call('HDEL', KEYS[2], 'holder:' .. who)
    end
    redis.call('SETBIT', KEYS[3], slot, 0)
  end
end
local member = arg
if mode == 'prefix' then
  local mine = redis.call('HGET', KEYS[2], 'holder:' .. arg)
  member = mine and arg .. ':' .. mine
end
local held = false
local score = member and redis.call('ZSCORE', KEYS[1], member)
if score then
  held = math.ceil(tonumber(score)) > now
  forget(member)
end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now))) do
  forget(m)
end
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('DEL', KEYS[3]) end
if held then return 1 end
return 0
