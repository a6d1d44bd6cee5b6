"""The kernels under the engine: the paged KV cache, its host pool, and attention.

`prepare.py` prepares a model for its device in one call (cache, backend, module swaps,
forward, graphs). `attention.py` is the backend interface, `backends.py` picks one,
`torch_attention.py` is the reference every backend is tested against. The CPU path is
in `cpu/` (C++ kernels built with g++, fused ops, packed and quantized linears, the lean
forward), the CUDA path in `cuda/` (CuPy RawKernels compiled by NVRTC, decode graphs).
Imports none of the other packages.
"""
