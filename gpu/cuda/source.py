"""The CUDA kernels as NVRTC sees them: source files, compile options and every
template instantiation (by name expression), with each kernel's parameter list.

This is the one place that turns `gpu/cuda/kernels/*.cu` plus template arguments into what
gets compiled. The worker's `cupy.RawModule` loading (`gpu/cuda/cupy_kernels.py`), the
NVRTC compile check (`tests/gpu/test_cuda_compile.py`) and the CPU emulation
(`tests/cuda_emulator/`) all read it, so they build the same kernels.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

KERNEL_DIR = Path(__file__).parent / "kernels"

# torch dtype -> the kernels' element type (16-bit floats are carried as bits, see common.cuh).
ELEMENT_TYPES = {torch.float16: "half_t", torch.bfloat16: "bfloat16_t", torch.float32: "float"}
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (16, 32)
# The decode kernel's longest partition (MAX_PARTITION in paged_attention.cu).
MAX_PARTITION = 512
THREADS = 128  # every kernel's block size (NUM_THREADS in paged_attention.cu)
MAX_GROUP = 8  # query heads a decode block serves per KV head (MAX_GROUP in paged_attention.cu)

# Parameter kinds: "ptr" a device (or mapped host) address, "i32", "i64", "f32".
# The attention kernels end with how the layer attends: window (0: none), softcap (0: none)
# and sinks (fp32 [num_heads], or 0), see `decode_slots` and paged_attention.cu.
_DECODE_PARAMS = (
    "out:ptr partial_out:ptr partial_max:ptr partial_sum:ptr query:ptr query_token_stride:i64 "
    "query_head_stride:i64 key_cache:ptr value_cache:ptr query_rows:ptr context_lens:ptr "
    "block_tables:ptr max_blocks:i32 num_heads:i32 num_kv_heads:i32 partition_size:i32 "
    "num_partitions:i32 scale:f32 window:i32 softcap:f32 sinks:ptr"
)
_REDUCE_PARAMS = (
    "out:ptr partial_out:ptr partial_max:ptr partial_sum:ptr query_rows:ptr context_lens:ptr "
    "num_heads:i32 partition_size:i32 num_partitions:i32 window:i32 sinks:ptr"
)
_PREFILL_PARAMS = (
    "out:ptr query:ptr query_token_stride:i64 query_head_stride:i64 key_cache:ptr value_cache:ptr "
    "tile_seqs:ptr tile_rows:ptr query_starts:ptr query_lens:ptr context_lens:ptr block_tables:ptr "
    "max_blocks:i32 num_heads:i32 num_kv_heads:i32 scale:f32 window:i32 softcap:f32 sinks:ptr"
)
_WRITE_PARAMS = (
    "key_cache:ptr value_cache:ptr key:ptr key_token_stride:i64 key_head_stride:i64 value:ptr "
    "value_token_stride:i64 value_head_stride:i64 slot_mapping:ptr num_kv_heads:i32 head_dim:i32"
)
_COPY_PARAMS = "dst:ptr src:ptr pairs:ptr src_blocks:i64 dst_blocks:i64 words_per_block:i64"


@dataclass(frozen=True)
class Kernel:
    name: str  # the __global__ function (template) in `source`
    source: str  # file in KERNEL_DIR
    params: tuple[tuple[str, str], ...]  # (name, kind), in order

    @classmethod
    def of(cls, name: str, source: str, params: str) -> Kernel:
        pairs = (param.partition(":") for param in params.split())
        return cls(name, source, tuple((param, kind) for param, _, kind in pairs))


DECODE = Kernel.of("paged_decode_attention", "paged_attention.cu", _DECODE_PARAMS)
DECODE_REDUCE = Kernel.of("paged_decode_reduce", "paged_attention.cu", _REDUCE_PARAMS)
PREFILL = Kernel.of("paged_prefill_attention", "paged_attention.cu", _PREFILL_PARAMS)
WRITE_KV = Kernel.of("write_kv_cache", "cache_ops.cu", _WRITE_PARAMS)
COPY_BLOCKS = Kernel.of("copy_kv_blocks", "cache_ops.cu", _COPY_PARAMS)
SOURCES = ("paged_attention.cu", "cache_ops.cu")


@dataclass(frozen=True)
class Instantiation:
    kernel: Kernel
    template_args: tuple[str, ...]

    @property
    def name_expression(self) -> str:
        """What NVRTC's name expressions (and cupy's `get_function`) call it."""
        if not self.template_args:
            return self.kernel.name
        return f"{self.kernel.name}<{', '.join(self.template_args)}>"


def decode_slots(num_partitions: int, partition_size: int, window: int) -> int:
    """Partitions (the grid's z) a decode launch needs when contexts span up to
    `num_partitions` of `partition_size` tokens and a query sees its last `window` keys
    (0: all): the kernel counts partitions from the one that holds the window's first key,
    and `window` keys span at most (window + partition_size - 2) // partition_size + 1 of them."""
    if window <= 0:
        return num_partitions
    return min(num_partitions, (window + partition_size - 2) // partition_size + 1)


def prefill_rows(head_dim: int) -> int:
    """(query token, head) rows per prefill tile (prefill_rows() in paged_attention.cu)."""
    return 16 if head_dim <= 128 else 8


def decode(dtype: torch.dtype, head_dim: int, block_size: int) -> Instantiation:
    return Instantiation(DECODE, (ELEMENT_TYPES[dtype], str(head_dim), str(block_size)))


def decode_reduce(dtype: torch.dtype, head_dim: int) -> Instantiation:
    return Instantiation(DECODE_REDUCE, (ELEMENT_TYPES[dtype], str(head_dim)))


def prefill(dtype: torch.dtype, head_dim: int, block_size: int) -> Instantiation:
    return Instantiation(PREFILL, (ELEMENT_TYPES[dtype], str(head_dim), str(block_size)))


def write_kv(dtype: torch.dtype) -> Instantiation:
    return Instantiation(WRITE_KV, (ELEMENT_TYPES[dtype],))


def copy_blocks() -> Instantiation:
    return Instantiation(COPY_BLOCKS, ())


def instantiations(source: str | None = None) -> list[Instantiation]:
    """Every kernel the worker can launch, optionally only those of one source file."""
    found = [copy_blocks()]
    for dtype in ELEMENT_TYPES:
        found.append(write_kv(dtype))
        for head_dim in HEAD_DIMS:
            found.append(decode_reduce(dtype, head_dim))
            for block_size in BLOCK_SIZES:
                found += [decode(dtype, head_dim, block_size), prefill(dtype, head_dim, block_size)]
    return [i for i in found if source is None or i.kernel.source == source]


def supports(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    return dtype in ELEMENT_TYPES and head_dim in HEAD_DIMS and block_size in BLOCK_SIZES


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.MULTILINE)


def read_source(source: str) -> str:
    """The program text of one source file, its local headers pasted in (they have
    include guards): one self-contained string, so cupy's compile cache, keyed on the
    text, sees a change to a header too."""
    return _LOCAL_INCLUDE.sub(lambda m: read_source(m.group(1)), (KERNEL_DIR / source).read_text())


def nvrtc_options() -> tuple[str, ...]:
    """Options for every compile; the caller adds the target architecture (cupy picks
    the device's)."""
    return ("-std=c++17",)
