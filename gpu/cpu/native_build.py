"""Builds C++ into a shared library with g++, once per source and flags, cached on disk.

Used by the CPU kernels (`load_cpu_library`: decode attention, fused element-wise ops)
and the CPU emulation of the CUDA kernels (`tests.cuda_emulator`). The cache key covers the
source, the flags and, for builds tuned to this CPU (`-march=native`), the CPU's model
and feature flags, so a cache directory shared between machines never hands one machine
another's instructions.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

_log = logging.getLogger("inflight.native")

# The CPU kernels (`gpu/cpu/kernels/cpu_*.cpp`): built for this CPU, with OpenMP (torch's own
# runtime once loaded into this process, which already has torch's libgomp).
KERNELS = Path(__file__).parent / "kernels"
CPU_HEADERS = (KERNELS / "cpu_vector_math.h", KERNELS / "cpu_row_ops.h", KERNELS / "cpu_amx.h")
CPU_CXX_FLAGS = ("-std=c++17", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", f"-I{KERNELS}")
# Without -march=native: the portable loops, not the AVX2 ones (for testing both).
PORTABLE_CPU_CXX_FLAGS = tuple(flag for flag in CPU_CXX_FLAGS if flag != "-march=native")


def cache_dir() -> Path:
    root = os.environ.get("INFLIGHT_NATIVE_CACHE") or Path.home() / ".cache" / "inflight" / "native"
    return Path(root)


def cpu_identity() -> str:
    """This CPU's model name and feature flags (Linux), or "" where /proc says nothing."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def library_path(prefix: str, source: str, flags: tuple[str, ...], includes: tuple[Path, ...] = ()) -> Path:
    """Where the library built from `source` with `g++ flags` is cached; `includes` are
    the files it #includes by path, part of the key too."""
    digest = hashlib.sha256(source.encode())
    digest.update(" ".join(flags).encode())
    for path in includes:
        digest.update(path.read_bytes())
    if "-march=native" in flags:
        digest.update(cpu_identity().encode())
    return cache_dir() / f"{prefix}-{digest.hexdigest()[:16]}.so"


def build_shared_library(prefix: str, source: str, flags: tuple[str, ...], includes: tuple[Path, ...] = ()) -> Path:
    """The library at `library_path(...)`, built now unless cached.

    Raises `subprocess.CalledProcessError` (or `FileNotFoundError` without g++) if it
    cannot be built.
    """
    library = library_path(prefix, source, flags, includes)
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as work:
        source_path = Path(work) / f"{prefix}.cpp"
        source_path.write_text(source)
        built = Path(work) / library.name
        subprocess.run(["g++", *flags, str(source_path), "-o", str(built)], check=True, capture_output=True, text=True)
        os.replace(built, library)  # atomic: a concurrent build of the same source is harmless
    return library


def load_cpu_library(name: str, flags: tuple[str, ...] = CPU_CXX_FLAGS) -> ctypes.CDLL:
    """`gpu/cpu/kernels/{name}.cpp`, built with `flags` unless cached, and loaded (raises
    `OSError` or `subprocess.CalledProcessError` if it cannot be)."""
    source = (KERNELS / f"{name}.cpp").read_text()
    return ctypes.CDLL(str(build_shared_library(name, source, flags, CPU_HEADERS)))


def try_load_cpu_library(name: str, flags: tuple[str, ...], instead: str) -> ctypes.CDLL | None:
    """`load_cpu_library`, or None with a warning that says what runs `instead`."""
    try:
        return load_cpu_library(name, flags)
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        _log.warning("%s unavailable (%s), using %s", name, detail.strip()[-500:], instead)
        return None
