"""Prefix caching with the real SmolLM2 model, float32: a request that reuses cached K/V
produces exactly the tokens it produces with caching off.

Each test runs the same arrivals on two engines, caching off and on, with 4-token blocks
(so prompts span many blocks and hits are partial), and compares every request's tokens.
The caching engine's own figures (`EngineStats.cache`, per step) show that the case the
test is about happened: device hits, host-tier hits (fetches), evictions.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.conftest import run_to_completion
from workers.api import SamplingParams

pytestmark = pytest.mark.slow

BLOCK = 4
TOKEN_BYTES = 46080  # K and V of one token of SmolLM2 in float32 (30 layers, 3 KV heads, head_dim 64)
BLOCK_BYTES = BLOCK * TOKEN_BYTES

PREFIX = (
    "You are a careful assistant. Answer in one short sentence, do not repeat the question, "
    "and never apologise. Question: "
)
QUESTIONS = [
    "What is the capital of France?",
    "Name a red fruit.",
    "What is two plus two?",
    "Which planet is the largest?",
    "What colour is the sky?",
    "Who wrote Hamlet?",
]


@dataclass
class CacheTally:
    """The caching engine's prefix-cache figures, summed over its steps."""

    queried_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    offloaded_blocks: int = 0
    device_evictions: int = 0  # a running total in the stats: the last one
    preempted: int = 0

    def attach(self, engine) -> CacheTally:
        def observe(stats) -> None:
            cache = stats.cache
            self.queried_tokens += cache.queried_tokens
            self.device_hit_tokens += cache.device_hit_tokens
            self.host_hit_tokens += cache.host_hit_tokens
            self.offloaded_blocks += cache.offloaded_blocks
            self.device_evictions = cache.device_evictions
            if stats.step is not None:
                self.preempted += stats.step.num_preempted

        engine.observer = observe
        return self


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    tokenizer = smollm2.tokenizer
    prefix = tokenizer(PREFIX).input_ids
    return prefix, [prefix + tokenizer(q, add_special_tokens=False).input_ids for q in QUESTIONS]


def run_both(make_engine, waves, **engine_options):
    """Run `waves` (a list of arrivals dicts, each run to completion in turn on the same
    engine) with caching off and on; returns (tokens off, tokens on, the on engine's tally)."""
    tokens, tally = {}, None
    for caching in (False, True):
        engine = make_engine(block_size=BLOCK, prefix_caching=caching, **engine_options)
        if caching:
            tally = CacheTally().attach(engine)
        got = {}
        for arrivals in waves:
            got.update({rid: t for rid, (t, final, _) in run_to_completion(engine, arrivals).items()})
        tokens[caching] = got
    assert set(tokens[False]) == set(tokens[True])
    return tokens[False], tokens[True], tally


def test_many_requests_sharing_a_long_prefix_generate_the_same_tokens(make_engine, prompt_ids):
    """The first request computes the shared instructions; the others arrive while it
    decodes and start after the cached blocks. Among them: the same prompt again (all of
    its full blocks cached: its last block is recomputed, not written in place) and the
    bare prefix plus one token."""
    prefix, prompts = prompt_ids
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    arrivals = {0: [("first", prompts[0], params)]}
    for i, ids in enumerate(prompts[1:3] + [prompts[0], prefix + [prompts[1][len(prefix)]]], start=1):
        arrivals.setdefault(1 + i // 2, []).append((f"r{i}", ids, params))
    off, on, tally = run_both(make_engine, [arrivals])
    assert on == off
    assert len(prefix) >= 6 * BLOCK
    # Every later request found at least the prefix's full blocks on the device.
    assert tally.device_hit_tokens >= (len(arrivals) - 1) * (len(prefix) // BLOCK) * BLOCK
    assert tally.host_hit_tokens == 0


def test_prefixes_restored_from_the_host_tier_generate_the_same_tokens(make_engine, prompt_ids):
    """A device pool of 30 blocks: unrelated requests evict the cached prefix, which goes
    to the host pool; a later request with that prefix copies it back (a fetch)."""
    _, prompts = prompt_ids
    params = SamplingParams(max_tokens=6)
    filler = [list(range(1000 + 100 * i, 1000 + 100 * i + 100)) for i in range(2)]  # 25 blocks each
    waves = [
        {0: [("warm", prompts[0], params)]},
        {0: [("filler0", filler[0], SamplingParams(max_tokens=4, ignore_eos=True))]},
        {0: [("filler1", filler[1], SamplingParams(max_tokens=4, ignore_eos=True))]},
        {0: [("hit", prompts[1], params), ("same", prompts[0], params)]},
    ]
    off, on, tally = run_both(make_engine, waves, kv_memory_bytes=30 * BLOCK_BYTES, swap_memory_bytes=64 << 20)
    assert on == off
    assert tally.offloaded_blocks > 0
    assert tally.host_hit_tokens >= 6 * BLOCK, tally


@pytest.mark.parametrize("swap", [True, False], ids=["host-tier", "device-only"])
def test_prefixes_evicted_mid_run_generate_the_same_tokens(make_engine, prompt_ids, swap):
    """A device pool of 16 blocks, too small for two requests at once: requests sharing
    the prefix arrive among unrelated ones, so cached blocks are evicted (and offloaded,
    with a host pool) while others still run, and running requests are preempted
    (swapped or recomputed)."""
    _, prompts = prompt_ids
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    arrivals: dict[int, list[tuple]] = {}
    for i, ids in enumerate(prompts[:3]):
        arrivals.setdefault(2 * i, []).append((f"shared{i}", ids, params))
        if i < 2:
            arrivals.setdefault(2 * i + 1, []).append((f"other{i}", list(range(2000 + 40 * i, 2030 + 40 * i)), params))
    off, on, tally = run_both(
        make_engine,
        [arrivals],
        kv_memory_bytes=16 * BLOCK_BYTES,
        swap_memory_bytes=(64 << 20) if swap else 0,
        max_prefill_chunk=12,
    )
    assert on == off
    assert tally.device_evictions > 0 and tally.preempted > 0, tally
    assert tally.device_hit_tokens + tally.host_hit_tokens > 0, tally


def test_a_seeded_sampled_request_generates_the_same_tokens(make_engine, prompt_ids):
    """Temperature 0.8 with a seed: the request's draws come from its own generator, and
    the logits it samples from are the same whether its prefix was cached or computed."""
    _, prompts = prompt_ids
    sampled = SamplingParams(max_tokens=10, temperature=0.8, seed=1234, ignore_eos=True)
    waves = [
        {0: [("warm", prompts[0], SamplingParams(max_tokens=2))]},
        {0: [("sampled", prompts[2], sampled), ("again", prompts[0], sampled)]},
    ]
    off, on, tally = run_both(make_engine, waves)
    assert on == off
    assert on["sampled"] != on["again"]  # not a degenerate distribution
    assert tally.device_hit_tokens > 0
