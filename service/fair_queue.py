"""Fair queueing across workers: admission, tenant queues and fair share, in Redis
(docs/protocol.md, "Tenants, batch jobs and admission"; issue 38).

Producers add jobs to the request stream as always. Every worker admits what arrives
there (`Admission`): one script checks the caps and quotas and either refuses the job or
moves it into its tenant's queue at its level (a priority, or `batch`). Workers take
jobs from those queues (`FairQueueReader`, a drop-in for `JobReader`): the level whose
oldest job has waited longest (priority counted as a head start), within it the tenant
served least, batch jobs only when no interactive job is queued. Tenants are charged for
what they are served (`Charges`), so every worker orders by the same account (VTC).

Each tenant queue is a stream with the same consumer group, leases and takeovers as the
request stream; a job keeps its request entry id (its *origin*) for everything a producer
sees, so the worker names it by that id, and this reader translates. Every key shares
the request stream's hash slot (`{<requests stream>}:...`), so each script is atomic,
on a Redis Cluster too.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass

import structlog
from redis.exceptions import ResponseError

from service.config import FairQueueConfig, RedisConfig
from service.ingest import Entry, JobReader, LeasedReader, dead_letter_record
from service.protocol import Job
from workers.api import PRIORITY_MIN

log = structlog.get_logger("inflight.fair_queue")

ORIGIN_FIELD = b"inflight:origin"  # the request entry's id, on a tenant queue's entry
TOKENS_FIELD = b"inflight:tokens"  # its prompt tokens, as admission counted them
AHEAD_FIELD = b"inflight:ahead"  # the interactive jobs queued when it was admitted
BATCH_LEVEL = "batch"
# A refusal's retry_after_s for queue_full: the excess over the drain rate, within these.
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1.0, 60.0
DRAIN_WINDOW_S = 30
# A tenant's bucket holds this many seconds of its tokens-per-second quota.
QUOTA_BURST_S = 10

# Shared by the scripts: the constants above, and the bookkeeping keys from the request
# stream's name.
_PRELUDE_LUA = f"""
local window, retry_min, retry_max, burst = {DRAIN_WINDOW_S}, {RETRY_AFTER_MIN_S}, {RETRY_AFTER_MAX_S}, {QUOTA_BURST_S}
local origin_field, tokens_field = '{ORIGIN_FIELD.decode()}', '{TOKENS_FIELD.decode()}'
local ahead_field = '{AHEAD_FIELD.decode()}'
local priority_min = {PRIORITY_MIN}
"""
_KEYS_LUA = (
    _PRELUDE_LUA
    + """
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
      local level, tenant = string.match(flat[i], ':q:([^:]+):(.+)$')
      queues[#queues + 1] = {key = flat[i], level = level, tenant = tenant}
    end
  end
  return queues
end
"""
)

# KEYS[1]: the request stream. ARGV: group, entry id, tenant, level, prompt tokens, now
# (ms), max queued jobs, max queued tokens, the tenant's max queued jobs and tokens, its
# tokens per second, the max queue wait (s) (0: no cap). Returns {'admitted'}, {'gone'}
# (another worker admitted it, or it was deleted) or {code, retry_after_s, message}.
ADMIT = (
    _KEYS_LUA
    + """
local group, entry_id, tenant, level = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local tokens, now_ms = tonumber(ARGV[5]), tonumber(ARGV[6])
local max_jobs, max_tokens = tonumber(ARGV[7]), tonumber(ARGV[8])
local tenant_max_jobs, tenant_max_tokens, rate = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local max_wait_s = tonumber(ARGV[12])
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
"""
)

# KEYS[1]: the request stream. ARGV: group, consumer, count, now (ms), the head start of
# one priority step (ms), the prompt weight, the most batch jobs to take.
# Returns up to `count` {queue, id, fields}.
TAKE = (
    _KEYS_LUA
    + """
local group, consumer, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now_ms, step_ms, prompt_weight = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local batch_left = tonumber(ARGV[7])

-- When the oldest job not yet taken from a queue was admitted (ms), or nil.
local function head_ms(queue)
  local entry = head(queue, group)
  return entry and admitted_ms(entry)
end

local taken = {}
while #taken < count do
  local queues = queues_with_backlog()
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
"""
)

# KEYS[1]: the request stream. ARGV: a span (ms), a mark (an entry id, or '' at first).
# Returns the mark to wait for: at first the newest entry that arrived within the span
# and is still there, not yet admitted; then the same mark while any entry up to it that
# arrived within the span is still there; '' when there is none. Redis's clock, as the
# entry ids': older entries (a dead worker's, before their lease runs out) hold nothing.
ADMITTING = """
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
"""
ADMITTING_POLL_S = 0.01

# KEYS[1]: the request stream. ARGV: pairs of (account, weighted tokens), then the
# tenants' raw tokens as pairs of (tenant, tokens) after a '--', and now (ms) first.
CHARGE = (
    _KEYS_LUA
    + """
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
"""
)


@dataclass(frozen=True)
class CountKeys:
    """Where the fair queue keeps its counts beside a request stream (the names `_KEYS_LUA`
    builds): jobs and prompt tokens queued, by tenant ('*': all of them), and each tenant
    queue's backlog, by queue key (a batch queue's starts with `batch_queues`)."""

    queued: str
    queued_tokens: str
    backlog: str
    batch_queues: str

    @staticmethod
    def of(stream: str) -> CountKeys:
        tag = "{" + stream + "}"
        return CountKeys(f"{tag}:queued", f"{tag}:queued_tokens", f"{tag}:backlog", f"{tag}:q:{BATCH_LEVEL}:")


def level_of(job: Job) -> str:
    return BATCH_LEVEL if job.batch else str(job.priority)


def account_of(job: Job) -> str:
    """The counter a job is charged to: batch jobs share a tenant's second counter."""
    return f"batch:{job.tenant}" if job.batch else job.tenant


@dataclass(frozen=True)
class Refusal:
    code: str  # queue_full or quota_exceeded
    retry_after_s: float
    message: str


class FairQueueReader(LeasedReader):
    """Takes admitted jobs from the tenant queues, in fair order; the worker's reader.

    Same calls as `JobReader`, by the job's request entry id (an `Entry`'s `entry_id` is
    the origin); it remembers which tenant queue entry each one is.
    """

    def __init__(self, redis, config: RedisConfig, fair: FairQueueConfig, priority_step_s: float) -> None:
        super().__init__(redis, config)
        self.config = config
        self.fair = fair
        self._priority_step_ms = priority_step_s * 1000
        self._tag = "{" + self.stream + "}"
        self._take = redis.register_script(TAKE)
        self._admitting = redis.register_script(ADMITTING)
        self._where: dict[str, tuple[str, str]] = {}  # origin -> (tenant queue, its entry id)

    async def ensure_group(self) -> None:
        await JobReader(self.redis, self.config).ensure_group()

    async def read(
        self, count: int, block_ms: int, held: Collection[str] = (), max_batch: int | None = None
    ) -> list[Entry]:
        """As `JobReader.read`, taking `max_batch` batch jobs at most (default: `count`); 0
        leaves them queued (a worker full of batch jobs still takes interactive ones: its
        engine preempts the batch jobs)."""
        if count <= 0:
            return []
        if not self._own_pending_done:
            self._own_pending_done = True
            entries = await self._own_pending(held)
            if entries:
                return entries[:count]
        if (claimed := await self.takeovers(count, held)) or (taken := await self._taken(count, max_batch)):
            return claimed or taken
        block_ms = await self.lease_wait_ms(block_ms)
        await self.redis.blpop([f"{self._tag}:ready"], timeout=block_ms / 1000)
        return await self._taken(count, max_batch)

    async def _leased_streams(self) -> list[str]:
        return await self._queues()  # the tenant queues: their entries are the leased ones

    async def _own_pending(self, held: Collection[str]) -> list[Entry]:
        """After a restart: the entries this consumer was given and never finished."""
        entries = []
        for queue in await self._queues():
            reply = await self.redis.xreadgroup(self.group, self.consumer, {queue: "0"})
            for _, rows in reply or []:
                entries += await self._entries(queue, [row for row in rows if row[1]], held, delivered=True)
        return entries

    async def takeovers(self, count: int, held: Collection[str] = ()) -> list[Entry]:
        """Entries whose lease ran out (their worker died or hangs), from every queue."""
        if not self._taking_over():
            return []
        entries: list[Entry] = []
        for queue in await self._queues():
            try:
                _, claimed, _ = await self.redis.xautoclaim(
                    queue, self.group, self.consumer, self.claim_idle_ms, start_id="0-0", count=count
                )
            except ResponseError as error:
                if "NOGROUP" not in str(error):
                    raise
                continue
            entries += await self._entries(queue, [row for row in claimed if row[1]], held, delivered=True)
            if len(entries) >= count:
                break
        return entries

    async def _taken(self, count: int, max_batch: int | None = None) -> list[Entry]:
        await self._await_admission()
        rows = await self._take(
            keys=[self.stream],
            args=[
                self.group,
                self.consumer,
                count,
                int(time.time() * 1000),
                self._priority_step_ms,
                self.fair.charge_prompt_weight,
                count if max_batch is None else max_batch,
            ],
        )
        entries = []
        for queue, entry_id, flat in rows:
            fields = dict(zip(flat[::2], flat[1::2]))
            entries += await self._entries(_text(queue), [(entry_id, fields)], (), delivered=False)
        return entries

    async def _await_admission(self) -> None:
        """Wait, up to `admission_wait_ms`, until the jobs that had arrived when the take
        began are admitted: the fair order then covers a whole burst, not the part of it
        admitted first. Arrivals after that do not prolong the wait."""
        wait_ms = self.fair.admission_wait_ms
        deadline = time.monotonic() + wait_ms / 1000
        mark = ""
        while time.monotonic() < deadline:
            mark = _text(await self._admitting(keys=[self.stream], args=[wait_ms, mark]))
            if not mark:
                return
            await asyncio.sleep(ADMITTING_POLL_S)

    async def _entries(self, queue: str, rows: list, held: Collection[str], delivered: bool) -> list[Entry]:
        """Entries named by their origin, with the bookkeeping fields taken off."""
        entries = []
        for entry_id, fields in rows:
            fields = dict(fields)
            origin = _text(fields.pop(ORIGIN_FIELD, b"") or entry_id)
            fields.pop(TOKENS_FIELD, None)
            fields.pop(AHEAD_FIELD, None)
            if origin in held:
                continue
            queue_entry_id = _text(entry_id)
            self._where[origin] = (queue, queue_entry_id)
            deliveries = 1
            if delivered:
                rows = await self.redis.xpending_range(
                    queue, self.group, min=queue_entry_id, max=queue_entry_id, count=1
                )
                deliveries = rows[0]["times_delivered"] if rows else 1
            entries.append(Entry(origin, fields, deliveries))
        return entries

    def took_batch(self, entry_id: str) -> bool:
        """Whether a job this reader gave out came from a batch queue."""
        queue = self._where.get(entry_id, ("",))[0]
        return queue.startswith(f"{self._tag}:q:{BATCH_LEVEL}:")

    async def _queues(self) -> list[str]:
        return sorted(_text(queue) for queue in await self.redis.smembers(f"{self._tag}:queues"))

    async def renew(self, entry_ids: Collection[str]) -> list[str]:
        by_queue: dict[str, dict[str, str]] = defaultdict(dict)
        lost = []
        for origin in entry_ids:
            if origin in self._where:
                queue, queue_entry_id = self._where[origin]
                by_queue[queue][queue_entry_id] = origin
            else:
                lost.append(origin)
        for queue, origins in by_queue.items():
            try:
                gone = await self._renew(keys=[queue], args=[self.group, self.consumer, *origins])
            except ResponseError as error:
                if "NOGROUP" not in str(error):
                    raise
                continue
            lost += [origins[_text(queue_entry_id)] for queue_entry_id in gone]
        for origin in lost:  # another worker has it now
            self._where.pop(origin, None)
        return lost

    async def ack(self, entry_id: str) -> None:
        if entry_id not in self._where:
            return  # lost to another worker meanwhile: it is theirs to ack
        queue, queue_entry_id = self._where.pop(entry_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(queue, self.group, queue_entry_id)
            pipe.xdel(queue, queue_entry_id)
            await pipe.execute()

    async def dead_letter(self, entry: Entry, code: str, message: str) -> None:
        """As `JobReader.dead_letter`, naming the request stream and the request entry."""
        record = dead_letter_record(entry, self.stream, self.consumer, code, message)
        await self.redis.xadd(self.dead_letter_stream, record, maxlen=self.dead_letter_max_len, approximate=True)
        await self.ack(entry.entry_id)


class Admission:
    """Moves each new request-stream entry into its tenant's queue, or refuses it.

    `check(entry)` decodes an entry and counts its prompt tokens, or raises what the
    worker turns into the entry's error (a `ProtocolError`, or an engine's refusal);
    `refuse(entry, job, refusal)` tells the producer and dead-letters the entry.
    """

    def __init__(
        self,
        redis,
        config: RedisConfig,
        fair: FairQueueConfig,
        check: Callable,
        refuse: Callable,
    ) -> None:
        self.redis = redis
        self.config = config
        self.fair = fair
        self.reader = JobReader(redis, config)  # the request stream, this worker's consumer
        self._check = check
        self._refuse = refuse
        self._admit = redis.register_script(ADMIT)

    async def run(self) -> None:
        """Admit until cancelled."""
        while True:
            entries = await self.reader.read(64, self.config.block_ms)
            for entry in entries:
                await self.admit(entry)

    async def admit(self, entry: Entry) -> None:
        checked = await self._check(entry)
        if checked is None:
            return  # refused for what it is: the worker has told the producer
        job, prompt_tokens = checked
        fair = self.fair
        result = await self._admit(
            keys=[self.config.requests_stream],
            args=[
                self.config.group,
                entry.entry_id,
                job.tenant,
                level_of(job),
                prompt_tokens,
                int(time.time() * 1000),
                fair.max_queued_jobs,
                fair.max_queued_tokens,
                fair.tenant_max_queued_jobs,
                fair.tenant_max_queued_tokens,
                fair.tenant_tokens_per_s,
                fair.max_queue_wait_s,
            ],
        )
        outcome = _text(result[0])
        if outcome in ("admitted", "gone"):
            return
        await self._refuse(entry, job, Refusal(outcome, float(result[1]), _text(result[2])))


class Charges:
    """The output tokens each tenant was served since the last flush, charged in one round
    trip (a prompt is charged when its job is taken: the TAKE script)."""

    def __init__(self, redis, stream: str, fair: FairQueueConfig) -> None:
        self.redis = redis
        self.stream = stream
        self.fair = fair
        self._charge = redis.register_script(CHARGE)
        self._weighted: dict[str, float] = defaultdict(float)  # by account
        self._raw: dict[str, int] = defaultdict(int)  # by tenant, for the tokens-per-second quota

    def output(self, job: Job, num_tokens: int) -> None:
        self._weighted[account_of(job)] += self.fair.charge_output_weight * num_tokens
        self._raw[job.tenant] += num_tokens

    async def flush(self) -> None:
        if not (self._weighted or self._raw):
            return
        weighted, raw = self._weighted, self._raw
        self._weighted, self._raw = defaultdict(float), defaultdict(int)
        args: list = [int(time.time() * 1000)]
        for account, amount in weighted.items():
            args += [account, amount]
        args.append("--")
        for tenant, amount in raw.items():
            args += [tenant, amount]
        try:
            await self._charge(keys=[self.stream], args=args)
        except Exception:
            for account, amount in weighted.items():  # charged next time
                self._weighted[account] += amount
            for tenant, amount in raw.items():
                self._raw[tenant] += amount
            raise

    async def run(self, interval_s: float = 0.2) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.flush()
            except Exception as error:  # Redis away: kept for the next flush
                log.debug("charge_failed", error=str(error))


def _text(value, errors: str = "strict") -> str:
    return value.decode(errors=errors) if isinstance(value, bytes) else value
