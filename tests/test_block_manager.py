"""The KV block allocator: every block is either free or held by exactly one owner."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from workers.block_manager import BlockPool, OutOfBlocks, blocks_needed


def test_allocates_every_block_once_then_refuses():
    allocator = BlockPool(4)
    blocks = {allocator.allocate() for _ in range(4)}
    assert blocks == {0, 1, 2, 3}
    with pytest.raises(OutOfBlocks):
        allocator.allocate()


def test_double_free_is_refused():
    allocator = BlockPool(2)
    block = allocator.allocate()
    allocator.free([block])
    with pytest.raises(ValueError):
        allocator.free([block])
    with pytest.raises(ValueError):
        allocator.free([7])


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_blocks_needed_covers_the_tokens_tightly(num_tokens, block_size):
    n = blocks_needed(num_tokens, block_size)
    assert n * block_size >= num_tokens
    assert (n - 1) * block_size < num_tokens or n == 0


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences across several owners never lose or share a block."""

    def __init__(self):
        super().__init__()
        self.allocator = BlockPool(16)
        self.owned: dict[int, list[int]] = {owner: [] for owner in range(4)}

    @precondition(lambda self: self.allocator.num_free > 0)
    @rule(owner=st.integers(0, 3))
    def allocate(self, owner):
        self.owned[owner].append(self.allocator.allocate())

    @rule(owner=st.integers(0, 3))
    def free_all(self, owner):
        self.allocator.free(self.owned[owner])
        self.owned[owner] = []

    @precondition(lambda self: self.allocator.num_free == 0)
    @rule()
    def exhausted_pool_refuses(self):
        with pytest.raises(OutOfBlocks):
            self.allocator.allocate()

    @invariant()
    def every_block_free_or_owned_once(self):
        held = [b for blocks in self.owned.values() for b in blocks]
        assert len(held) == len(set(held))
        assert len(held) + self.allocator.num_free == self.allocator.num_blocks
        assert self.allocator.num_used == len(held)


TestAllocatorMachine = AllocatorMachine.TestCase
