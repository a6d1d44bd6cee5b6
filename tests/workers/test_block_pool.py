"""The KV block pool: refcounted blocks, content addresses and lazy LRU eviction of cached blocks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from workers.block_pool import BlockPool, OutOfBlocks, block_hash, blocks_needed


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


# -- the prefix cache: refcounts, content addresses, lazy LRU eviction ------------------

SALT = b"model|float32"


def address(*tokens: int, parent: bytes = b"") -> bytes:
    return block_hash(parent, list(tokens), SALT)


def test_a_registered_block_freed_by_its_last_holder_stays_cached_and_can_be_shared_again():
    pool = BlockPool(2)
    block = pool.allocate()
    assert pool.register(block, address(1, 2))
    pool.share(block)  # a second request takes the same prefix
    pool.free([block])
    assert pool.holders(block) == 1 and pool.num_free == 1
    pool.free([block])
    assert pool.holders(block) == 0 and pool.num_free == 2  # free, and still findable
    assert pool.lookup(address(1, 2)) == block and pool.num_cached == 1
    pool.share(block)
    assert pool.holders(block) == 1 and pool.num_free == 1


def test_empty_blocks_are_handed_out_before_any_cached_block_is_evicted():
    pool = BlockPool(3)
    cached = pool.allocate()
    pool.register(cached, address(1))
    pool.free([cached])
    got = {pool.allocate(), pool.allocate()}
    assert cached not in got and pool.lookup(address(1)) == cached and pool.evicted == []


def test_cached_blocks_are_evicted_least_recently_freed_first_and_reported():
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    for i, block in enumerate(blocks):
        pool.register(block, address(i))
    pool.free([blocks[1]])
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.share(blocks[2])  # taken again: no longer evictable
    pool.free([blocks[2]])  # ... and freed again: now the most recent
    assert [pool.allocate() for _ in range(3)] == [blocks[1], blocks[0], blocks[2]]
    assert pool.take_evicted() == [(address(1), blocks[1]), (address(0), blocks[0]), (address(2), blocks[2])]
    assert pool.num_evictions == 3 and pool.num_cached == 0 and pool.take_evicted() == []
    assert all(pool.lookup(address(i)) is None for i in range(3))


def test_an_address_names_one_block_and_a_block_has_one_address():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, address(5))
    assert not pool.register(b, address(5))  # computed twice: the first copy keeps the address
    assert not pool.register(a, address(6))
    assert (pool.lookup(address(5)), pool.address(b), pool.lookup(address(6))) == (a, None, None)


def test_only_held_blocks_are_registered_and_only_registered_blocks_are_shared():
    pool = BlockPool(2)
    block = pool.allocate()
    with pytest.raises(ValueError):
        pool.share(block)
    pool.free([block])
    with pytest.raises(ValueError):
        pool.register(block, address(1))


def test_unregistering_a_free_cached_block_makes_it_empty_and_a_held_one_plain():
    pool = BlockPool(2)
    free, held = pool.allocate(), pool.allocate()
    pool.register(free, address(1))
    pool.register(held, address(2))
    pool.free([free])
    pool.unregister(free)
    pool.unregister(held)
    assert pool.lookup(address(1)) is None and pool.lookup(address(2)) is None and pool.num_cached == 0
    assert pool.allocate() == free and pool.evicted == []  # handed out as an empty block
    pool.free([held])
    assert pool.allocate() == held and pool.evicted == []


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12), st.integers(1, 4))
def test_block_hash_chains_are_equal_exactly_when_the_prefixes_are(a, b, block_size):
    def chain(tokens, salt=SALT):
        hashes, parent = [], b""
        for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
            parent = block_hash(parent, tokens[start : start + block_size], salt)
            hashes.append(parent)
        return hashes

    for i, (x, y) in enumerate(zip(chain(a), chain(b))):
        assert (x == y) == (a[: (i + 1) * block_size] == b[: (i + 1) * block_size])
    assert not set(chain(a)) & set(chain(a, salt=b"another model"))  # the salt separates models


class PrefixPoolMachine(RuleBasedStateMachine):
    """BlockPool against a model of itself: owners take blocks (allocate), register the
    ones they hold, take registered blocks again (lookup + share), and free them, while
    blocks are unregistered and evicted. The model predicts every refcount, address and
    eviction; the invariants are the allocator's: no leak, no double free, one block per
    address, and no held block ever handed out."""

    NUM_BLOCKS = 6
    CONTENTS = st.integers(0, 7)  # few contents, so addresses collide

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS)
        self.owned: dict[int, list[int]] = {owner: [] for owner in range(3)}  # an owner may hold a block twice
        self.addresses: dict[int, bytes] = {}  # the model: block -> address
        self.cached_order: list[int] = []  # free registered blocks, least recently freed first
        self.evicted: list[tuple[bytes, int]] = []

    def holders(self, block: int) -> int:
        return sum(blocks.count(block) for blocks in self.owned.values())

    def drop(self, owner: int, blocks: list[int]) -> None:
        self.pool.free(blocks)
        for block in blocks:
            self.owned[owner].remove(block)
            if self.holders(block) == 0 and block in self.addresses:
                self.cached_order.append(block)

    @precondition(lambda self: self.pool.num_free > 0)
    @rule(owner=st.integers(0, 2))
    def allocate(self, owner):
        empty = [b for b in range(self.NUM_BLOCKS) if self.holders(b) == 0 and b not in self.addresses]
        block = self.pool.allocate()
        assert self.holders(block) == 0, f"block {block} handed out while held"
        if empty:
            assert block in empty, "a cached block was evicted while an empty one was free"
        else:
            assert block == self.cached_order.pop(0), "not the least recently freed cached block"
            self.evicted.append((self.addresses.pop(block), block))
        assert self.pool.address(block) is None and self.pool.holders(block) == 1
        self.owned[owner].append(block)

    @precondition(lambda self: self.pool.num_free == 0)
    @rule()
    def exhausted_pool_refuses(self):
        with pytest.raises(OutOfBlocks):
            self.pool.allocate()

    @rule(owner=st.integers(0, 2), index=st.integers(0, 20), content=CONTENTS)
    def register(self, owner, index, content):
        if not self.owned[owner]:
            return
        block = self.owned[owner][index % len(self.owned[owner])]
        at = address(content)
        expected = block not in self.addresses and at not in self.addresses.values()
        assert self.pool.register(block, at) is expected
        if expected:
            self.addresses[block] = at

    @rule(owner=st.integers(0, 2), content=CONTENTS)
    def take_cached_prefix(self, owner, content):
        at = address(content)
        block = self.pool.lookup(at)
        known = [b for b, a in self.addresses.items() if a == at]
        assert block == (known[0] if known else None)
        if block is not None:
            if self.holders(block) == 0:
                self.cached_order.remove(block)
            self.pool.share(block)
            self.owned[owner].append(block)

    @rule(owner=st.integers(0, 2), index=st.integers(0, 20))
    def free_one(self, owner, index):
        if self.owned[owner]:
            self.drop(owner, [self.owned[owner][index % len(self.owned[owner])]])

    @rule(owner=st.integers(0, 2))
    def free_all(self, owner):
        self.drop(owner, list(self.owned[owner]))

    @rule(block=st.integers(0, NUM_BLOCKS - 1))
    def double_free_is_refused(self, block):
        if self.holders(block) == 0:
            free_before = self.pool.num_free
            with pytest.raises(ValueError):
                self.pool.free([block])
            assert self.pool.num_free == free_before

    @rule(block=st.integers(0, NUM_BLOCKS - 1))
    def unregister(self, block):
        self.pool.unregister(block)
        self.addresses.pop(block, None)
        if block in self.cached_order:
            self.cached_order.remove(block)

    @rule()
    def take_evicted(self):
        assert self.pool.take_evicted() == self.evicted
        self.evicted = []

    @invariant()
    def refcounts_and_free_blocks_match_the_holders(self):
        held = {b for blocks in self.owned.values() for b in blocks}
        for block in range(self.NUM_BLOCKS):
            assert self.pool.holders(block) == self.holders(block)
        assert len(held) + self.pool.num_free == self.NUM_BLOCKS, "a block leaked"
        assert self.pool.num_used == len(held)

    @invariant()
    def every_address_names_exactly_one_block(self):
        assert len(set(self.addresses.values())) == len(self.addresses)
        assert self.pool.num_cached == len(self.addresses)
        for block in range(self.NUM_BLOCKS):
            at = self.addresses.get(block)
            assert self.pool.address(block) == at
            if at is not None:
                assert self.pool.lookup(at) == block


TestPrefixPoolMachine = PrefixPoolMachine.TestCase
