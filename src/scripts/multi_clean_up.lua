-- Delete what an acquire of several leases whose reply was lost may have set:
-- every lease that holds this owner's value (plain) or owner:token (fenced).
-- Leases held by anyone else are left alone.
-- KEYS[1..n]  lease keys (one cluster slot)
-- ARGV[1]     owner value
-- returns     how many leases were deleted
local n = 0
for i = 1, #KEYS do
  local v = redis.pcall('GET', KEYS[i])
  if v and type(v) ~= 'table'
    and (v == ARGV[1] or string.sub(v, 1, string.len(ARGV[1]) + 1) == ARGV[1] .. ':') then
    redis.call('DEL', KEYS[i])
    n = n + 1
  end
end
return n
