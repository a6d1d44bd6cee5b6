"""CPU emulation of the CUDA kernels: the same `.cu` sources, built with g++ against
`cuda_emulation.h` and launched through ctypes on CPU tensors (`EmulatedKernels`)."""

from tests.cuda_emulator.kernels import EmulatedKernels

__all__ = ["EmulatedKernels"]
