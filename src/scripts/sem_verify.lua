-- Check, without changing anything, whether a permit is still in the permit set
-- and unexpired (server TIME).
-- KEYS[1]  permit set (sorted set: owner:slot:token -> expiry in ms)
-- ARGV[1]  the permit's member, owner:slot:token
-- returns  {1, remaining_ms} held; {0} gone (expired, released or never there)
-- errors   BADKEY KEYS[1] (a key of another type)
local pt = redis.call('TYPE', KEYS[1]).ok
if pt == 'none' then return {0} end
if pt ~= 'zset' then
  return redis.error_reply('BADKEY KEYS[1] holds a ' .. pt .. ', not a sorted set of permits')
end
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return {0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local left = math.ceil(tonumber(score)) - now
if left <= 0 then return {0} end
return {1, left}
