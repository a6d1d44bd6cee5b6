"""Loads the CUDA kernels with `cupy.RawModule` (NVRTC) and launches them on torch's
current stream.

Arguments are torch tensors (passed by address: no copies, no conversion) and plain
numbers, typed by each kernel's parameter list in `gpu.cuda.source`. A pinned host
tensor is passed by its device-side (mapped) address, which is how the swap kernel
reaches the host pool.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu.cuda import source as cuda_source
from gpu.cuda.source import Instantiation

_NUMPY_TYPES = {"i32": np.int32, "i64": np.int64, "f32": np.float32, "ptr": np.uint64}


def cupy_available() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


class CupyKernels:
    def __init__(self, device: torch.device) -> None:
        import cupy

        self._cupy = cupy
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        with cupy.cuda.Device(self.device_index):
            # Compiled for this device now (a missing NVRTC fails at start, not at the first
            # step), then served from cupy's on-disk cache on later starts.
            modules = {
                source: cupy.RawModule(
                    code=cuda_source.read_source(source),
                    options=cuda_source.nvrtc_options(),
                    name_expressions=[i.name_expression for i in cuda_source.instantiations(source)],
                )
                for source in cuda_source.SOURCES
            }
            self._functions = {
                instance: modules[instance.kernel.source].get_function(instance.name_expression)
                for instance in cuda_source.instantiations()
            }

    def launch(self, instance: Instantiation, grid: tuple[int, ...], block: int, args: list) -> None:
        params = instance.kernel.params
        if len(args) != len(params):
            raise TypeError(f"{instance.name_expression} takes {len(params)} arguments, got {len(args)}")
        function = self._functions[instance]
        values = tuple(
            _NUMPY_TYPES[kind](self._address(arg) if kind == "ptr" else arg) for arg, (_, kind) in zip(args, params)
        )
        stream = torch.cuda.current_stream(self.device_index)
        with self._cupy.cuda.Device(self.device_index), self._cupy.cuda.ExternalStream(stream.cuda_stream):
            function(tuple(grid), (block,), values)

    def _address(self, arg) -> int:
        if not isinstance(arg, torch.Tensor):
            return int(arg)
        if arg.is_cuda:
            return arg.data_ptr()
        # Pinned memory is mapped into the device's address space (unified addressing).
        attributes = self._cupy.cuda.runtime.pointerGetAttributes(arg.data_ptr())
        if not arg.is_pinned() or not attributes.devicePointer:
            raise ValueError("a host tensor reaches a kernel only if it is pinned (and so mapped)")
        return attributes.devicePointer
