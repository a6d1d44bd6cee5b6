-- Takes admitted jobs in fair order (service/fair_queue/reader.py): the level whose
-- oldest job has waited longest (priority counted as a head start), batch only when no
-- interactive job is queued; within it the tenant served least, charged for the prompt.
-- Runs after fair_queue_keys.lua.
-- KEYS[1]: the request stream. ARGV: group, consumer, count, now (ms), the head start of
-- one priority step (ms), the prompt weight, the most batch jobs to take, the tenants
-- whose jobs stay queued (space-separated).
-- Returns up to `count` {queue, id, fields}.
local group, consumer, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now_ms, step_ms, prompt_weight = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local batch_left = tonumber(ARGV[7])
local excluded = {}
for tenant in string.gmatch(ARGV[8] or '', '%S+') do excluded[tenant] = true end

-- When the oldest job not yet taken from a queue was admitted (ms), or nil.
local function head_ms(queue)
  local entry = head(queue, group)
  return entry and admitted_ms(entry)
end

local taken = {}
while #taken < count do
  local queues = {}
  for _, queue in ipairs(queues_with_backlog()) do
    if not excluded[queue.tenant] then queues[#queues + 1] = queue end
  end
  if #queues == 0 then break end
  -- The level: interactive first, the one whose oldest job has waited longest.
  local level, best = nil, nil
  for _, queue in ipairs(queues) do
    if queue.level ~= 'batch' then
      local arrived = head_ms(queue.key)
      if arrived ~= nil then
        local key = arrived - (tonumber(queue.level) - priority_min) * step_ms
        if best == nil or key < best then level, best = queue.level, key end
      else
        redis.call('HSET', backlog_key, queue.key, 0)  -- nothing left to take: heal the count
      end
    end
  end
  if level == nil and batch_left <= 0 then break end
  level = level or 'batch'
  -- Within it, the tenant served least.
  local chosen, least = nil, nil
  for _, queue in ipairs(queues) do
    if queue.level == level then
      local served = counter(served_key, account(queue.level, queue.tenant))
      if least == nil or served < least then chosen, least = queue, served end
    end
  end
  if chosen == nil then break end
  local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1, 'STREAMS', chosen.key, '>')
  local entry = reply and reply[1] and reply[1][2][1]
  if not entry then
    redis.call('HSET', backlog_key, chosen.key, 0)
  else
    local tokens = tonumber(field_of(entry, tokens_field) or '0')
    local ahead = tonumber(field_of(entry, ahead_field) or '0')
    if ahead > 0 then
      -- The pace: how long a slot took to free for each job ahead of this one and its
      -- own, measured on jobs that queued behind others (one taken at once tells how
      -- fast jobs arrive, not how fast workers finish them).
      local pace = tag .. ':pace:' .. math.floor(now_ms / 1000)
      redis.call('HINCRBYFLOAT', pace, 'ms', math.max(now_ms - admitted_ms(entry), 0) / (ahead + 1))
      redis.call('HINCRBY', pace, 'jobs', 1)
      redis.call('EXPIRE', pace, 120)
    end
    redis.call('HINCRBY', backlog_key, chosen.key, -1)
    for _, field in ipairs({chosen.tenant, '*'}) do
      redis.call('HINCRBY', queued_key, field, -1)
      redis.call('HINCRBY', tokens_key, field, -tokens)
    end
    redis.call('HINCRBYFLOAT', served_key, account(chosen.level, chosen.tenant), prompt_weight * tokens)
    local bucket = tag .. ':rate:' .. chosen.tenant
    if redis.call('EXISTS', bucket) == 1 then redis.call('HINCRBYFLOAT', bucket, 'level', -tokens) end
    local drained = tag .. ':drained:' .. math.floor(now_ms / 1000)
    redis.call('HINCRBY', drained, 'jobs', 1)
    redis.call('HINCRBY', drained, 'tokens', tokens)
    redis.call('EXPIRE', drained, 120)
    if chosen.level == 'batch' then batch_left = batch_left - 1 end
    taken[#taken + 1] = {chosen.key, entry[1], entry[2]}
  end
end
-- The taken jobs fill this worker's earliest-freeing slots until it publishes again.
local outlook = tag .. ':outlook:' .. consumer
local published = #taken > 0 and redis.call('GET', outlook)
if published then
  local ends = {}
  for time_ms in string.gmatch(published, '%d+') do ends[#ends + 1] = time_ms end
  redis.call('SET', outlook, table.concat(ends, ',', math.min(#taken + 1, #ends + 1), #ends), 'KEEPTTL')
end
return taken
