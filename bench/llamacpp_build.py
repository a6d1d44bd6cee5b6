"""The CMake flags that build llama-cpp-python for this CPU (`python -m bench.llamacpp_build`
prints CMAKE_ARGS for `make llamacpp`): ggml's `-march=native` build segfaulted on a Xeon
with AMX, so the instruction sets are listed from /proc/cpuinfo; AMX stays off (its matmul
died of SIGILL at the first `tilezero`: docs/benchmarks.md, "llama.cpp as a peer")."""

from __future__ import annotations

import sys
from pathlib import Path

# ggml option -> the /proc/cpuinfo flags it needs, all of them.
_AVX512_BASE = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")  # ggml's -mavx512* set
GGML_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": _AVX512_BASE,
    "GGML_AVX512_VBMI": (*_AVX512_BASE, "avx512vbmi"),
    "GGML_AVX512_VNNI": (*_AVX512_BASE, "avx512_vnni"),
    "GGML_AVX512_BF16": (*_AVX512_BASE, "avx512_bf16"),
}
NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The instruction-set flags of the first processor in a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cmake_args(flags: set[str]) -> str:
    """CMAKE_ARGS for ggml with native detection off and every option set explicitly."""
    chosen = [f"-D{option}={'ON' if set(needed) <= flags else 'OFF'}" for option, needed in GGML_OPTIONS.items()]
    return " ".join(["-DGGML_NATIVE=OFF", *chosen, *(f"-D{option}=OFF" for option in NEVER)])


def main() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        sys.exit("llamacpp_build: no /proc/cpuinfo; set CMAKE_ARGS by hand (docs/benchmarks.md, 'llama.cpp as a peer')")
    print(cmake_args(cpu_flags(cpuinfo.read_text())))


if __name__ == "__main__":
    main()
