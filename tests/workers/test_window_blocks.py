"""KV memory that knows the window (docs/features.md, "Sliding-window and hybrid models").

A sliding-window layer reads only its last `window` positions, so a group of such layers
holds only the blocks its window can still read: the rest go back to the pool and its
block table names the null block there. What a request needs, what fits, what a prefix
hit takes and what a swap copies all count each group by what it holds. Plain Python
over block ids first; then the engine, token-exact with every layer holding all.
"""

from __future__ import annotations

import pytest
import torch

from bench.drive import Driver
from gpu.kv_layout import KVLayout
from workers.api import SamplingParams
from workers.block_pool import NULL_BLOCK, BlockPool, blocks_needed
from workers.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from workers.engine import Engine
from workers.kv_cache import KVCacheManager
from workers.model_loader import load_model
from workers.plan import StepPlan
from workers.request import Request

BLOCK = 4
WINDOW = 8  # a query reads its own key and the seven before it
SALT = b"test"
HYBRID = (None, WINDOW)  # one full-attention group, one sliding


def manager(windows=HYBRID, num_blocks=64, host_blocks=0, cache_salt=SALT) -> KVCacheManager:
    host = BlockPool(host_blocks) if host_blocks else None
    return KVCacheManager(BlockPool(num_blocks, keep_null=True), BLOCK, host, cache_salt, windows)


def request(num_tokens: int, rid: str = "r") -> Request:
    return Request(rid, list(range(10, 10 + num_tokens)), SamplingParams(max_tokens=100), 0.0)


def admit(kv: KVCacheManager, r: Request) -> StepPlan:
    plan = StepPlan()
    prefix = kv.find_prefix(r)
    kv.take_prefix(r, prefix, plan)
    r.num_computed = prefix.num_tokens
    return plan


def compute(kv: KVCacheManager, r: Request, num_tokens: int) -> None:
    """Allocate and 'compute' the next `num_tokens` tokens, as a step would."""
    assert kv.allocate(r, r.num_computed + num_tokens, StepPlan())
    kv.register_full_blocks(r, r.num_computed, r.num_computed + num_tokens)
    r.num_computed += num_tokens


def computed_in_blocks(kv: KVCacheManager, num_tokens: int) -> Request:
    """A request admitted and computed a block a step, its windows giving blocks back as it goes."""
    r = request(num_tokens, rid="first")
    admit(kv, r)
    for _ in range(num_tokens // BLOCK):
        compute(kv, r, BLOCK)
    return r


def window_blocks(r: Request) -> list[int]:
    return [block for block in r.block_tables[1] if block != NULL_BLOCK]


def test_layers_are_grouped_by_window_in_groups_of_equal_size():
    gemma3 = KVLayout.of_windows([512] * 5 + [None] + [512] * 5 + [None] + [512] * 5 + [None])
    assert gemma3.group_size == 3 and gemma3.windows == (512,) * 5 + (None,)
    assert gemma3.groups[-1].layers == (5, 11, 17) and gemma3.place(11) == (5, 1)
    alternating = KVLayout.of_windows([128, None] * 12)
    assert alternating.windows == (128, None) and alternating.group_size == 12
    assert KVLayout.of_windows([4096] * 32).windows == (4096,)  # one group: the whole pool windowed
    assert KVLayout.uniform(30).windows == (None,) and KVLayout.uniform(30).group_size == 30


def test_a_sliding_group_gives_back_the_blocks_that_leave_its_window():
    kv = manager()
    r = request(60)
    admit(kv, r)
    for _ in range(15):
        compute(kv, r, BLOCK)
        first_read = max(0, r.num_computed - WINDOW + 1) // BLOCK
        full, sliding = r.block_tables
        assert len(full) == len(sliding) == blocks_needed(r.num_computed, BLOCK)  # an entry per block of context
        assert NULL_BLOCK not in full
        # What the next query reads is held; nothing long before it is (freed one block late at most).
        assert NULL_BLOCK not in sliding[first_read:]
        assert all(block == NULL_BLOCK for block in sliding[: max(0, first_read - 1)])
    assert len(window_blocks(r)) <= blocks_needed(WINDOW, BLOCK) + 1
    held = len(r.block_tables[0]) + len(window_blocks(r))
    assert kv.device_pool.num_used == held
    kv.free(r)
    assert kv.device_pool.num_free == kv.device_pool.num_blocks


def test_what_fits_counts_a_window_by_what_it_holds():
    whole = manager(windows=(None, None), num_blocks=25)
    windowed = manager(num_blocks=25)
    assert whole.most_tokens() == 12 * BLOCK  # two blocks per block of tokens, the null block kept back
    longest = windowed.most_tokens()
    assert longest == 22 * BLOCK  # 22 full blocks, and the window's 2 in the sliding group
    assert windowed.fits(longest) and not windowed.fits(longest + 1)
    # With every layer windowed, what a request holds is bounded by the window alone.
    assert manager(windows=(WINDOW,), num_blocks=5).most_tokens(limit=1 << 20) == 1 << 20


def test_room_counts_the_blocks_a_window_will_give_back():
    kv = manager(num_blocks=13)  # 12 to hand out
    r = request(200)
    admit(kv, r)
    compute(kv, r, 24)  # 6 full blocks, the window's 2 (the rest given back on the next allocation)
    room = kv.room(r)
    assert room > 0
    compute(kv, r, room)  # all of it is really there
    assert kv.room(r) == 0 or kv.allocate(r, r.num_computed + 1, StepPlan())


def test_a_prefix_hit_takes_the_full_chain_and_only_the_windows_blocks():
    kv = manager()
    first = computed_in_blocks(kv, 40)
    full, sliding = list(first.block_tables[0]), list(first.block_tables[1])
    assert NULL_BLOCK in sliding  # its window gave blocks back (they stay cached, not needed again)
    kv.free(first)

    again = request(44, rid="again")  # the same 40 tokens, then more
    prefix = kv.find_prefix(again)
    assert prefix.num_tokens == 40
    assert prefix.blocks[0] == full  # the full group from the start
    first_read = (40 - WINDOW + 1) // BLOCK
    assert prefix.blocks[1][:first_read] == [NULL_BLOCK] * first_read  # the window's only
    assert prefix.blocks[1][first_read:] == sliding[first_read:10]


def test_a_prefix_hit_stops_where_the_window_misses_a_block():
    kv = manager()
    first = computed_in_blocks(kv, 40)
    kv.device_pool.unregister(first.block_tables[1][9])  # its sliding layers' last block is lost
    kv.free(first)
    prefix = kv.find_prefix(request(44, rid="again"))
    # 40 tokens would need sliding blocks 8 and 9; 36 need 7 and 8, still cached.
    assert prefix.num_tokens == 36
    assert NULL_BLOCK not in prefix.blocks[1][7:9]


def test_a_swap_copies_the_blocks_each_group_holds_and_restores_the_window():
    kv = manager(host_blocks=32, cache_salt=None)
    r = request(50)
    admit(kv, r)
    compute(kv, r, 40)
    compute(kv, r, 1)  # allocating gives back what left the window
    tables = [list(table) for table in r.block_tables]
    plan = StepPlan()
    assert kv.swap_out(r, plan)
    assert len(plan.swap_out) == len(tables[0]) + len(window_blocks(r))  # not the null entries
    kv.release(r, plan)
    assert kv.device_pool.num_used == 0

    back = StepPlan()
    assert kv.can_resume(r)
    kv.swap_in(r, back)
    assert [len(t) for t in r.block_tables] == [len(t) for t in tables]
    assert [b == NULL_BLOCK for b in r.block_tables[1]] == [b == NULL_BLOCK for b in tables[1]]
    assert len(back.swap_in) == len(plan.swap_out)


def test_a_windowed_cache_needs_a_pool_that_keeps_the_null_block():
    with pytest.raises(ValueError, match="null block"):
        KVCacheManager(BlockPool(8), BLOCK, None, None, HYBRID)


# -- the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3():
    """tiny-gemma3: five layers with a window of 16 to one global layer, random weights."""
    return load_model(ModelConfig(source="random:tiny-gemma3", device="cpu"))


def serve(loaded, trim_windows: bool, prompts: dict[str, list[int]], new_tokens: int):
    engine = Engine(
        loaded,
        EngineConfig(
            cache=CacheConfig(kv_memory_bytes=8 << 20, swap_memory_bytes=0, trim_windows=trim_windows),
            scheduler=SchedulerConfig(max_batch_tokens=64, max_prefill_chunk=24),
        ),
    )
    driver = Driver(engine)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for rid, ids in prompts.items():
        driver.submit(rid, ids, params)
    most_used = 0
    while engine.has_unfinished():
        driver.step()
        # Pages of the pool in use, in layers' blocks: a page holds one group's layers.
        most_used = max(most_used, engine.allocator.num_used * engine.runner.kv_cache.layout.group_size)
    assert engine.allocator.num_free == engine.allocator.num_blocks
    return {rid: driver.tokens[rid] for rid in prompts}, most_used, engine


def test_a_hybrid_model_serves_the_same_tokens_holding_a_fraction_of_the_blocks(gemma3):
    generator = torch.Generator().manual_seed(3)
    prompts = {f"r{n}": torch.randint(3, 400, (n,), generator=generator).tolist() for n in (90, 150, 200)}
    trimmed, trimmed_used, engine = serve(gemma3, True, prompts, 40)
    whole, whole_used, _ = serve(gemma3, False, prompts, 40)
    assert engine.runner.kv_cache.layout.windows == (16,) * 5 + (None,)
    assert trimmed == whole
    # Five of six layers hold a window's blocks, not the whole context.
    assert trimmed_used < 0.5 * whole_used


def test_a_hybrid_models_cached_prefix_gives_the_tokens_computing_it_gives(gemma3):
    """A prompt is served, then again with more after it: the second starts after the
    cached prefix (the global layer's blocks from the start, the windows' last blocks) and
    makes the tokens an engine without prefix caching makes."""
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 400, (120,), generator=generator).tolist()
    longer = shared + torch.randint(3, 400, (30,), generator=generator).tolist()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    results = {}
    for caching in (True, False):
        engine = Engine(
            gemma3,
            EngineConfig(
                cache=CacheConfig(kv_memory_bytes=8 << 20, swap_memory_bytes=0, prefix_caching=caching),
                scheduler=SchedulerConfig(max_batch_tokens=64, max_prefill_chunk=24),
            ),
        )
        hits: list[int] = []
        engine.observer = lambda stats: hits.append(stats.cache.device_hit_tokens)
        driver = Driver(engine)
        driver.submit("first", shared, params)
        driver.drain()
        driver.submit("again", longer, params)
        driver.drain()
        results[caching] = (driver.tokens["first"], driver.tokens["again"], sum(hits))
    assert results[True][:2] == results[False][:2]
    assert results[True][2] >= 96 and results[False][2] == 0  # at least 6 of the 7 full blocks, and the windows'
