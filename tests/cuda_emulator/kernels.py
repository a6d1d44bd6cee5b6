"""Builds the kernels for the host and launches them like the GPU would.

The shared library holds one `extern "C"` entry per instantiation in
`gpu.cuda.source`, each taking a launch's grid, block and `void**` arguments (the
convention of cuLaunchKernel). It is built with g++ once per source hash and cached.
`EmulatedKernels.launch` has the signature of `gpu.cuda.cupy_kernels.CupyKernels.launch`,
so the attention backend runs unchanged on either.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from gpu.cpu.native_build import build_shared_library
from gpu.cuda import source as cuda_source
from gpu.cuda.source import Instantiation

HEADER = Path(__file__).parent / "cuda_emulation.h"
CXX_FLAGS = ("-std=c++20", "-O2", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing", "-w")
_C_TYPES = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float, "ptr": ctypes.c_void_p}


_CONVERSIONS = {
    "to_float16": ("float", "unsigned short", "float_to_half_bits"),
    "to_bfloat16": ("float", "unsigned short", "float_to_bfloat16_bits"),
    "from_float16": ("unsigned short", "float", "half_bits_to_float"),
    "from_bfloat16": ("unsigned short", "float", "bfloat16_bits_to_float"),
}


def _wrapper_source(instances: list[Instantiation]) -> str:
    """The emulation header, the program text NVRTC compiles, and the entry points."""
    lines = [f'#include "{HEADER}"']
    lines += [cuda_source.read_source(source) for source in cuda_source.SOURCES]
    # The 16-bit conversions, so the tests can hold them to torch's bit for bit.
    for name, (arg, result, function) in _CONVERSIONS.items():
        lines.append(
            f'extern "C" void {name}(const {arg}* in, {result}* out, long n) '
            f"{{ for (long i = 0; i < n; ++i) out[i] = {function}(in[i]); }}"
        )
    for index, instance in enumerate(instances):
        lines.append(
            f'extern "C" void emulated_{index}(const unsigned* grid, const unsigned* block, void** args) '
            f"{{ emu::launch(&{instance.name_expression}, grid, block, args); }}"
        )
    return "\n".join(lines) + "\n"


def build(instances: list[Instantiation]) -> Path:
    """The shared library for `instances` (built now unless cached)."""
    return build_shared_library("kernels", _wrapper_source(instances), CXX_FLAGS, includes=(HEADER,))


class EmulatedKernels:
    """Launches kernels on the host over CPU tensors."""

    def __init__(self, instances: list[Instantiation] | None = None) -> None:
        self.instances = instances or cuda_source.instantiations()
        library = ctypes.CDLL(str(build(self.instances)))
        self._library = library
        self._entries = {}
        for index, instance in enumerate(self.instances):
            entry = getattr(library, f"emulated_{index}")
            entry.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
            entry.restype = None
            self._entries[instance] = entry

    def launch(self, instance: Instantiation, grid: tuple[int, ...], block: int, args: list) -> None:
        params = instance.kernel.params
        if len(args) != len(params):
            raise TypeError(f"{instance.name_expression} takes {len(params)} arguments, got {len(args)}")
        values = [_C_TYPES[kind](_address(arg) if kind == "ptr" else arg) for arg, (_, kind) in zip(args, params)]
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        grid3 = (ctypes.c_uint * 3)(*(tuple(grid) + (1, 1, 1))[:3])
        block3 = (ctypes.c_uint * 3)(block, 1, 1)
        self._entries[instance](grid3, block3, pointers)

    def convert(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`x` (float32 to a 16-bit dtype, or back) through the emulation's conversion."""
        x = x.contiguous()
        if x.dtype == torch.float32:
            name, out = f"to_{str(dtype).removeprefix('torch.')}", torch.empty(x.shape, dtype=dtype)
        else:
            name, out = f"from_{str(x.dtype).removeprefix('torch.')}", torch.empty(x.shape, dtype=torch.float32)
        getattr(self._library, name)(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                                     ctypes.c_long(x.numel()))  # fmt: skip
        return out


def _address(arg) -> int:
    if isinstance(arg, torch.Tensor):
        if arg.device.type != "cpu":
            raise ValueError("the emulated kernels read host memory only")
        return arg.data_ptr()
    return int(arg)
