"""`BlockTables` (gpu/attention.py) keeps padded block tables across steps: whatever the
steps do to the block lists (append, replace with a new list, drop, come back), each
step's table reads as the one built from scratch over every context."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu.attention import BlockTables, SequenceSlice, padded_block_tables

BLOCK_SIZE = 4

# One step: for each live list, what happens to it; then which lists run, in what order.
actions = st.sampled_from(["keep", "append", "append_many", "replace", "drop"])


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_each_step_reads_as_tables_built_from_scratch(data):
    tables = BlockTables()
    lists: list[list[int]] = []
    next_id = iter(range(1, 10**6))
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        for _ in range(data.draw(st.integers(0, 3), label="new lists")):
            lists.append([next(next_id) for _ in range(data.draw(st.integers(1, 5)))])
        survivors = []
        for ids in lists:
            action = data.draw(actions)
            if action == "append":
                ids.append(next(next_id))
            elif action == "append_many":  # longer than any row so far: the table widens
                ids.extend(next(next_id) for _ in range(20))
            elif action == "replace":  # e.g. a copy on write, or a request started again
                ids = [*ids[:-1], next(next_id)]
            if action != "drop":
                survivors.append(ids)
        lists = survivors
        running = data.draw(st.permutations(lists)) if lists else []
        running = running[: data.draw(st.integers(0, len(running)))]
        # A context covers at least one token of its last block, or fewer blocks than it holds.
        sequences = [SequenceSlice(i, 1, data.draw(st.integers(1, len(ids) * BLOCK_SIZE)), ids)
                     for i, ids in enumerate(running)]  # fmt: skip
        got = tables.gather(sequences, BLOCK_SIZE)
        expected = padded_block_tables(sequences, BLOCK_SIZE)
        assert got.shape == expected.shape
        for row, seq in enumerate(sequences):
            used = -(-seq.context_len // BLOCK_SIZE)
            assert np.array_equal(got[row, :used], expected[row, :used])
