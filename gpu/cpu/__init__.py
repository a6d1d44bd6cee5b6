"""The CPU path: C++ kernels (`kernels/*.cpp`) built with g++ for this CPU and cached
(`native_build.py`), the paged decode attention that uses them (`attention.py`), fused
norms and MLPs (`fusions.py`), oneDNN linears with packed weights (`packed_linear.py`)
and the lean forward of Llama-family stacks (`lean_forward.py`)."""
