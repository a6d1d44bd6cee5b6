-- Moves a batch to another status (service/gateway/batches.py, BatchStore.transition).
-- KEYS[1]: the batch's hash.
-- ARGV[1]: the statuses it may move from, comma-separated; ARGV[2]: the status it moves
-- to; ARGV[3..]: field/value pairs to set as it moves.
-- Returns {1 if moved, the status it had}.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {0, ''} end
for from in string.gmatch(ARGV[1], '[^,]+') do
  if from == status then
    redis.call('HSET', KEYS[1], 'status', ARGV[2], unpack(ARGV, 3))
    return {1, status}
  end
end
return {0, status}
