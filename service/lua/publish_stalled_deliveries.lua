-- Counts a job's deliveries in a row that ended with no new token on its reply stream
-- (service/publish.py, `ReplyPublisher.stalled_deliveries`: the poison-job guard).
-- KEYS[1]: the reply stream's progress key.
-- ARGV[1]: token events on the stream now; ARGV[2]: the job entry's deliveries (this one
-- included); ARGV[3]: TTL seconds.
-- Returns how many deliveries in a row ended with no new token on the stream. Recorded at
-- takeovers only (a first delivery writes nothing): without a record, the first delivery
-- made progress if the stream holds a token.
local events, deliveries = tonumber(ARGV[1]), tonumber(ARGV[2])
local last = redis.call('HGET', KEYS[1], 'events')
local stalls = 0
if last == false then
  if events == 0 then stalls = deliveries - 1 end
elseif events <= tonumber(last) then
  stalls = tonumber(redis.call('HGET', KEYS[1], 'stalls')) + 1
end
redis.call('HSET', KEYS[1], 'events', events, 'stalls', stalls)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return stalls
