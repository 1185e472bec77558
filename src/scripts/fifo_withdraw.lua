-- Take a waiter out of a lock's queue (Fairness::Fifo), when its wait ended
-- without the lock. The next waiter then heads the queue; the change of the
-- order set wakes the waiters tracking it.
-- KEYS[1]  queue order (sorted set: owner -> arrival number)
-- KEYS[2]  queue entry expiries (sorted set: owner -> expiry in ms)
-- ARGV[1]  owner
-- returns  1 removed (an entry whose expiry passed is still there, and
--          removed, until the next acquire prunes it); 0 it was not queued
--          (never joined, or pruned)
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return removed
