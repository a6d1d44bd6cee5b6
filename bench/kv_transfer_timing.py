"""`python -m bench.kv_transfer_timing`: NIXL READ throughput between two processes on one host.

A child process registers a host buffer (the prefill side's arena); the parent reads 1, 16,
64 and 256 MiB of it into a registered buffer of its own through `gpu.kv_transfer`, the
best of `--repeats` reads per size, after one read that sets the connection up. A local
`copy_` of the same size, timed alike, gives the host's memory bandwidth for scale. Needs
the `disagg` extra.
"""

from __future__ import annotations

import argparse
import multiprocessing
from multiprocessing.connection import Connection

import torch

from bench.metrics import in_turns
from gpu.kv_transfer import KVTransferAgent

SIZES_MIB = (1, 16, 64, 256)


def known_bytes(num_bytes: int) -> torch.Tensor:
    """Bytes both processes can make quickly: a scrambled counter."""
    return (torch.arange(num_bytes // 8, dtype=torch.int64) * 0x5851F42D4C957F2D).view(torch.uint8)


def hold_buffer(connection: Connection, num_bytes: int) -> None:
    """The child: a registered buffer of known bytes, read until the parent says stop."""
    agent = KVTransferAgent("holder")
    buffer = known_bytes(num_bytes)
    agent.register(buffer)
    connection.send((agent.metadata, buffer.data_ptr()))
    notifications = 0
    while not connection.poll(0.01):
        notifications += len(agent.notifications())
    connection.recv()
    connection.send(notifications + len(agent.notifications()))
    agent.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    num_bytes = max(SIZES_MIB) << 20
    parent_end, child_end = multiprocessing.get_context("spawn").Pipe()
    child = multiprocessing.get_context("spawn").Process(target=hold_buffer, args=(child_end, num_bytes))
    child.start()
    agent = KVTransferAgent("reader")
    into = torch.empty(num_bytes, dtype=torch.uint8)
    agent.register(into)
    expected = known_bytes(num_bytes)
    peer_metadata, remote_address = parent_end.recv()
    peer = agent.connect(peer_metadata)
    agent.read(peer, remote_address, into[: 1 << 20])  # sets the connection up
    print(f"{'MiB':>5} {'NIXL read GB/s':>15} {'local copy GB/s':>16}")
    for size_mib in SIZES_MIB:
        size = size_mib << 20
        source, target = expected[:size], torch.empty(size, dtype=torch.uint8)
        cases = {"read": lambda: agent.read(peer, remote_address, into[:size], notify=b"read"),
                 "copy": lambda: target.copy_(source)}  # fmt: skip
        best_ms = {name: min(wall for wall, _ in runs) for name, runs in in_turns(cases, args.repeats).items()}
        print(f"{size_mib:5d} {size / best_ms['read'] / 1e6:15.2f} {size / best_ms['copy'] / 1e6:16.2f}")
    if not torch.equal(into, expected):
        raise SystemExit("the bytes read differ from the child's")
    parent_end.send("stop")
    notifications = parent_end.recv()
    child.join()
    agent.close()
    print(f"best of {args.repeats}; {notifications} notifications reached the child")


if __name__ == "__main__":
    main()
