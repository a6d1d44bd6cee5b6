"""The fair queue's names in Redis, beside the request stream, and what a job maps to."""

from __future__ import annotations

from dataclasses import dataclass

from service.protocol import Job

ORIGIN_FIELD = b"inflight:origin"  # the request entry's id, on a tenant queue's entry
TOKENS_FIELD = b"inflight:tokens"  # its prompt tokens, as admission counted them
AHEAD_FIELD = b"inflight:ahead"  # the interactive jobs queued when it was admitted
# The prompt's token ids (msgpack), as admission tokenized them: the worker that takes the
# job hands them to the engine, so a prompt is tokenized once in the fleet.
PROMPT_IDS_FIELD = b"inflight:prompt_ids"
BATCH_LEVEL = "batch"


def tag_of(stream: str) -> str:
    """The hash tag every fair-queue key starts with: one hash slot with `stream`."""
    return "{" + stream + "}"


@dataclass(frozen=True)
class CountKeys:
    """Where the fair queue keeps its counts beside a request stream (the names
    service/lua/fair_queue_keys.lua builds): jobs and prompt tokens queued, by tenant
    ('*': all of them), and each tenant queue's backlog, by queue key (a batch queue's
    starts with `batch_queues`)."""

    queued: str
    queued_tokens: str
    backlog: str
    batch_queues: str

    @staticmethod
    def of(stream: str) -> CountKeys:
        tag = tag_of(stream)
        return CountKeys(f"{tag}:queued", f"{tag}:queued_tokens", f"{tag}:backlog", f"{tag}:q:{BATCH_LEVEL}:")


def level_of(job: Job) -> str:
    return BATCH_LEVEL if job.batch else str(job.priority)


def account_of(job: Job) -> str:
    """The counter a job is charged to: batch jobs share a tenant's second counter."""
    return f"batch:{job.tenant}" if job.batch else job.tenant
