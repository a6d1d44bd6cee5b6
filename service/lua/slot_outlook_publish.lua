-- Publishes when each of a worker's slots frees (service/slot_outlook.py), for the fair
-- queue's admission (fair_queue_keys.lua, slot_ends).
-- KEYS[1]: the request stream. ARGV: consumer, ttl (ms), then one offset (ms) per slot.
-- Stores the slots' ends on Redis's clock, ascending, comma-separated.
local tag = '{' .. KEYS[1] .. '}'
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local ends = {}
for i = 3, #ARGV do ends[#ends + 1] = now_ms + tonumber(ARGV[i]) end
table.sort(ends)
for i, value in ipairs(ends) do ends[i] = string.format('%d', value) end
local key = tag .. ':outlook:' .. ARGV[1]
redis.call('SET', key, table.concat(ends, ','), 'PX', ARGV[2])
redis.call('SADD', tag .. ':outlooks', key)
return 1
