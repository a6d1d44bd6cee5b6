-- Whether jobs that arrived lately still wait for admission (service/fair_queue/reader.py
-- waits for them before a take, so the fair order covers a whole burst).
-- KEYS[1]: the request stream. ARGV: a span (ms), a mark (an entry id, or '' at first).
-- Returns the mark to wait for: at first the newest entry that arrived within the span
-- and is still there, not yet admitted; then the same mark while any entry up to it that
-- arrived within the span is still there; '' when there is none. Redis's clock, as the
-- entry ids': older entries (a dead worker's, before their lease runs out) hold nothing.
local span, mark = tonumber(ARGV[1]), ARGV[2]
local now = redis.call('TIME')
local since = (tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) - span) .. '-0'
if mark == '' then
  local newest = redis.call('XREVRANGE', KEYS[1], '+', since, 'COUNT', 1)[1]
  if newest then return newest[1] end
  return ''
end
if redis.call('XRANGE', KEYS[1], since, mark, 'COUNT', 1)[1] then return mark end
return ''
