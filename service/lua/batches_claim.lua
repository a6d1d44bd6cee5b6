-- Claims the next line of a batch to run, now in flight at attempt 0
-- (service/gateway/batches.py, BatchStore.claim).
-- One script, so a line is never claimed twice nor lost.
-- KEYS[1]: the batch's hash; KEYS[2]: its lines in flight (line -> attempt).
-- Returns the line, or -1 when none is left or the batch no longer runs.
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return -1 end
local line = tonumber(redis.call('HGET', KEYS[1], 'next'))
if line >= tonumber(redis.call('HGET', KEYS[1], 'total')) then return -1 end
redis.call('HSET', KEYS[1], 'next', line + 1)
redis.call('HSET', KEYS[2], line, 0)
return line
