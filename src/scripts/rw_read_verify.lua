-- Check, without changing anything, whether a reader is still in the reader set
-- and unexpired (server TIME).
-- KEYS[1]  reader set (sorted set: reader owner -> expiry in ms)
-- ARGV[1]  owner
-- returns  {1, remaining_ms} held; {0} gone (expired, released or never there)
-- errors   BADKEY KEYS[1] (a key of another type)
local rt = redis.call('TYPE', KEYS[1]).ok
if rt == 'none' then return {0} end
if rt ~= 'zset' then
  return redis.error_reply('BADKEY KEYS[1] holds a ' .. rt .. ', not a sorted set of readers')
end
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return {0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local left = math.ceil(tonumber(score)) - now
if left <= 0 then return {0} end
return {1, left}
