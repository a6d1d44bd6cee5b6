"""The test suite (`make test`): real Redis, the real model, real Prometheus. Test-only
code lives here too, e.g. the CPU emulation of the CUDA kernels (`cuda_emulator/`)."""
