"""The KV-cache manager, as the scheduler sees it: questions in tokens and blocks, and the
copies it lists in a step's plan. Real pools, no scheduler, no tensors."""

from __future__ import annotations

from workers import kv_handoff
from workers.api import SamplingParams
from workers.block_pool import BlockPool
from workers.kv_cache import KVCacheManager
from workers.plan import StepPlan
from workers.request import Request

BLOCK = 4
SALT = b"fake model|float32"


def manager(num_blocks=8, host_blocks=0, cache_salt=SALT) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), BLOCK, BlockPool(host_blocks) if host_blocks else None, cache_salt)


def request(prompt_len: int, first: int = 10, rid: str = "r") -> Request:
    return Request(rid, list(range(first, first + prompt_len)), SamplingParams(max_tokens=8), 0.0)


def compute(kv: KVCacheManager, r: Request, num_tokens: int) -> StepPlan:
    """What a step does to `r`'s blocks: allocate, run (the tokens are computed), register."""
    plan = StepPlan()
    assert kv.allocate(r, r.num_computed + num_tokens, plan)
    kv.register_full_blocks(r, r.num_computed, r.num_computed + num_tokens)
    r.num_computed += num_tokens
    return plan


def test_blocks_grow_with_the_tokens_scheduled_and_allocation_never_half_happens():
    kv = manager(num_blocks=3)
    assert kv.most_tokens() == 3 * BLOCK
    r = request(10)
    assert kv.room(r) == 3 * BLOCK and kv.fits(10)
    compute(kv, r, 5)
    assert len(r.block_tables[0]) == 2 and kv.room(r) == 3 + BLOCK  # the rest of its second block, one free block
    other = request(10, rid="other")
    assert not kv.allocate(other, 2 * BLOCK, StepPlan())  # one block free, two needed
    assert other.block_tables[0] == [] and kv.device_pool.num_free == 1
    assert kv.room(r, keep_free=1) == 3  # the free block is kept for someone else
    kv.free(r)
    assert kv.device_pool.num_free == 3


def test_a_decode_writes_in_place_until_its_block_is_full():
    kv = manager(cache_salt=None)
    r = request(5)
    compute(kv, r, 5)
    assert kv.writes_in_place(r)  # position 5 lies in its second block, its own
    compute(kv, r, 3)
    assert not kv.writes_in_place(r)  # position 8 needs a new block


def test_a_choice_sharing_its_leads_prompt_copies_the_block_before_writing_into_it():
    kv = manager()
    lead, fork = request(6, rid="lead"), request(6, rid="fork")
    compute(kv, lead, 6)
    kv.share_prompt(lead, fork)
    fork.num_computed = 5  # it recomputes the prompt's last token for logits of its own
    assert fork.block_tables[0] == lead.block_tables[0]
    assert kv.shares_next_block(fork) and not kv.writes_in_place(fork)
    free = kv.device_pool.num_free
    assert kv.room(fork) == BLOCK - 1 + (free - 1) * BLOCK  # the copy takes a free block
    shared_list = fork.block_tables[0]
    plan = StepPlan()
    assert kv.allocate(fork, 6, plan)
    assert plan.copies == [(lead.block_tables[0][1], fork.block_tables[0][1])]
    assert fork.block_tables[0][0] == lead.block_tables[0][0] and fork.block_tables[0][1] != lead.block_tables[0][1]
    assert shared_list is not fork.block_tables[0]  # a new list: the old one may back a block table
    assert kv.device_pool.holders(lead.block_tables[0][1]) == 1


def test_with_no_free_block_a_shared_next_block_leaves_no_room():
    kv = manager(num_blocks=2)
    lead, fork = request(6, rid="lead"), request(6, rid="fork")
    compute(kv, lead, 6)
    kv.share_prompt(lead, fork)
    fork.num_computed = 5
    assert kv.room(fork) == 0
    assert not kv.allocate(fork, 6, StepPlan())


def test_a_request_takes_the_cached_full_blocks_before_its_last_token_and_the_hits_are_counted():
    kv = manager()
    first = request(12, rid="first")
    compute(kv, first, 12)  # three full blocks, registered
    blocks = first.block_tables[0]
    kv.free(first)
    assert kv.device_pool.num_cached == 3 and kv.device_pool.num_free == 8

    kv.start_step()
    again = request(12, rid="again")  # all cached: its last block is recomputed for its logits
    prefix = kv.find_prefix(again)
    assert prefix.blocks[0] == blocks[:2] and prefix.num_tokens == 2 * BLOCK
    assert prefix.free_tokens == (8 - 2) * BLOCK  # the hits stop being free once taken
    plan = StepPlan()
    kv.take_prefix(again, prefix, plan)
    assert plan.fetch == [] and len(again.block_tables[0]) == 2
    stats = kv.stats()
    assert (stats.queried_tokens, stats.device_hit_tokens, stats.host_hit_tokens) == (12, 2 * BLOCK, 0)

    longer = request(13, rid="longer")  # shares all three full blocks, two of them held
    assert len(kv.find_prefix(longer).blocks[0]) == 3
    other = request(12, first=50, rid="other")
    assert kv.find_prefix(other).blocks[0] == []


def test_without_a_cache_salt_nothing_is_cached_or_counted():
    kv = manager(cache_salt=None)
    r = request(12)
    compute(kv, r, 12)
    assert kv.device_pool.num_cached == 0
    kv.free(r)
    prefix = kv.find_prefix(request(12))
    assert prefix.blocks[0] == [] and prefix.num_tokens == 0 and prefix.free_tokens == 8 * BLOCK
    kv.take_prefix(request(12), prefix, StepPlan())
    assert kv.stats().queried_tokens == 0


def test_a_released_chain_loses_its_tail_first():
    kv = manager(num_blocks=3)
    first = request(12, rid="first")
    compute(kv, first, 12)
    kv.release(first)
    assert first.block_tables[0] == []
    compute(kv, request(1, first=90, rid="evicts"), 1)  # takes one cached block: the tail's
    assert len(kv.find_prefix(request(13, rid="again")).blocks[0]) == 2  # the head survives


def test_evicted_cached_blocks_go_to_the_host_tier_and_come_back_as_fetches():
    kv = manager(num_blocks=2, host_blocks=4)
    first = request(8, rid="first")
    compute(kv, first, 8)
    kv.free(first)
    kv.start_step()
    evicting = request(8, first=50, rid="evicts")
    plan = compute(kv, evicting, 8)  # evicts both cached blocks
    kv.plan_offloads(plan)
    assert len(plan.offload) == 2 and kv.stats().offloaded_blocks == 2
    kv.copies_done(plan)
    assert kv.host_pool.num_cached == 2 and kv.host_pool.num_free == 4  # cached, not held

    kv.free(evicting)  # it ends; the first's prompt comes back, found in the host tier
    kv.start_step()
    again = request(9, rid="again")
    prefix = kv.find_prefix(again)
    assert [isinstance(entry, tuple) for entry in prefix.blocks[0]] == [True, True]
    fetch_plan = StepPlan()
    kv.take_prefix(again, prefix, fetch_plan)
    assert [device for _, device in fetch_plan.fetch] == again.block_tables[0]
    assert kv.stats().host_hit_tokens == 2 * BLOCK
    assert kv.host_pool.num_free == 2  # held until the copies are made
    kv.copies_done(fetch_plan)
    assert kv.host_pool.num_free == 4


def test_a_failed_copy_drops_the_addresses_it_would_have_made_true():
    kv = manager(num_blocks=2, host_blocks=4)
    first = request(8, rid="first")
    compute(kv, first, 8)
    kv.free(first)
    plan = StepPlan()
    evicting = request(8, first=50, rid="evicts")
    assert kv.allocate(evicting, 8, plan)
    kv.plan_offloads(plan)
    kv.copies_done(plan, copied=False)
    assert kv.host_pool.num_cached == 0 and kv.host_pool.num_free == 4


def test_a_swap_moves_the_computed_blocks_out_and_back_and_frees_the_host_blocks_once_read():
    kv = manager(num_blocks=4, host_blocks=4, cache_salt=None)
    r = request(6)
    compute(kv, r, 6)
    assert kv.allocate(r, 9, StepPlan())  # a block for tokens not computed yet: not swapped
    computed = r.block_tables[0][:2]
    out = StepPlan()
    assert kv.swap_out(r, out)
    kv.release(r, out)
    assert out.swap_out == list(zip(computed, r.host_block_tables[0])) and kv.device_pool.num_free == 4
    back = StepPlan()
    kv.swap_in(r, back)
    assert back.swap_in == list(zip([h for _, h in out.swap_out], r.block_tables[0])) and r.host_block_tables == ()
    assert kv.host_pool.num_free == 2
    kv.copies_done(back)
    assert kv.host_pool.num_free == 4


def test_no_swap_without_host_room_or_while_a_block_of_it_is_copied_on_write():
    kv = manager(num_blocks=4, host_blocks=1, cache_salt=None)
    r = request(6)
    compute(kv, r, 6)
    assert not kv.swap_out(r, StepPlan())  # two computed blocks, one host block
    assert manager(cache_salt=None).swap_out(request(6), StepPlan()) is False  # no host tier, nothing computed

    kv = manager(host_blocks=4)
    lead, fork = request(6, rid="lead"), request(6, rid="fork")
    compute(kv, lead, 6)
    kv.share_prompt(lead, fork)
    fork.num_computed = 5
    plan = StepPlan()
    kv.allocate(fork, 6, plan)  # its copy holds nothing until the step runs
    assert not kv.swap_out(fork, plan)
    kv.release(fork, plan)
    assert plan.copies == []  # no copy into a block it no longer holds


def test_truncating_frees_the_blocks_past_the_kept_tokens():
    kv = manager(cache_salt=None)
    r = request(3)
    compute(kv, r, 3)
    assert kv.allocate(r, 10, StepPlan())  # a decode and its drafts
    kept_list = r.block_tables[0]
    kv.truncate(r, 5)
    assert len(r.block_tables[0]) == 2 and kv.device_pool.num_free == 6
    assert kept_list is not r.block_tables[0] and len(kept_list) == 3


def test_k_v_computed_elsewhere_take_empty_device_blocks_first_then_the_host_tier():
    """A decode worker placing a prompt read from a prefill worker: the blocks it adopts
    are registered under the request's addresses and, once filled, cached where the
    request finds them. A cached device block is never taken for it (its offload is
    planned only with the next step); the host tier takes what does not fit."""
    kv = manager(num_blocks=4, host_blocks=4)
    cached = request(9, first=500, rid="cached")
    compute(kv, cached, 8)
    kv.free(cached)  # two cached device blocks, two empty ones
    r = request(17)
    adopted = kv_handoff.adopt_blocks(kv, r, 4 * BLOCK)
    assert [index for index, _ in adopted.device] == [0, 1] and [index for index, _ in adopted.host] == [2, 3]
    assert kv.device_pool.num_cached == 4 and kv.device_pool.take_evicted() == []
    kv_handoff.adopted_filled(kv, adopted)
    assert kv.device_pool.num_free == 4 and kv.host_pool.num_free == 4  # cached, not held
    prefix = kv.find_prefix(r)
    assert [isinstance(entry, int) for entry in prefix.blocks[0]] == [True, True, False, False]
    assert kv_handoff.adopt_blocks(kv, r, 4 * BLOCK) == ([], [])  # already cached: nothing to place


def test_without_room_fewer_blocks_are_adopted_and_the_rest_is_computed():
    kv = manager(num_blocks=2)
    r = request(17)
    adopted = kv_handoff.adopt_blocks(kv, r, 4 * BLOCK)
    assert [index for index, _ in adopted.device] == [0, 1] and adopted.host == []
    kv_handoff.adopted_filled(kv, adopted)
    assert kv.find_prefix(r).num_tokens == 2 * BLOCK


def test_a_handed_off_prompt_moves_with_its_tail_and_the_decode_side_computes_one_token():
    """Prefill side: a prompt of 2.5 blocks ends with `handoff`; its tail is cached beside
    its full blocks, so all three are staged. Decode side: the same prompt and the first
    token; placed, the whole prompt is a prefix hit and the first token writes into a
    copy of the tail block."""
    prefill = manager()
    r = request(10)
    compute(prefill, r, 10)
    prefill.register_prompt_tail(r)
    tail_block = r.block_tables[0][2]
    prefill.free(r)
    blocks, num_tokens = kv_handoff.cached_prompt_blocks(prefill, r)
    assert num_tokens == 10 and len(blocks) == 3 and blocks[2] == tail_block

    decode = manager()
    resumed = request(10)
    resumed.output_token_ids.append(7)  # the first token, published by the prefill worker
    adopted = kv_handoff.adopt_blocks(decode, resumed, 10)
    assert len(adopted.device) == 3
    kv_handoff.adopted_filled(decode, adopted)
    decode.start_step()
    prefix = decode.find_prefix(resumed)
    assert prefix.num_tokens == 10 and len(prefix.blocks[0]) == 3
    plan = StepPlan()
    decode.take_prefix(resumed, prefix, plan)
    assert decode.stats().device_hit_tokens == 10
    resumed.num_computed = prefix.num_tokens
    assert decode.shares_next_block(resumed)
    assert decode.allocate(resumed, 11, plan)
    assert plan.copies == [(prefix.blocks[0][2], resumed.block_tables[0][2])]  # the tail is never written


def test_a_tail_is_found_only_for_exactly_its_tokens():
    kv = manager()
    r = request(10)
    kv_handoff.adopted_filled(kv, kv_handoff.adopt_blocks(kv, r, 10))
    longer = request(11)  # its last token is the 11th: it would need a tail of 3 tokens
    longer.output_token_ids.append(7)
    assert kv.find_prefix(longer).num_tokens == 2 * BLOCK
    other = request(10, first=11)  # the same length, other tokens
    other.output_token_ids.append(7)
    assert kv.find_prefix(other).num_tokens == 0
