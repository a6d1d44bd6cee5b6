-- Sends a line in flight again as a new attempt, after a refusal for load
-- (service/gateway/batches.py, BatchStore.retry).
-- KEYS[1]: the batch's hash; KEYS[2]: its lines in flight (line -> attempt).
-- ARGV[1]: the line; ARGV[2]: the attempt. Returns nothing.
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]) end
