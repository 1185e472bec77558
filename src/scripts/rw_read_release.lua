-- Remove a reader from the reader set. Expired readers of others are pruned too,
-- and the set's own expiry is kept at its highest score; the last reader out
-- deletes the set (which wakes waiting writers).
-- KEYS[1]  reader set (sorted set: reader owner -> expiry in ms)
-- ARGV[1]  owner
-- ARGV[2]  'exact' or absent (a reader's member is its owner: there is no other
--          mode; accepted so that every member release takes the same ARGV)
-- returns  1 removed while unexpired; 0 it had expired (removed now) or was gone
-- errors   BADARG (bad ARGV), BADKEY KEYS[1] (a key of another type); nothing is
--          changed
if ARGV[1] == nil or ARGV[1] == '' then
  return redis.error_reply('BADARG owner must be non-empty')
end
if ARGV[2] ~= nil and ARGV[2] ~= 'exact' then
  return redis.error_reply("BADARG mode must be 'exact'")
end
local rt = redis.call('TYPE', KEYS[1]).ok
if rt == 'none' then return 0 end
if rt ~= 'zset' then
  return redis.error_reply('BADKEY KEYS[1] holds a ' .. rt .. ', not a sorted set of readers')
end
-- No writes above this line.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
local held = score and math.ceil(tonumber(score)) > now
local removed = score and redis.call('ZREM', KEYS[1], ARGV[1]) or 0
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
