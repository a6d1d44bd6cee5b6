"""CUDA graphs for decode-only steps: a step whose every request runs one token is
replayed from a graph instead of launched kernel by kernel.

A graph fixes its tensors' addresses and its launches' grids, so:

- **Batch-size buckets.** A decode batch of n requests runs in the smallest bucket
  >= n (1, 2, 4, 8, then every 8 up to `max_batch`, and `max_batch` itself). The rows
  past n are padding: token 0 at position 0, slot -1 (the cache-write kernel skips it,
  so a padded row writes nothing), context 1 over block 0 (read, never written). Their
  logits are dropped; every op but attention works row by row, and attention reads
  each row's own context, so they change nothing in the real rows.
- **Static buffers.** Token ids, positions, slots, context lengths and block tables
  live in buffers allocated once, at the widest block table any context can need; a
  step fills them (one host-to-device copy each for the 64-bit and the 32-bit ones,
  from pinned staging) and replays.
- **Fixed partitioning.** The decode kernel splits contexts into partitions, one
  launch block each, and the grid has one z-slice per partition of the longest
  context. A graph therefore fixes the partition size and count; it is keyed by
  (bucket, partition size, partitions). The size follows the eager rule for the
  bucket (`CupyAttentionBackend.decode_partition_size`), the count is rounded up to a
  power of two. The kernel returns at once from a partition that starts past its
  sequence's context and the reduce step reads only the partitions a context covers,
  so a graph serves every context up to its partitions' reach. One graph for the
  longest possible context would instead launch every step with the partitions of
  the model's whole context, most of them empty; the power-of-two tiers keep that
  waste under half the grid, for a handful of graphs per bucket.
- **Layers that attend otherwise.** A sliding-window layer's launch has only the
  partitions its window can span (`gpu.cuda.source.decode_slots`), a softcap and a
  window are plain kernel arguments, baked into each layer's own launch; a layer's sinks
  reach the kernels as the backend's fp32 device copy of its sinks tensor, made on the
  warm-up forward and kept as long as the backend, so a graph's pointer to it stays good.
- **Captured when first needed.** A (bucket, partitioning) is captured the first time
  a step needs it (a warm-up forward on padding only, then the capture), so only the
  shapes a workload uses are captured, and start-up costs nothing. All graphs share
  one memory pool: they never run at once, and a replay's logits are read before the
  next replay.

Steps with prompt tokens, more than `max_batch` requests or a context past the
buffers run eagerly, as before. On a CPU (the tests, with the CUDA kernels emulated)
`capture=False` runs the same forward over the same static buffers without a graph,
which checks the buffers, the padding and the metadata without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from itertools import chain

import numpy as np
import torch

from gpu.attention import PagedBatch, SequenceSlice, long_tensor
from gpu.cuda.attention import CupyAttentionBackend, DecodeBatch, KernelMetadata

_log = logging.getLogger("inflight.graphs")

PAD_SLOT = -1  # the cache-write kernel writes nothing for this slot
PAD_BLOCK = 0  # what a padded row's one-token context reads


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every 8 up to
    `max_batch`, and `max_batch` itself."""
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    sizes = {size for size in (1, 2, 4) if size < max_batch}
    sizes.update(range(8, max_batch + 1, 8))
    sizes.add(max_batch)
    return tuple(sorted(sizes))


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `num_seqs` rows; None when none does."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


def partition_count(longest: int, partition_size: int, most: int) -> int:
    """Partitions a graph launches for contexts up to `longest` tokens: enough to cover
    them, rounded up to a power of two, at most `most`."""
    needed = -(-longest // partition_size)
    return min(1 << (needed - 1).bit_length(), most)


class StaticDecodeInputs:
    """The buffers a decode graph reads, and their filling.

    64-bit rows (token ids, positions, slots) and 32-bit ones (context lengths, then
    block tables `[max_batch, max_blocks]`) each sit in one device tensor, so a step's
    inputs take two copies from pinned host staging.
    """

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.device = device
        on_cuda = device.type == "cuda"
        self._host_long = torch.zeros((3, max_batch), dtype=torch.long, pin_memory=on_cuda)
        self._host_int = torch.zeros(max_batch * (1 + max_blocks), dtype=torch.int32, pin_memory=on_cuda)
        self._long = torch.zeros_like(self._host_long, device=device)
        self._int = torch.zeros_like(self._host_int, device=device)
        self.token_ids, self.positions, self.slot_mapping = self._long
        self.context_lens = self._int[:max_batch]
        self.block_tables = self._int[max_batch:].view(max_batch, max_blocks)
        self.query_rows = torch.arange(max_batch, dtype=torch.int32, device=device)  # row i is request i
        # The staging is rewritten only once the previous step's copies have read it.
        self._copied = torch.cuda.Event() if on_cuda else None

    def fits(self, sequences: Sequence[SequenceSlice]) -> bool:
        return len(sequences) <= self.max_batch and all(
            seq.context_len <= self.max_blocks * self.block_size for seq in sequences
        )

    def fill(
        self, token_ids: Sequence[int], positions: Sequence[int], sequences: Sequence[SequenceSlice], bucket: int
    ) -> None:
        """Rows [0, n) from the step's one-token sequences, rows [n, bucket) padding."""
        n, block_size = len(sequences), self.block_size
        if self._copied is not None:
            self._copied.synchronize()
        longs = self._host_long.numpy()
        ints = self._host_int.numpy()
        context_lens = np.fromiter((seq.context_len for seq in sequences), np.int64, n)
        used = -(-context_lens // block_size)  # blocks each context covers
        tables = ints[self.max_batch :].reshape(self.max_batch, self.max_blocks)
        flat = np.fromiter(chain.from_iterable(seq.block_table[:u] for seq, u in zip(sequences, used)), np.int32)
        rows = np.repeat(np.arange(n), used)
        tables[rows, np.arange(flat.size) - np.repeat(np.cumsum(used) - used, used)] = flat
        last_blocks = flat[np.cumsum(used) - 1].astype(np.int64)
        longs[0, :n] = token_ids
        longs[1, :n] = positions
        longs[2, :n] = last_blocks * block_size + (context_lens - 1) % block_size  # the new token's slot
        ints[:n] = context_lens
        longs[:, n:bucket] = np.array([[0], [0], [PAD_SLOT]])
        ints[n:bucket] = 1
        tables[n:bucket, 0] = PAD_BLOCK
        copied = self._copied  # an event on CUDA, None elsewhere
        on_cuda = copied is not None
        self._long.copy_(self._host_long, non_blocking=on_cuda)
        end = self.max_batch + bucket * self.max_blocks  # context lengths and the bucket's tables
        self._int[:end].copy_(self._host_int[:end], non_blocking=on_cuda)
        if copied is not None:
            copied.record(torch.cuda.current_stream(self.device))

    def metadata(self, bucket: int, partition_size: int, num_partitions: int) -> KernelMetadata:
        """The kernels' metadata over the first `bucket` rows of the buffers."""
        decode = DecodeBatch(
            self.query_rows[:bucket],
            self.context_lens[:bucket],
            self.block_tables[:bucket],
            partition_size,
            num_partitions,
        )
        return KernelMetadata(self.slot_mapping[:bucket], decode, None)


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> None:
        self.graph, self.logits = graph, logits

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


class _Uncaptured:
    """The CPU stand-in for a graph: the same forward over the same buffers, run each time."""

    def __init__(self, forward: Callable[[], torch.Tensor]) -> None:
        self.replay = forward


class DecodeGraphs:
    def __init__(self, model, backend: CupyAttentionBackend, max_batch: int, capture: bool | None = None) -> None:
        """`capture` None captures graphs on a GPU; False runs the forward over the
        static buffers without capturing (on a CPU, with the emulated kernels)."""
        self.model, self.backend = model, backend
        self.device = backend.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.buckets = graph_buckets(max_batch)
        cache = backend.kv_cache
        longest = getattr(model.config, "max_position_embeddings", None) or cache.num_blocks * cache.block_size
        max_blocks = min(-(-longest // cache.block_size), cache.num_blocks)
        self.inputs = StaticDecodeInputs(self.buckets[-1], max_blocks, cache.block_size, self.device)
        self._graphs: dict[tuple[int, int, int], _Captured | _Uncaptured] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0

    @property
    def captured(self) -> list[tuple[int, int, int]]:
        """(bucket, partition size, partitions) of every graph so far."""
        return list(self._graphs)

    def applies(self, sequences: Sequence[SequenceSlice]) -> bool:
        """A decode-only step (one new token per sequence) that the buffers hold."""
        return all(seq.query_len == 1 for seq in sequences) and self.inputs.fits(sequences)

    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        sequences: Sequence[SequenceSlice],
        sample_rows: Sequence[int],
    ) -> torch.Tensor:
        """The logits of `sample_rows` (rows of the batch, as the eager forward keeps them)."""
        bucket = bucket_for(len(sequences), self.buckets)
        if bucket is None:  # a batch `applies` turns down
            raise ValueError(f"no decode graph holds {len(sequences)} sequences")
        key = self.key(bucket, max(seq.context_len for seq in sequences))
        graph = self._graphs.get(key) or self._build(key)
        self.inputs.fill(token_ids, positions, sequences, bucket)
        logits = graph.replay()
        self.replays += 1
        return logits.index_select(0, long_tensor(sample_rows, self.device))

    def key(self, bucket: int, longest: int) -> tuple[int, int, int]:
        """(bucket, partition size, partitions) of the graph that runs `bucket` rows with
        contexts up to `longest` tokens."""
        size = self.backend.decode_partition_size(bucket, longest)
        most = -(-self.inputs.max_blocks * self.inputs.block_size // size)
        return bucket, size, partition_count(longest, size, most)

    def _build(self, key: tuple[int, int, int]) -> _Captured | _Uncaptured:
        bucket = key[0]
        batch = PagedBatch(self.backend, self.inputs.metadata(*key))

        def forward() -> torch.Tensor:
            return self.model(
                input_ids=self.inputs.token_ids[:bucket].unsqueeze(0),
                position_ids=self.inputs.positions[:bucket].unsqueeze(0),
                logits_to_keep=0,  # every row: which ones sample changes from step to step
                use_cache=False,
                paged_batch=batch,
            ).logits[0]

        if not self.capture:
            self._graphs[key] = _Uncaptured(forward)
            return self._graphs[key]
        started = time.perf_counter()
        self.inputs.fill((), (), (), bucket)  # padding only: the warm-up writes no K/V
        forward()  # lazy initialisation (cuBLAS handles, workspaces) happens outside the capture
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's capture-unsafe calls fail it, not another's.
        with (
            torch.cuda.device(self.device),
            torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"),
        ):
            logits = forward()
        self._graphs[key] = _Captured(graph, logits)
        _log.debug(
            "captured a decode graph: %d rows, %d partitions of %d tokens, in %.3f s",
            bucket,
            key[2],
            key[1],
            time.perf_counter() - started,
        )
        return self._graphs[key]


def decode_graphs(model, backend, max_batch: int) -> DecodeGraphs | None:
    """Decode graphs for `model` when `backend` runs the CUDA kernels on a GPU; else None."""
    if isinstance(backend, CupyAttentionBackend) and backend.device.type == "cuda":
        return DecodeGraphs(model, backend, max_batch)
    return None
