"""Every kernel instantiation compiles with NVRTC for sm_80 (A100) and sm_90
(H100/H200), from the program text and options the worker hands `cupy.RawModule`.

No GPU is needed: cupy's low-level NVRTC bindings run without a device, and NVRTC
itself comes from the `nvidia-cuda-nvrtc-cu12` wheel of the dev extra. A missing
NVRTC fails these tests; they never skip.
"""

from __future__ import annotations

import pytest
from cupy.cuda import nvrtc

from gpu.cuda import source as cuda_source

ARCHITECTURES = ["sm_80", "sm_90"]
# What cupy's RawModule adds to our options on its way to NVRTC (cupy/cuda/compiler.py);
# its own compile path needs a device, so the check adds them itself.
CUPY_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


def test_nvrtc_is_installed():
    major, minor = nvrtc.getVersion()
    assert (major, minor) >= (12, 0)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("source", cuda_source.SOURCES)
def test_every_instantiation_compiles(source, architecture):
    instances = cuda_source.instantiations(source)
    program = nvrtc.createProgram(cuda_source.read_source(source), source, [], [])
    try:
        for instance in instances:
            nvrtc.addNameExpression(program, instance.name_expression)
        options = [*cuda_source.nvrtc_options(), *CUPY_OPTIONS, f"-arch={architecture}", "--ptxas-options=-v"]
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError:
            pytest.fail(f"NVRTC rejected {source} for {architecture}:\n{nvrtc.getProgramLog(program)}")
        log = nvrtc.getProgramLog(program)
        cubin = nvrtc.getCUBIN(program)
        assert cubin[:4] == b"\x7fELF", "NVRTC made no device binary"
        for instance in instances:
            lowered = nvrtc.getLoweredName(program, instance.name_expression)
            assert instance.kernel.name in lowered
            assert lowered.encode() in cubin, f"{instance.name_expression} is missing from the binary"
        assert "warning" not in log.lower(), log
        # Registers spilled to local memory would cost the decode kernel its bandwidth.
        for entry in log.split("Compiling entry function")[1:]:
            if cuda_source.DECODE.name in entry.split("'")[1]:
                assert " 0 bytes spill stores" in entry, entry
    finally:
        nvrtc.destroyProgram(program)
