-- Gives a batch's lease back, if it is ours
-- (service/gateway/batches.py, BatchStore.release).
-- KEYS[1]: the lease key. ARGV[1]: the owner.
-- Returns 1 when released, 0 when the lease is another's (or gone).
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
