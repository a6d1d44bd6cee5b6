"""Moving staged KV between worker processes for disaggregated prefill and decode (issue 37).

The transfer engine is NIXL rather than Mooncake's transfer engine: NIXL is what vLLM's
NixlConnector and NVIDIA Dynamo move KV with. On a GPU deployment the same API moves GPU
memory over NVLink or RDMA through UCX by registering "VRAM" instead of "DRAM"; only the
memory type changes.

This layer knows memory, not requests. `KVTransferAgent` is a worker process's one NIXL
agent: `read` copies a peer's registered memory into its own and, once every byte is
there, delivers the peer a notification; or it raises `TransferFailed` (a NIXL error, an
unknown peer, an unregistered range, a deadline passed) and leaves no transfer running.
`HandoffArena` is a registered host buffer where a worker keeps staged KV: the prefill
side until the decode side confirms or `hold_s` passes, the decode side while it reads.
"""

from __future__ import annotations

import bisect
import importlib.util
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the `disagg` extra: imported where it is used
    from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_xfer_handle

# Host memory; a GPU deployment registers and reads "VRAM" through the same calls.
MEMORY_TYPE = "DRAM"
# Between checks of a transfer still running (a same-host read mostly ends within the
# call that posts it): short against a read's time, long enough to leave the core to NIXL.
_POLL_S = 50e-6
_SLOT_ALIGNMENT = 64
# The UCX progress thread's poll() timeout, in microseconds. It sleeps on UCX's event fd and
# wakes for any message, so this bounds only its idle rounds. NIXL's Python wrapper passes 0,
# which turns poll() into a spin that keeps a core busy in an idle worker.
_PROGRESS_TIMEOUT_US = 100_000
_agent_construction = threading.Lock()


class TransferFailed(RuntimeError):
    """A read did not complete: the destination holds no usable bytes."""


def transfer_available() -> bool:
    """Whether NIXL (the `disagg` extra, `nixl-cu12`) is installed."""
    return importlib.util.find_spec("nixl_cu12") is not None


class KVTransferAgent:
    """One NIXL agent per worker process, on the UCX backend.

    Peers learn `metadata` out of band and `connect` to it; the metadata lists the memory
    registered when it was taken, so register before publishing it. Safe to call from
    several threads; a read releases the GIL while it copies. NIXL's errors share no base
    class but Exception, so the calls into NIXL wrap any Exception in `TransferFailed`.
    """

    def __init__(self, name: str) -> None:
        from nixl_cu12 import nixl_agent_config, nixl_thread_sync_t

        # NIXL logs every agent and backend it creates at INFO, to stdout.
        logging.getLogger("nixl").setLevel(logging.WARNING)
        # Strict: the event loop thread may poll notifications while the torch thread reads.
        config = nixl_agent_config(backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.name = name
        self._agent: nixl_agent | None = _quiet_nixl_agent(name, config)
        self._registrations: list[tuple[torch.Tensor, object]] = []
        # Keyed by the metadata itself: a peer that registers more memory publishes new
        # metadata under the same name, which must be loaded again.
        self._peer_names: dict[bytes, str] = {}

    @property
    def metadata(self) -> bytes:
        """What a peer passes to `connect` to read from this agent."""
        return self._live.get_agent_metadata()

    @property
    def _live(self) -> nixl_agent:
        if self._agent is None:
            raise RuntimeError(f"the KV transfer agent {self.name} is closed")
        return self._agent

    def register(self, tensor: torch.Tensor) -> None:
        """Make a contiguous CPU tensor's memory readable by peers (and a read's destination)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("only a contiguous CPU tensor can be registered")
        region = [(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0, "")]
        descriptors = self._live.register_memory(region, MEMORY_TYPE)
        self._registrations.append((tensor, descriptors))  # the tensor must outlive its registration

    def connect(self, peer_metadata: bytes) -> str:
        """Load a peer's metadata (once per distinct metadata) and return the peer's name."""
        name = self._peer_names.get(peer_metadata)
        if name is None:
            try:
                # The binding hands back bytes, though nixl annotates the name as str.
                name = self._live.add_remote_agent(peer_metadata).decode()  # type: ignore[attr-defined]
            except Exception as error:
                raise TransferFailed(f"bad peer metadata: {error}") from error
            self._peer_names = {md: peer for md, peer in self._peer_names.items() if peer != name}
            self._peer_names[peer_metadata] = name
        return name

    def read(
        self, peer: str, remote_address: int, into: torch.Tensor, notify: bytes = b"", timeout_s: float = 10.0
    ) -> None:
        """Copy `into`'s size in bytes from the peer's memory at `remote_address` into `into`.

        `into` must lie in memory registered here. On success the peer receives `notify`
        (an empty one sends nothing).
        """
        if peer not in self._peer_names.values():
            raise TransferFailed(f"unknown peer {peer!r}: connect to it first")
        num_bytes = into.numel() * into.element_size()
        if into.device.type != "cpu" or not into.is_contiguous() or num_bytes == 0:
            raise ValueError("a read goes into a non-empty contiguous CPU tensor")
        # One descriptor: splitting a large read into several in one transfer was no faster.
        agent = self._live
        local = agent.get_xfer_descs([(into.data_ptr(), num_bytes, 0)], MEMORY_TYPE)
        remote = agent.get_xfer_descs([(remote_address, num_bytes, 0)], MEMORY_TYPE)
        try:
            handle = agent.initialize_xfer("READ", local, remote, peer, notify)
        except Exception as error:  # NIXL_ERR_NOT_FOUND: either side's range is not registered
            raise TransferFailed(f"cannot read {num_bytes} bytes at {remote_address:#x} from {peer!r}") from error
        try:
            state = self._wait(handle, time.monotonic() + timeout_s)
        except Exception as error:  # e.g. NIXL_ERR_REMOTE_DISCONNECT: the peer went away
            raise TransferFailed(f"read of {num_bytes} bytes from {peer!r} failed: {error}") from error
        finally:
            try:
                agent.release_xfer_handle(handle)  # cancels a transfer still running
            except Exception:
                pass  # NIXL keeps a handle it could not release and retries when the agent goes
        if state == "PROC":
            raise TransferFailed(f"read of {num_bytes} bytes from {peer!r} took over {timeout_s} s")
        if state != "DONE":
            raise TransferFailed(f"read of {num_bytes} bytes from {peer!r} failed")

    def _wait(self, handle: nixl_xfer_handle, deadline: float) -> str:
        """The transfer's state once it is no longer in progress, or at the deadline."""
        state = self._live.transfer(handle)
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            state = self._live.check_xfer_state(handle)
        return state

    def notify(self, peer: str, message: bytes) -> None:
        """Send a peer a message outside any transfer (e.g. a confirmation)."""
        try:
            self._live.send_notif(peer, message)
        except Exception as error:
            raise TransferFailed(f"cannot notify {peer!r}") from error

    def notifications(self) -> list[tuple[str, bytes]]:
        """(peer name, message) for each message received since the last call."""
        received = self._live.get_new_notifs()
        return [(peer, message) for peer, messages in received.items() for message in messages]

    def close(self) -> None:
        """Forget the peers, deregister the memory and drop the agent (its threads and sockets go with it)."""
        agent = self._agent
        if agent is None:
            return
        for name in set(self._peer_names.values()):
            agent.remove_remote_agent(name)
        self._peer_names.clear()
        for _, descriptors in self._registrations:
            agent.deregister_memory(descriptors)
        self._registrations.clear()
        self._agent = None


def _quiet_nixl_agent(name: str, config: nixl_agent_config) -> nixl_agent:
    """A `nixl_agent` whose progress thread blocks while idle.

    The wrapper builds its binding config itself and sets `pthrDelay = 0`; it exposes no
    parameter for it, so the binding's config class is swapped, for this construction only,
    for one that keeps `_PROGRESS_TIMEOUT_US`.
    """
    from nixl_cu12 import _api
    from nixl_cu12 import nixl_agent as make_agent

    binding_config = _api.nixlBind.nixlAgentConfig

    class PatientConfig(_api.nixlBind.nixlAgentConfig):
        @property
        def pthrDelay(self) -> int:
            return binding_config.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _: int) -> None:
            binding_config.pthrDelay.__set__(self, _PROGRESS_TIMEOUT_US)

    with _agent_construction:
        _api.nixlBind.nixlAgentConfig = PatientConfig
        try:
            return make_agent(name, config)
        finally:
            _api.nixlBind.nixlAgentConfig = binding_config


@dataclass
class _Slot:
    offset: int
    num_bytes: int
    reserved_at: float
    tensor: torch.Tensor


class HandoffArena:
    """A fixed registered host buffer holding each handoff's staged KV until released.

    Slots are 64-byte aligned, placed first fit. A slot's tensor must not be used after its
    handoff is released or expired. Thread-safe: the engine stages into it on the torch
    thread while confirmations release slots on the event loop thread.
    """

    def __init__(self, agent: KVTransferAgent | None, num_bytes: int, hold_s: float) -> None:
        self._buffer = torch.empty(num_bytes, dtype=torch.uint8)
        # Bytes below this have been written once, so their pages are mapped: a read into
        # pages never touched waits on a page fault per 4 KiB, several times slower than
        # the copy, so `reserve` maps a new slot's pages first, with one quick memset.
        self._mapped = 0
        if agent is not None:
            agent.register(self._buffer)
        self._hold_s = hold_s
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, num_bytes)]  # (offset, length), by offset, never adjacent
        self._slots: dict[str, _Slot] = {}

    @property
    def num_bytes(self) -> int:
        return self._buffer.numel()

    @property
    def num_held(self) -> int:
        return len(self._slots)

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return sum(slot.num_bytes for slot in self._slots.values())

    def reserve(self, handoff_id: str, shape: tuple[int, ...], dtype: torch.dtype, now: float) -> torch.Tensor | None:
        """A contiguous tensor of that shape and dtype in the arena, or None when none fits."""
        data_bytes = math.prod(shape) * dtype.itemsize
        # Aligned, and never empty, so every slot has an address of its own.
        slot_bytes = max(_SLOT_ALIGNMENT, -(-data_bytes // _SLOT_ALIGNMENT) * _SLOT_ALIGNMENT)
        with self._lock:
            if handoff_id in self._slots:
                raise ValueError(f"handoff {handoff_id!r} is already reserved")
            for index, (offset, length) in enumerate(self._free):
                if length >= slot_bytes:
                    if length == slot_bytes:
                        del self._free[index]
                    else:
                        self._free[index] = (offset + slot_bytes, length - slot_bytes)
                    if offset + slot_bytes > self._mapped:
                        self._buffer[max(offset, self._mapped) : offset + slot_bytes].zero_()
                        self._mapped = offset + slot_bytes
                    tensor = self._buffer[offset : offset + data_bytes].view(dtype).view(shape)
                    self._slots[handoff_id] = _Slot(offset, slot_bytes, now, tensor)
                    return tensor
        return None

    def view(self, handoff_id: str) -> torch.Tensor:
        """The tensor `reserve` gave for this handoff."""
        return self._slots[handoff_id].tensor

    def address(self, handoff_id: str) -> int:
        """Where a peer reads this handoff's slot."""
        return self._buffer.data_ptr() + self._slots[handoff_id].offset

    def slot_bytes(self, handoff_id: str) -> int:
        return self._slots[handoff_id].num_bytes

    def release(self, handoff_id: str) -> bool:
        """Free a handoff's slot; False when it is not held (a late or repeated confirmation)."""
        with self._lock:
            return self._release(handoff_id)

    def expire(self, now: float) -> list[str]:
        """Release, and name, the handoffs held longer than `hold_s`."""
        with self._lock:
            expired = [name for name, slot in self._slots.items() if now - slot.reserved_at > self._hold_s]
            for handoff_id in expired:
                self._release(handoff_id)
        return expired

    def _release(self, handoff_id: str) -> bool:
        slot = self._slots.pop(handoff_id, None)
        if slot is None:
            return False
        start, end = slot.offset, slot.offset + slot.num_bytes
        index = bisect.bisect(self._free, (start,))
        if index < len(self._free) and self._free[index][0] == end:  # merge with the range after
            end += self._free.pop(index)[1]
        if index > 0 and sum(self._free[index - 1]) == start:  # and with the range before
            index -= 1
            start = self._free.pop(index)[0]
        self._free.insert(index, (start, end - start))
        return True
