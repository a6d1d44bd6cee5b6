"""The CPU path: C++ kernels (`kernels/*.cpp`) built with g++ for this CPU and cached
(`native_build.py`), the paged decode attention that uses them (`attention.py`), fused
norms and MLPs (`fusions.py`), oneDNN linears with packed weights (`packed_linear.py`),
int8 and int4 weights (`int8_linear.py`, `int4_linear.py`), the lean forward of
Llama-family stacks (`lean_forward.py`), its int4 decode step in one C++ call
(`int4_decode.py`), and the order they are put in place (`prepare.py`)."""
