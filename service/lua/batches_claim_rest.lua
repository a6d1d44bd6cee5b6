-- Claims every line of a batch not claimed yet, at once, as the batch ends
-- (service/gateway/batches.py, BatchStore.claim_rest).
-- KEYS[1]: the batch's hash.
-- Returns the first line claimed.
local first = tonumber(redis.call('HGET', KEYS[1], 'next'))
redis.call('HSET', KEYS[1], 'next', redis.call('HGET', KEYS[1], 'total'))
return first
