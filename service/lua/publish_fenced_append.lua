-- Writes the events of many reply streams, each fenced by its owner key
-- (service/publish.py, `ReplyPublisher.append`).
-- KEYS: each stream's reply stream and owner key, in pairs.
-- ARGV[1]: msgpack, one entry per stream: {owner value, TTL seconds (0: leave the TTLs),
-- token events as their msgpack `data`, the final event's entry id or "", its field/value
-- pairs, the number of token events written before these, the owner key's TTL}.
-- Each token is written with its readable fields at entry id <seq + 1>-0. Returns per
-- stream: 1 when written (entries already there count as written), 0 when this worker is
-- not the owner, -1 - k when the stream holds only k token events though more were
-- written before (a failover lost them: nothing is written, the writer sends them again),
-- or the error Redis gave for that stream. An owner key that is gone (lost with the
-- writes) is set again. Many streams in one call, each token one msgpack string: packing
-- commands and arguments is most of a publisher's cost.
local function failed(added)
  if type(added) == 'table' and added['err'] and not string.find(added['err'], 'equal or smaller', 1, true) then
    return added['err']
  end
end
local streams = cmsgpack.unpack(ARGV[1])
local results = {}
for s = 1, #streams do
  local stream, owner, spec = KEYS[2 * s - 1], KEYS[2 * s], streams[s]
  local result = 1
  local held, have = redis.call('GET', owner), spec[6]
  if spec[6] > 0 then  -- written before: check that it is all still there
    -- A running job's stream holds its token events at ids 1-0 .. k-0 and nothing else,
    -- and a failover loses a suffix of them, so its length is the k it holds.
    local length = redis.pcall('XLEN', stream)
    if type(length) == 'number' then  -- (not a stream: the XADD below says so)
      have = length
    end
    if held == false then  -- the owner key went with the lost writes
      redis.call('SET', owner, spec[1], 'EX', spec[7])
      held = spec[1]
    end
  end
  if held ~= spec[1] then
    result = 0
  elseif have < spec[6] then
    result = -1 - have
  else
    for _, data in ipairs(spec[3]) do
      local token = cmsgpack.unpack(data)
      local id, seq = string.format('%d-0', token['seq'] + 1), string.format('%d', token['seq'])
      local ids = table.concat(token['token_ids'], ' ')
      local added
      if token['index'] then  -- a choice of a request with n > 1
        added = redis.pcall('XADD', stream, id, 'type', 'token', 'seq', seq,
          'index', string.format('%d', token['index']),
          'text', token['text'], 'token_ids', ids, 'data', data)
      else
        added = redis.pcall('XADD', stream, id, 'type', 'token', 'seq', seq, 'text', token['text'],
          'token_ids', ids, 'data', data)
      end
      local error = failed(added)
      if error then result = error; break end
    end
    if result == 1 and spec[4] ~= '' then
      local error = failed(redis.pcall('XADD', stream, spec[4], unpack(spec[5])))
      if error then result = error end
    end
    if result == 1 and spec[2] ~= 0 then
      redis.call('EXPIRE', stream, spec[2])
      redis.call('EXPIRE', owner, spec[2])
    end
  end
  results[s] = result
end
return results
