-- Charges tenants for the output tokens they were served (service/fair_queue/charges.py):
-- to their fair-share counters, and to their tokens-per-second buckets.
-- Runs after fair_queue_keys.lua.
-- KEYS[1]: the request stream. ARGV: pairs of (account, weighted tokens), then the
-- tenants' raw tokens as pairs of (tenant, tokens) after a '--', and now (ms) first.
local now_ms, i = tonumber(ARGV[1]), 2
while ARGV[i] ~= '--' do
  redis.call('HINCRBYFLOAT', served_key, ARGV[i], ARGV[i + 1])
  i = i + 2
end
i = i + 1
while i <= #ARGV do
  local bucket = tag .. ':rate:' .. ARGV[i]
  if redis.call('EXISTS', bucket) == 1 then
    redis.call('HINCRBYFLOAT', bucket, 'level', -tonumber(ARGV[i + 1]))
  end
  i = i + 2
end
return 1
