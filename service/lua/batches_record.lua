-- Records results of a batch's lines (service/gateway/batches.py, BatchStore.record).
-- The first result of a line stands and is counted; a later one (a driver that lost its
-- lease, or a successor) changes nothing. Nothing is recorded once the batch is past
-- running, so its files and counts stay as finalized.
-- KEYS[1]: the batch's hash; KEYS[2]: its results (line -> record); KEYS[3]: its lines
-- in flight.
-- ARGV: line/record pairs (a record starts `o` for the output file, `e` for the error
-- file).
-- Returns how many results were new.
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'in_progress' and status ~= 'cancelling' then return 0 end
local added = 0
for i = 1, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1]) == 1 then
    added = added + 1
    redis.call('HINCRBY', KEYS[1], string.sub(ARGV[i + 1], 1, 1) == 'o' and 'completed' or 'failed', 1)
  end
  redis.call('HDEL', KEYS[3], ARGV[i])
end
return added
