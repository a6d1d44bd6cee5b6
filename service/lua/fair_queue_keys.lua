-- What the fair queue's scripts share (service/fair_queue/scripts.py puts it before each
-- of them): constants filled in from Python, the bookkeeping keys beside KEYS[1] (the
-- request stream; every key shares its hash slot, '{<stream>}:...', so each script is
-- atomic on a Redis Cluster too), and helpers over the tenant queues and the workers'
-- slot outlooks. No ARGV of its own. (A `$$` of Lua is doubled: string.Template reads it.)
local window, retry_min, retry_max, burst = $DRAIN_WINDOW_S, $RETRY_AFTER_MIN_S, $RETRY_AFTER_MAX_S, $QUOTA_BURST_S
local origin_field, tokens_field = '$ORIGIN_FIELD', '$TOKENS_FIELD'
local ahead_field, prompt_ids_field = '$AHEAD_FIELD', '$PROMPT_IDS_FIELD'
local priority_min = $PRIORITY_MIN
local tag = '{' .. KEYS[1] .. '}'
local backlog_key, served_key = tag .. ':backlog', tag .. ':served'
local queued_key, tokens_key = tag .. ':queued', tag .. ':queued_tokens'
local function counter(key, field) return tonumber(redis.call('HGET', key, field) or '0') end
local function account(level, tenant) if level == 'batch' then return 'batch:' .. tenant end return tenant end
local function admitted_ms(entry) return tonumber(string.match(entry[1], '^(%d+)')) end
local function field_of(entry, name)
  for i = 1, #entry[2], 2 do if entry[2][i] == name then return entry[2][i + 1] end end
end
-- The oldest entry of a tenant queue not yet taken by the group's workers, or nil.
local function head(queue, group)
  local last = '0-0'
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', queue)) do
    for i = 1, #info, 2 do
      if info[i] == 'name' and info[i + 1] ~= group then break end
      if info[i] == 'last-delivered-id' then last = info[i + 1] end
    end
  end
  return redis.call('XRANGE', queue, '(' .. last, '+', 'COUNT', 1)[1]
end
-- Every worker's slots (service/slot_outlook.py), when each frees on Redis's clock,
-- ascending; nil when no worker publishes them.
local function slot_ends()
  local outlooks, ends, any = tag .. ':outlooks', {}, false
  for _, key in ipairs(redis.call('SMEMBERS', outlooks)) do
    local value = redis.call('GET', key)
    if value then
      any = true
      for time_ms in string.gmatch(value, '%d+') do ends[#ends + 1] = tonumber(time_ms) end
    else
      redis.call('SREM', outlooks, key)
    end
  end
  table.sort(ends)
  return any and ends or nil
end
local function redis_now_ms()
  local clock = redis.call('TIME')
  return tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
end
local function queues_with_backlog()
  local flat, queues = redis.call('HGETALL', backlog_key), {}
  for i = 1, #flat, 2 do
    if tonumber(flat[i + 1]) > 0 then
      local level, tenant = string.match(flat[i], ':q:([^:]+):(.+)$$')
      queues[#queues + 1] = {key = flat[i], level = level, tenant = tenant}
    end
  end
  return queues
end
