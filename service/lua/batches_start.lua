-- Starts a batch whose validation passed, its requests in place
-- (service/gateway/batches.py, BatchStore.start).
-- Counts start, and the batch runs, unless it was cancelled meanwhile (then it winds
-- down, every line cancelled).
-- KEYS[1]: the batch's hash.
-- ARGV[1]: its number of requests; ARGV[2]: the time now, unix seconds.
-- Returns the batch's status.
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'validating' and status ~= 'cancelling' then return status end
redis.call('HSET', KEYS[1], 'validated', 1, 'total', ARGV[1], 'next', 0, 'completed', 0, 'failed', 0)
if status == 'validating' then
  redis.call('HSET', KEYS[1], 'status', 'in_progress', 'in_progress_at', ARGV[2])
end
return redis.call('HGET', KEYS[1], 'status')
