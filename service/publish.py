"""Writes a request's events to its reply stream (docs/protocol.md, "Replies"), fenced by
an owner key so that two workers never both write one stream.

A reply stream belongs to one job. Its owner key, `<reply_to>:owner`, names that job's
request-stream entry and the worker serving it. A worker first `claim`s the stream:
- nothing there yet: the stream is this job's;
- the key names this job's entry (a takeover, or this worker restarted): it becomes the
  new owner, and gets back what the stream already holds, to continue from;
- the key names another entry, or the stream exists without one: another job owns it
  (`duplicate_id`); this job writes nothing there.
Every write then checks the owner key in the same script as the XADD, so a worker that
lost the job (paused, partitioned, slow) is refused on its next write, and stops. Both
keys share a hash slot (the owner key only appends to the stream's name), as a Redis
Cluster script requires.

Entry ids are derived from the event, not the clock: token `seq` is `<seq + 1>-0`, and
the final event after n tokens is `<n>-1`. So a write is idempotent: one retried after
a dropped connection that had in fact landed is refused by Redis as "equal or smaller"
and taken as done. Each write refreshes both keys' TTL, so a stream nobody reads expires
`ttl_s` after its last event.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgpack

from service.protocol import done_fields, error_fields, hash_tag, token_fields
from workers.request import FinalEvent

# KEYS: reply stream, owner key. ARGV: the job's entry id, the owner value, TTL seconds.
# Returns {1, entries already there} when the stream is this job's, {0} when not.
CLAIM = """
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
"""

# KEYS: reply stream, owner key. ARGV: the owner value, the entry id, TTL seconds, then
# field, value, ... Returns 1 when written (or already written), 0 when not the owner.
FENCED_ADD = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
local added = redis.pcall('XADD', KEYS[1], ARGV[2], unpack(ARGV, 4))
if type(added) == 'table' and added['err'] then
  if not string.find(added['err'], 'equal or smaller', 1, true) then return added end
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""


class LeaseLost(Exception):
    """Another worker serves this job now; this one must stop writing and generating."""


def owner_key(reply_to: str) -> str:
    """`<reply_to>:owner`, in the reply stream's hash slot: a `reply_to` without a hash
    tag is wrapped in one (`{<reply_to>}:owner`), as a Redis Cluster script needs."""
    return f"{reply_to}:owner" if hash_tag(reply_to) else f"{{{reply_to}}}:owner"


@dataclass(frozen=True)
class Claim:
    owned: bool  # False: another job owns the stream (duplicate id or reply_to)
    token_ids: list[int]  # already published, in seq order (a takeover continues after them)
    finished: bool  # a final event is already there: nothing is left to do


class ReplyPublisher:
    def __init__(self, redis, ttl_s: int, worker: str = "") -> None:
        self.redis = redis  # a redis.asyncio.Redis
        self.ttl_s = ttl_s
        self.worker = worker  # named on done events: which consumer finished the request
        self.incarnation = os.urandom(6).hex()  # two processes under one name still differ
        self._claim = redis.register_script(CLAIM)
        self._add = redis.register_script(FENCED_ADD)

    def owner(self, entry_id: str) -> str:
        return f"{entry_id} {self.worker} {self.incarnation}"

    async def claim(self, reply_to: str, entry_id: str) -> Claim:
        """Take `reply_to` for the job in entry `entry_id` (see the module docstring)."""
        reply = await self._claim(keys=[reply_to, owner_key(reply_to)],
                                  args=[entry_id, self.owner(entry_id), self.ttl_s])
        if not reply[0]:
            return Claim(False, [], False)
        token_ids: list[int] = []
        finished = False
        for _, fields in _pairs(reply[1]):
            data = msgpack.unpackb(fields[b"data"])
            if data["type"] == "token":
                token_ids.extend(data["token_ids"])
            else:
                finished = True
        return Claim(True, token_ids, finished)

    async def token(self, reply_to: str, entry_id: str, seq: int, text: str, token_ids) -> None:
        await self._write(reply_to, entry_id, f"{seq + 1}-0", token_fields(seq, text, token_ids))

    async def done(self, reply_to: str, entry_id: str, event: FinalEvent, num_tokens: int) -> None:
        """The final event, after `num_tokens` token events."""
        await self._write(reply_to, entry_id, f"{num_tokens}-1", done_fields(event, self.worker))

    async def error(self, reply_to: str, entry_id: str, code: str, message: str, num_tokens: int = 0) -> None:
        await self._write(reply_to, entry_id, f"{num_tokens}-1", error_fields(code, message))

    async def _write(self, reply_to: str, entry_id: str, event_id: str, fields: dict) -> None:
        """One fenced XADD; raises `LeaseLost` when this worker no longer owns the stream."""
        flat = [part for pair in fields.items() for part in pair]
        written = await self._add(keys=[reply_to, owner_key(reply_to)],
                                  args=[self.owner(entry_id), event_id, self.ttl_s, *flat])
        if not written:
            raise LeaseLost(reply_to)


def _pairs(flat_entries):
    """XRANGE as returned inside a script: [[id, [field, value, ...]], ...]."""
    for entry_id, flat in flat_entries:
        yield entry_id, dict(zip(flat[::2], flat[1::2]))
