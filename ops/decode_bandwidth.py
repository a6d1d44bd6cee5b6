"""Decode-attention micro-benchmark on a GPU: achieved bandwidth (K/V bytes read / time)
of the paged decode kernel against the device's peak, next to torch SDPA over the
same K/V gathered into a dense batch (timed with and without the gather).

    python ops/decode_bandwidth.py [--batch 64 --context 4096 --head-dim 128 --heads 32 --kv-heads 8]

Prints one JSON line; exits 2 when the kernel falls short of --target (a share of peak).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu.attention import SequenceSlice  # noqa: E402
from gpu.cuda.attention import CupyAttentionBackend  # noqa: E402
from gpu.kv_cache import KVShape, PagedKVCache  # noqa: E402


def peak_bandwidth(device: torch.device) -> float:
    """Bytes/s from the memory clock and bus width (double data rate)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device.index or 0)
    return 2 * props["memoryClockRate"] * 1e3 * props["memoryBusWidth"] / 8


def timed(fn, iterations: int) -> float:
    """Mean seconds per call, after warming up."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iterations


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--peak-gbps", type=float, help="the device's peak bandwidth, if its properties mislead")
    parser.add_argument("--target", type=float, default=0.70)
    args = parser.parse_args()

    device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    blocks_per_seq = -(-args.context // args.block_size)
    cache = PagedKVCache(KVShape(1, args.kv_heads, args.head_dim), args.batch * blocks_per_seq + 1, args.block_size,
                         dtype, device)  # fmt: skip
    cache.blocks.normal_()
    ids = list(range(1, cache.num_blocks))
    random.Random(0).shuffle(ids)  # scattered blocks, as a long-running server has them
    sequences = [
        SequenceSlice(i, 1, args.context, ids[i * blocks_per_seq : (i + 1) * blocks_per_seq]) for i in range(args.batch)
    ]
    query = torch.randn(args.batch, args.heads, args.head_dim, dtype=dtype, device=device)
    key = torch.randn(args.batch, args.kv_heads, args.head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    scale = args.head_dim**-0.5

    backend = CupyAttentionBackend(cache)
    metadata = backend.prepare(sequences, args.batch)
    kernel_s = timed(lambda: backend.attend(0, query, key, value, scale, metadata), args.iterations)
    kernel_out = backend.attend(0, query, key, value, scale, metadata)

    table = torch.tensor([s.block_table for s in sequences], device=device)
    pool_k = cache.blocks[0, 0]  # [blocks, block_size, kv_heads, head_dim]
    pool_v = cache.blocks[0, 1]

    def gather():
        k = pool_k[table].view(args.batch, -1, args.kv_heads, args.head_dim)[:, : args.context].transpose(1, 2)
        v = pool_v[table].view(args.batch, -1, args.kv_heads, args.head_dim)[:, : args.context].transpose(1, 2)
        return k.contiguous(), v.contiguous()

    k, v = gather()
    q = query.unsqueeze(2)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    sdpa_s = timed(sdpa, args.iterations)
    gather_sdpa_s = timed(lambda: F.scaled_dot_product_attention(q, *gather(), scale=scale, enable_gqa=True),
                          args.iterations)  # fmt: skip
    torch.testing.assert_close(kernel_out.float(), sdpa()[:, :, 0].float(), atol=2e-3, rtol=2e-2)

    kv_bytes = 2 * args.batch * args.context * args.kv_heads * args.head_dim * cache.blocks.element_size()
    peak = args.peak_gbps * 1e9 if args.peak_gbps else peak_bandwidth(device)
    report = {
        "device": torch.cuda.get_device_name(device),
        "shape": vars(args),
        "kv_bytes": kv_bytes,
        "peak_gbps": round(peak / 1e9, 1),
        "kernel_us": round(kernel_s * 1e6, 1),
        "kernel_gbps": round(kv_bytes / kernel_s / 1e9, 1),
        "kernel_share_of_peak": round(kv_bytes / kernel_s / peak, 3),
        "partitions": metadata.decode.num_partitions,
        "sdpa_gathered_us": round(sdpa_s * 1e6, 1),
        "sdpa_gathered_gbps": round(kv_bytes / sdpa_s / 1e9, 1),
        "gather_plus_sdpa_us": round(gather_sdpa_s * 1e6, 1),
    }
    print(json.dumps(report))
    met = report["kernel_share_of_peak"] >= args.target
    print(f"decode kernel: {report['kernel_gbps']} GB/s = {report['kernel_share_of_peak']:.0%} of peak "
          f"{report['peak_gbps']} GB/s ({'meets' if met else 'BELOW'} the {args.target:.0%} target); "
          f"SDPA on gathered K/V: {report['sdpa_gathered_gbps']} GB/s", file=sys.stderr)  # fmt: skip
    return 0 if met else 2


if __name__ == "__main__":
    sys.exit(main())
