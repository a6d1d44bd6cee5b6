"""The KV transfer layer (`gpu/kv_transfer.py`) on the real NIXL, UCX over host memory: a
read copies exactly the bytes of a peer's registered memory and notifies that peer, in one
process and across two; what cannot be read fails with `TransferFailed` at once rather than
hanging; and the handoff arena's bookkeeping holds its slots apart, reuses them and lets
them expire.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("nixl_cu12")

from gpu.kv_transfer import HandoffArena, KVTransferAgent, TransferFailed  # noqa: E402

# K and V, layers, blocks, block size, KV heads, head size.
KV_SHAPE = (2, 4, 6, 16, 3, 64)
MiB = 1 << 20


@pytest.fixture
def agents():
    reader, holder = KVTransferAgent("reader"), KVTransferAgent("holder")
    yield reader, holder
    reader.close()
    holder.close()


def notifications_within(agent: KVTransferAgent, seconds: float = 5.0) -> list[tuple[str, bytes]]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if received := agent.notifications():
            return received
        time.sleep(0.01)
    return []


def kv(dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(KV_SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- reads between two agents ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_read_copies_a_prefill_slot_into_a_decode_slot_and_notifies_the_prefill_side(agents, dtype):
    reader, holder = agents
    prefill, decode = HandoffArena(holder, 4 * MiB, hold_s=60.0), HandoffArena(reader, 4 * MiB, hold_s=60.0)
    staged = prefill.reserve("job-1", KV_SHAPE, dtype, now=0.0)
    staged.copy_(kv(dtype, seed=1))
    into = decode.reserve("job-1", KV_SHAPE, dtype, now=0.0)

    peer = reader.connect(holder.metadata)
    reader.read(peer, prefill.address("job-1"), into, notify=b"job-1")

    assert peer == "holder"
    assert torch.equal(into.view(torch.uint8), staged.view(torch.uint8))
    assert notifications_within(holder) == [("reader", b"job-1")]
    assert reader.notifications() == []


def test_connecting_again_to_the_same_peer_names_it_again(agents):
    reader, holder = agents
    metadata = holder.metadata
    assert reader.connect(metadata) == "holder"
    assert reader.connect(metadata) == "holder"


def test_memory_registered_after_the_metadata_is_readable_once_connected_with_new_metadata(agents):
    reader, holder = agents
    first, second, into = (
        torch.ones(MiB, dtype=torch.uint8),
        torch.full((MiB,), 7, dtype=torch.uint8),
        torch.zeros(MiB, dtype=torch.uint8),
    )
    holder.register(first)
    reader.register(into)
    peer = reader.connect(holder.metadata)
    holder.register(second)

    with pytest.raises(TransferFailed):
        reader.read(peer, second.data_ptr(), into, timeout_s=1.0)
    assert reader.connect(holder.metadata) == peer
    reader.read(peer, second.data_ptr(), into)
    assert bool((into == 7).all())


def test_a_notification_outside_a_transfer_reaches_the_peer(agents):
    reader, holder = agents
    peer = reader.connect(holder.metadata)
    reader.notify(peer, b"done with job-1")
    assert notifications_within(holder) == [("reader", b"done with job-1")]


# -- what cannot be read fails, at once -------------------------------------------------------


def test_agents_with_nothing_to_move_leave_the_cpu_idle(agents):
    reader, holder = agents
    source, into = kv(torch.float32, seed=5), torch.zeros(KV_SHAPE)
    holder.register(source)
    reader.register(into)
    reader.read(reader.connect(holder.metadata), source.data_ptr(), into, notify=b"warm")
    notifications_within(holder)

    cpu_before, wall_before = time.process_time(), time.monotonic()
    time.sleep(1.0)
    busy = (time.process_time() - cpu_before) / (time.monotonic() - wall_before)
    assert busy < 0.2, f"two idle agents kept {busy:.2f} of a core busy"  # a spinning progress thread: ~1 each


def test_a_read_from_an_unknown_peer_fails(agents):
    reader, _ = agents
    into = torch.zeros(1024, dtype=torch.uint8)
    reader.register(into)
    with pytest.raises(TransferFailed, match="unknown peer"):
        reader.read("nobody", 0x1000, into, timeout_s=1.0)


def test_a_read_outside_the_peers_registered_memory_fails(agents):
    reader, holder = agents
    registered, unregistered, into = (torch.ones(MiB, dtype=torch.uint8) for _ in range(3))
    holder.register(registered)
    reader.register(into)
    peer = reader.connect(holder.metadata)
    start = time.monotonic()
    with pytest.raises(TransferFailed):
        reader.read(peer, unregistered.data_ptr(), into, timeout_s=1.0)
    with pytest.raises(TransferFailed):  # starts inside, runs past the end
        reader.read(peer, registered.data_ptr() + MiB // 2, into, timeout_s=1.0)
    assert time.monotonic() - start < 1.0


def test_a_read_into_unregistered_local_memory_fails(agents):
    reader, holder = agents
    source = torch.ones(MiB, dtype=torch.uint8)
    holder.register(source)
    peer = reader.connect(holder.metadata)
    with pytest.raises(TransferFailed):
        reader.read(peer, source.data_ptr(), torch.zeros(MiB, dtype=torch.uint8), timeout_s=1.0)


def test_a_read_past_its_deadline_fails_and_leaves_the_agent_usable(monkeypatch):
    # A same-host read over shared memory ends within the call that posts it; over TCP it
    # takes long enough to pass a deadline of zero. UCX reads the variable as an agent starts.
    monkeypatch.setenv("UCX_TLS", "tcp")
    reader, holder = KVTransferAgent("reader"), KVTransferAgent("holder")
    try:
        source, into = torch.ones(64 * MiB, dtype=torch.uint8), torch.zeros(64 * MiB, dtype=torch.uint8)
        holder.register(source)
        reader.register(into)
        peer = reader.connect(holder.metadata)
        with pytest.raises(TransferFailed, match="took over"):
            reader.read(peer, source.data_ptr(), into, timeout_s=0.0)
        reader.read(peer, source.data_ptr(), into[:MiB], timeout_s=5.0)
        assert bool((into[:MiB] == 1).all())
    finally:
        reader.close()
        holder.close()


# -- across two processes -------------------------------------------------------------------


def hold_kv(connection, seed: int) -> None:
    """The child: a registered KV tensor, kept until the parent has read it and says go."""
    agent = KVTransferAgent("prefill-child")
    source = kv(torch.bfloat16, seed)
    agent.register(source)
    connection.send((agent.metadata, source.data_ptr()))
    connection.send(notifications_within(agent, 10.0))
    connection.recv()


def test_a_process_reads_another_process_kv_and_fails_fast_once_that_process_is_gone():
    parent_end, child_end = multiprocessing.get_context("spawn").Pipe()
    child = multiprocessing.get_context("spawn").Process(target=hold_kv, args=(child_end, 3))
    child.start()
    reader = KVTransferAgent("decode-parent")
    try:
        into = torch.zeros(KV_SHAPE, dtype=torch.bfloat16)
        reader.register(into)
        assert parent_end.poll(60), "the child never sent its metadata"
        metadata, address = parent_end.recv()
        peer = reader.connect(metadata)
        reader.read(peer, address, into, notify=b"job-7")
        assert torch.equal(into.view(torch.int16), kv(torch.bfloat16, seed=3).view(torch.int16))
        assert parent_end.recv() == [("decode-parent", b"job-7")]

        parent_end.send("go")
        child.join(10)
        assert child.exitcode == 0
        start = time.monotonic()
        with pytest.raises(TransferFailed):
            reader.read(peer, address, into, timeout_s=5.0)
        assert time.monotonic() - start < 2.5  # the disconnect is known, not waited out
    finally:
        reader.close()
        if child.is_alive():
            child.kill()


# -- the handoff arena's bookkeeping --------------------------------------------------------


def test_a_reservation_is_a_tensor_of_that_shape_and_dtype_at_an_aligned_address():
    arena = HandoffArena(None, MiB, hold_s=10.0)
    slot = arena.reserve("a", (3, 5), torch.bfloat16, now=0.0)
    assert slot.shape == (3, 5) and slot.dtype == torch.bfloat16 and slot.is_contiguous()
    assert arena.view("a") is slot
    assert arena.address("a") == slot.data_ptr() and arena.address("a") % 64 == 0
    assert arena.slot_bytes("a") == 64  # 30 bytes, rounded up to the alignment
    assert (arena.num_held, arena.bytes_held, arena.num_bytes) == (1, 64, MiB)


def test_a_handoff_reserved_twice_is_refused():
    arena = HandoffArena(None, MiB, hold_s=10.0)
    arena.reserve("a", (4,), torch.float32, now=0.0)
    with pytest.raises(ValueError):
        arena.reserve("a", (4,), torch.float32, now=0.0)


def test_a_full_arena_refuses_and_a_released_slot_is_reused():
    arena = HandoffArena(None, 4096, hold_s=10.0)
    slots = [arena.reserve(name, (256,), torch.float32, now=0.0) for name in "abcd"]
    assert arena.reserve("e", (1,), torch.uint8, now=0.0) is None
    address_of_b = arena.address("b")
    assert arena.release("b")
    assert arena.reserve("e", (256,), torch.float32, now=0.0) is not None
    assert arena.address("e") == address_of_b
    for slot, value in zip(slots, (1.0, 2.0, 3.0, 4.0)):
        slot.fill_(value)
    assert [float(arena.view(name)[0]) for name in "acde"] == [1.0, 3.0, 4.0, 2.0]


def test_neighbouring_free_ranges_join_into_one():
    arena = HandoffArena(None, 4096, hold_s=10.0)
    for name in "abcd":
        arena.reserve(name, (1024,), torch.uint8, now=0.0)
    arena.release("b")
    arena.release("d")
    assert arena.reserve("big", (2048,), torch.uint8, now=0.0) is None
    arena.release("c")
    assert arena.reserve("big", (3072,), torch.uint8, now=0.0) is not None


def test_a_late_or_repeated_release_is_harmless():
    arena = HandoffArena(None, 4096, hold_s=10.0)
    arena.reserve("a", (16,), torch.uint8, now=0.0)
    assert arena.release("a") is True
    assert arena.release("a") is False
    assert arena.release("never-reserved") is False
    assert arena.num_held == 0 and arena.bytes_held == 0


def test_handoffs_held_longer_than_hold_s_expire():
    arena = HandoffArena(None, 4096, hold_s=10.0)
    arena.reserve("early", (16,), torch.uint8, now=100.0)
    arena.reserve("late", (16,), torch.uint8, now=105.0)
    assert arena.expire(now=110.0) == []
    assert arena.expire(now=110.5) == ["early"]
    assert arena.num_held == 1 and arena.release("early") is False
    assert arena.expire(now=115.5) == ["late"]
    assert arena.num_held == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(1, 900)), max_size=60))
def test_live_slots_never_overlap_and_all_space_returns(operations):
    arena = HandoffArena(None, 8192, hold_s=10.0)
    live: set[str] = set()
    for is_reserve, key, num_bytes in operations:
        name = f"h{key}"
        if is_reserve and name not in live:
            if arena.reserve(name, (num_bytes,), torch.uint8, now=0.0) is not None:
                live.add(name)
        elif not is_reserve:
            assert arena.release(name) is (name in live)
            live.discard(name)
        ranges = sorted((arena.address(name), arena.address(name) + arena.slot_bytes(name)) for name in live)
        assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))
        assert all(start % 64 == 0 for start, _ in ranges)
        assert arena.bytes_held == sum(end - start for start, end in ranges)
    for name in live:
        arena.release(name)
    assert arena.reserve("everything", (8192,), torch.uint8, now=0.0) is not None
