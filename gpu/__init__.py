"""The kernels under the engine: the paged KV cache, its host pool, and attention.

`attention.py` is the backend interface, `backends.py` picks one, `torch_attention.py`
is the reference every backend is tested against. The CPU path is in `cpu/` (C++
kernels built with g++, fused ops, packed linears), the CUDA path in `cuda/` (CuPy
RawKernels compiled by NVRTC). Imports none of the other packages.
"""
