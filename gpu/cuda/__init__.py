"""The CUDA path: kernels in CUDA C (`kernels/*.cu`), instantiated and compiled by NVRTC
through CuPy (`source.py`, `cupy_kernels.py`), and the attention backend that launches
them (`attention.py`). cupy itself is imported only when a GPU is used."""
