-- Keeps a batch's lease while it is ours (service/gateway/batches.py, BatchStore.renew).
-- KEYS[1]: the lease key. ARGV[1]: the owner; ARGV[2]: the lease, milliseconds.
-- Returns 1 when renewed, 0 when the lease is another's (or gone).
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
