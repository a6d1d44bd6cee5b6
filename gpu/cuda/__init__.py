"""The CUDA path: kernels in CUDA C (`kernels/*.cu`), instantiated and compiled by NVRTC
through CuPy (`source.py`, `cupy_kernels.py`), the attention backend that launches
them (`attention.py`) and the CUDA graphs decode steps replay (`graphs.py`). cupy itself
is imported only when a GPU is used."""
