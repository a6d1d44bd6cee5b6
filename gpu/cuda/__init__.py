"""The CUDA path: kernels in CUDA C (`kernels/*.cu`), instantiated and compiled by NVRTC
through CuPy (`source.py`, `cupy_kernels.py`), and the attention backend that launches
them (`attention.py`). Only imported where a GPU and cupy are present."""
