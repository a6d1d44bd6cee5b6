-- Claims a reply stream for one job (service/publish.py, `ReplyPublisher.claim`).
-- KEYS[1]: the reply stream; KEYS[2]: its owner key.
-- ARGV[1]: the job's entry id; ARGV[2]: the owner value; ARGV[3]: TTL seconds.
-- Returns {1, entries already there} when the stream is this job's, {0} when not.
local held = redis.call('GET', KEYS[2])
if held then
  if string.sub(held, 1, string.len(ARGV[1]) + 1) ~= ARGV[1] .. ' ' then return {0} end
elseif redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('TYPE', KEYS[1])['ok'] ~= 'stream' then
    return redis.error_reply('WRONGTYPE reply_to holds a value that is not a stream')
  end
  return {0}
end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
if not held then return {1, {}} end
return {1, redis.call('XRANGE', KEYS[1], '-', '+')}
