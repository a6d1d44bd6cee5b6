"""Disaggregated prefill and decode over a real Redis: a prefill worker and a decode worker
(each with the real SmolLM2 engine, float32) serve jobs from the request stream, the
prompts' K/V moving between them with the transfer engine. A producer sees one gapless
reply stream with exactly the tokens one worker alone makes; nothing stays pending, and
no K/V stays held on either side."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import msgpack
import pytest
import redis.asyncio as aioredis

from service.config import DisaggConfig
from service.handoff import StagedKV
from service.protocol import token_data
from service.worker import Worker
from tests.conftest import run_to_completion
from tests.service.test_worker import read_replies, stream_config
from tests.waiting import eventually
from workers.api import SamplingParams

pytestmark = pytest.mark.slow
pytest.importorskip("nixl_cu12")

BLOCK = 4
PROMPTS = {
    "long": "Explain, in a few careful sentences, why the sky looks blue during the day and red at dusk.",
    "chatty": "Write two lines about the sea and one about the mountains, then stop.",
    "short": "Hi",
}
MAX_TOKENS = 10


def disagg(prefix: str, role: str, **overrides) -> DisaggConfig:
    return DisaggConfig(role=role, handoff_stream=f"{prefix}:handoffs", handoff_min_prompt_tokens=8, **overrides)


def tally_prefix_hits(engine) -> list[int]:
    """The decode engine's prompt tokens found in its prefix cache, step by step."""
    hits, observe = [], engine.observer

    def observer(stats) -> None:
        hits.append(stats.cache.device_hit_tokens + stats.cache.host_hit_tokens)
        observe(stats)

    engine.observer = observer
    return hits


def expected_tokens(make_engine) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    done = run_to_completion(
        make_engine(block_size=BLOCK), {0: [(name, prompt, params) for name, prompt in PROMPTS.items()]}
    )
    return {name: tokens for name, (tokens, _, _) in done.items()}


async def serve(make_engine, prefix: str, jobs, handoff_entries=(), reply_streams=(), dead_letters: int = 0):
    """Run a prefill and a decode worker until every job's reply stream (and each of
    `reply_streams`) ends and `dead_letters` are dead-lettered; returns the replies, the
    workers, the decode engine's prefix-cache hits, what is still pending, and the dead letters."""
    config = stream_config(prefix)
    client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
    stop = asyncio.Event()
    prefill = Worker(make_engine(block_size=BLOCK), client, config, disagg=disagg(prefix, "prefill"))
    decode_engine = make_engine(block_size=BLOCK)
    decode = Worker(decode_engine, client, replace(config, consumer="w2"), disagg=disagg(prefix, "decode"))
    prefix_hits = tally_prefix_hits(decode_engine)
    serving = [asyncio.create_task(worker.run(stop)) for worker in (prefill, decode)]
    for name, prompt in jobs.items():
        await client.xadd(
            config.requests_stream,
            {"id": f"{prefix}-{name}", "prompt": prompt, "max_tokens": str(MAX_TOKENS), "ignore_eos": "true"},
        )
    for fields in handoff_entries:
        await client.xadd(f"{prefix}:handoffs", fields)
    replies = {name: await read_replies(client, f"inflight:out:{{{prefix}-{name}}}") for name in jobs}
    replies.update({reply_to: await read_replies(client, reply_to) for reply_to in reply_streams})

    async def dead_lettered() -> bool:
        return await client.xlen(config.dead_letter_stream) >= dead_letters

    await eventually(dead_lettered, 30, "the dead letters")
    await eventually(lambda: prefill.handoffs.arena.num_held == 0, 10, "the prefill side's K/V freed")
    await eventually(lambda: decode.handoffs.arena.num_held == 0, 10, "the decode side's K/V freed")
    stop.set()
    await asyncio.gather(*serving)
    pending = [await client.xpending(stream, config.group) for stream in (config.requests_stream, f"{prefix}:handoffs")]
    dead = await client.xrange(config.dead_letter_stream)
    await client.delete(
        config.requests_stream,
        f"{prefix}:handoffs",
        config.dead_letter_stream,
        *(f"inflight:out:{{{prefix}-{name}}}" for name in jobs),
        *reply_streams,
        *(f"{reply_to}:owner" for reply_to in reply_streams),
    )
    await client.aclose()
    return replies, (prefill, decode), prefix_hits, pending, dead


def tokens_of(replies: list[dict]) -> list[int]:
    tokens = [entry for entry in replies if entry["type"] == b"token"]
    assert [int(entry["seq"]) for entry in tokens] == list(range(len(tokens)))  # gapless, no repeats
    return [int(entry["token_ids"]) for entry in tokens]


def test_prefill_and_decode_workers_serve_the_tokens_of_one_worker(make_engine):
    want = expected_tokens(make_engine)
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    replies, (prefill, decode), prefix_hits, pending, dead = asyncio.run(serve(make_engine, prefix, PROMPTS))
    for name in PROMPTS:
        assert tokens_of(replies[name]) == want[name], name
        assert replies[name][-1]["type"] == b"done"
        assert replies[name][-1]["finish_reason"] == b"length"
    # The long prompts were finished by the decode worker; the short one never left the prefill worker.
    assert replies["long"][-1]["worker"] == b"w2" and replies["chatty"][-1]["worker"] == b"w2"
    assert replies["short"][-1]["worker"] == b"w1"
    assert sum(prefix_hits) >= 2 * (8 // BLOCK) * BLOCK  # the decode worker read the prompts, not recomputed them
    assert [p["pending"] for p in pending] == [0, 0]
    assert dead == []


def test_a_handoff_whose_kv_cannot_be_read_is_computed_by_the_decode_worker(make_engine):
    """A handoff entry naming a prefill worker that is gone: the decode worker computes the
    prompt itself and continues from the published first token."""
    want = expected_tokens(make_engine)
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    origin = "1-0"
    reply_to = f"inflight:out:{{{prefix}-orphan}}"
    job = {b"id": f"{prefix}-orphan".encode(), b"prompt": PROMPTS["long"].encode(), b"max_tokens": b"10"}
    job[b"ignore_eos"] = b"true"
    gone = StagedKV("a-prefill-worker-that-died", 4096, 1 << 20, 16, (30, 2, 4, 4, 3, 64), "float32", 4e9)

    async def publish_first_token(client):
        # What the dead prefill worker left: the reply stream's owner key and first token.
        await client.set(f"{reply_to}:owner", f"{origin} dead-prefill")
        await client.xadd(
            reply_to,
            {
                "type": "token",
                "seq": "0",
                "text": "",
                "token_ids": str(want["long"][0]),
                "data": token_data(0, "", [want["long"][0]]),
            },
            id="1-0",
        )

    async def main():
        client = aioredis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        await publish_first_token(client)
        await client.aclose()
        entry = {"origin": origin, "job": msgpack.packb(job), "kv": gone.pack()}
        return await serve(make_engine, prefix, {}, handoff_entries=[entry], reply_streams=[reply_to])

    replies, _, _, pending, dead = asyncio.run(main())
    replies = replies[reply_to]
    assert tokens_of(replies) == want["long"]
    assert replies[-1]["type"] == b"done" and replies[-1]["worker"] == b"w2"
    assert [p["pending"] for p in pending] == [0, 0] and dead == []


def test_an_entry_on_the_handoff_stream_that_is_no_handoff_is_dead_lettered(make_engine):
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    entries = [{"prompt": "not a handoff"}]
    *_, pending, dead = asyncio.run(serve(make_engine, prefix, {}, handoff_entries=entries, dead_letters=1))
    assert [record[b"code"] for _, record in dead] == [b"invalid_field"]
    assert [p["pending"] for p in pending] == [0, 0]
