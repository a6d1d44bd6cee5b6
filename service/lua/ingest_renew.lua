-- Renews a worker's leases (service/ingest.py, LeasedReader.renew): resets the idle time
-- of the entries this consumer still owns; returns the ids it no longer owns (taken over
-- by another worker, or deleted). One round trip for them all.
-- KEYS[1]: a stream. ARGV: group, consumer, then the entry ids.
local lost = {}
for i = 3, #ARGV do
  local row = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)[1]
  if row and row[2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
