-- Remove a permit. With ARGV[2] = 'prefix', ARGV[1] is the owner alone and every
-- permit of that owner is removed (after an acquire whose reply was lost, when
-- the slot and token are unknown). Expired permits of others are pruned too, and
-- the set's own expiry is kept at its highest score; the last permit out deletes
-- the set (which wakes waiters).
-- KEYS[1]  permit set (sorted set: owner:slot:token -> expiry in ms)
-- ARGV[1]  the permit's member owner:slot:token, or with 'prefix' the owner
-- ARGV[2]  'exact' or 'prefix'
-- returns  1 removed while unexpired; 0 it had expired (removed now) or was gone
-- errors   BADARG (bad ARGV), BADKEY KEYS[1] (a key of another type); nothing is
--          changed
local arg, mode = ARGV[1], ARGV[2]
if mode ~= 'exact' and mode ~= 'prefix' then
  return redis.error_reply("BADARG mode must be 'exact' or 'prefix'")
end
if arg == nil or arg == '' or (mode == 'prefix' and string.find(arg, ':', 1, true)) then
  return redis.error_reply('BADARG the permit (or owner, with prefix) must be non-empty')
end
local pt = redis.call('TYPE', KEYS[1]).ok
if pt == 'none' then return 0 end
if pt ~= 'zset' then
  return redis.error_reply('BADKEY KEYS[1] holds a ' .. pt .. ', not a sorted set of permits')
end
-- No writes above this line.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local targets = {}
if mode == 'exact' then
  local score = redis.call('ZSCORE', KEYS[1], arg)
  if score then targets[1] = {arg, score} end
else
  local all = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  local mine = arg .. ':'
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, string.len(mine)) == mine then
      targets[#targets + 1] = {all[i], all[i + 1]}
    end
  end
end
local held = false
local removed = 0
for _, m in ipairs(targets) do
  if math.ceil(tonumber(m[2])) > now then held = true end
  removed = removed + redis.call('ZREM', KEYS[1], m[1])
end
local pruned = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now))
if removed + pruned > 0 then
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
