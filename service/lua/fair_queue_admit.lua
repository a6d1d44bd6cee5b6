-- Admission (service/fair_queue/admission.py): checks a new request-stream entry
-- against the caps, the wait cap and the tenant's quota, and either refuses it or moves
-- it into its tenant's queue at its level. Runs after fair_queue_keys.lua.
-- KEYS[1]: the request stream. ARGV: group, entry id, tenant, level, prompt tokens, now
-- (ms), max queued jobs, max queued tokens, the tenant's max queued jobs and tokens, its
-- tokens per second, the max queue wait (s) (0: no cap), the prompt's token ids (msgpack;
-- empty: not tokenized). Returns {'admitted'}, {'gone'}
-- (another worker admitted it, or it was deleted) or {code, retry_after_s, message}.
local group, entry_id, tenant, level = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local tokens, now_ms = tonumber(ARGV[5]), tonumber(ARGV[6])
local max_jobs, max_tokens = tonumber(ARGV[7]), tonumber(ARGV[8])
local tenant_max_jobs, tenant_max_tokens, rate = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local max_wait_s = tonumber(ARGV[12])
local prompt_ids = ARGV[13]
if #redis.call('XPENDING', KEYS[1], group, entry_id, entry_id, 1) == 0 then return {'gone'} end
local entry = redis.call('XRANGE', KEYS[1], entry_id, entry_id)[1]
if not entry then return {'gone'} end

local function drain(field)
  local now_s, total = math.floor(now_ms / 1000), 0
  for s = now_s - window + 1, now_s do total = total + counter(tag .. ':drained:' .. s, field) end
  return total / window
end
local function full(what, queued, cap, field, amount)
  local rate_now = drain(field)
  local wait = retry_max
  if rate_now > 0 then wait = math.min(retry_max, math.max(retry_min, (queued + amount - cap) / rate_now)) end
  return {'queue_full', tostring(wait), what .. ' queued: ' .. queued .. ' of at most ' .. cap}
end
if max_jobs > 0 and counter(queued_key, '*') + 1 > max_jobs then
  return full('jobs', counter(queued_key, '*'), max_jobs, 'jobs', 1)
end
if max_tokens > 0 and counter(tokens_key, '*') + tokens > max_tokens then
  return full('prompt tokens', counter(tokens_key, '*'), max_tokens, 'tokens', tokens)
end
local queues, ahead = queues_with_backlog(), 0  -- and the interactive jobs queued
for _, queue in ipairs(queues) do
  if queue.level ~= 'batch' then ahead = ahead + counter(backlog_key, queue.key) end
end
local ends = max_wait_s > 0 and level ~= 'batch' and slot_ends()
local expected_s = nil
if ends and #ends > ahead then
  -- The workers publish when each slot frees: the jobs ahead take the first ones, this
  -- job the next.
  expected_s = math.max(0, ends[ahead + 1] - redis_now_ms()) / 1000
elseif max_wait_s > 0 and level ~= 'batch' and (ahead > 0 or ends) then
  -- Without them (or with more jobs queued than slots): a slot for each job ahead and
  -- its own, each as long as one took lately (the pace, measured as jobs are taken:
  -- TAKE), and at least as long as the oldest queued job has waited for each of its own
  -- so far.
  local now_s, pace_ms, paced = math.floor(now_ms / 1000), 0, 0
  for s = now_s - window + 1, now_s do
    pace_ms = pace_ms + counter(tag .. ':pace:' .. s, 'ms')
    paced = paced + counter(tag .. ':pace:' .. s, 'jobs')
  end
  local pace = paced > 0 and pace_ms / paced or 0
  for _, queue in ipairs(queues) do
    local oldest = queue.level ~= 'batch' and head(queue.key, group)
    if oldest then
      pace = math.max(pace, (now_ms - admitted_ms(oldest)) / (tonumber(field_of(oldest, ahead_field) or '0') + 1))
    end
  end
  expected_s = (ahead + 1) * pace / 1000
  if ends and #ends > 0 then expected_s = math.max(expected_s, (ends[#ends] - redis_now_ms()) / 1000) end
end
if expected_s and expected_s > max_wait_s then
  local why = string.format('a wait of %.1f s for a slot, with %d jobs queued ahead', expected_s, ahead)
  return {'queue_full', tostring(math.min(retry_max, math.max(retry_min, expected_s - max_wait_s))),
          why .. string.format(', over at most %g s', max_wait_s)}
end
if tenant_max_jobs > 0 and counter(queued_key, tenant) + 1 > tenant_max_jobs then
  return full('tenant ' .. tenant .. ' jobs', counter(queued_key, tenant), tenant_max_jobs, 'jobs', 1)
end
if tenant_max_tokens > 0 and counter(tokens_key, tenant) + tokens > tenant_max_tokens then
  return full('tenant ' .. tenant .. ' prompt tokens', counter(tokens_key, tenant), tenant_max_tokens, 'tokens', tokens)
end
if rate > 0 then
  local bucket = tag .. ':rate:' .. tenant
  local level_now = counter(bucket, 'level')
  local at = tonumber(redis.call('HGET', bucket, 'at') or tostring(now_ms))
  level_now = math.min(rate * burst, level_now + rate * (now_ms - at) / 1000)
  if redis.call('EXISTS', bucket) == 0 then level_now = rate * burst end
  redis.call('HSET', bucket, 'level', tostring(level_now), 'at', tostring(now_ms))
  if level_now <= 0 then
    return {'quota_exceeded', tostring(math.max(retry_min, -level_now / rate)),
            'tenant ' .. tenant .. ' was served more than its ' .. rate .. ' tokens per second'}
  end
end

-- Admitted. A tenant whose queues of this class were empty is lifted to the least
-- counter among the tenants with queued jobs of the class: idle time earns no credit.
local batch_class = level == 'batch'
local was_idle, least = true, nil
for _, queue in ipairs(queues) do
  if (queue.level == 'batch') == batch_class then
    if queue.tenant == tenant then was_idle = false end
    local served = counter(served_key, account(queue.level, queue.tenant))
    if least == nil or served < least then least = served end
  end
end
local mine = account(level, tenant)
if was_idle and least ~= nil and counter(served_key, mine) < least then
  redis.call('HSET', served_key, mine, tostring(least))
end

local queue = tag .. ':q:' .. level .. ':' .. tenant
if redis.call('EXISTS', queue) == 0 then
  redis.pcall('XGROUP', 'CREATE', queue, group, '0', 'MKSTREAM')
  redis.call('SADD', tag .. ':queues', queue)
end
local fields = entry[2]
table.insert(fields, origin_field); table.insert(fields, entry_id)
table.insert(fields, tokens_field); table.insert(fields, tostring(tokens))
table.insert(fields, ahead_field); table.insert(fields, tostring(level == 'batch' and 0 or ahead))
if prompt_ids ~= '' then table.insert(fields, prompt_ids_field); table.insert(fields, prompt_ids) end
redis.call('XADD', queue, '*', unpack(fields))
redis.call('XACK', KEYS[1], group, entry_id)
redis.call('XDEL', KEYS[1], entry_id)
redis.call('HINCRBY', backlog_key, queue, 1)
for _, field in ipairs({tenant, '*'}) do
  redis.call('HINCRBY', queued_key, field, 1)
  redis.call('HINCRBY', tokens_key, field, tokens)
end
redis.call('LPUSH', tag .. ':ready', 1)
redis.call('LTRIM', tag .. ':ready', 0, 999)
return {'admitted'}
