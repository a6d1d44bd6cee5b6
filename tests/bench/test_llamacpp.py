"""llama.cpp as a bench peer: the build flags follow the CPU, and the peer produces what it
is asked for on the bundled GGUF (skipped where llama-cpp-python is not installed)."""

from __future__ import annotations

import pytest
import torch

from bench.llamacpp_build import cmake_args, cpu_flags
from bench.peer_llamacpp import available, run_llamacpp
from bench.workload import BenchRequest, Workload
from workers.model_loader import bundled_gguf_path, encode_prompt

BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt"
AVX2_ONLY = f"{BASE} avx avx2 fma f16c bmi2"
EPYC_ZEN4 = f"{AVX2_ONLY} avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = f"{EPYC_ZEN4} avx_vnni amx_bf16 amx_tile amx_int8"


def options(flags: str) -> dict[str, str]:
    args = cmake_args(set(flags.split())).split()
    return dict(arg.removeprefix("-D").split("=") for arg in args)


def test_an_avx2_machine_gets_no_avx512():
    got = options(AVX2_ONLY)
    assert got["GGML_NATIVE"] == "OFF"
    assert {k for k, v in got.items() if v == "ON"} == {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA",
                                                         "GGML_F16C", "GGML_BMI2"}  # fmt: skip


def test_avx512_with_bf16_and_vnni_but_no_amx():
    got = options(EPYC_ZEN4)
    assert got["GGML_AVX512"] == got["GGML_AVX512_BF16"] == got["GGML_AVX512_VNNI"] == got["GGML_AVX512_VBMI"] == "ON"
    assert got["GGML_AMX_TILE"] == got["GGML_AMX_INT8"] == got["GGML_AMX_BF16"] == got["GGML_AVX_VNNI"] == "OFF"


def test_amx_stays_off_even_where_the_cpu_has_it():
    """ggml 0.3.36's AMX matmul died of SIGILL on a Xeon with AMX; its AVX-512 kernels run."""
    got = options(SAPPHIRE_RAPIDS)
    assert got["GGML_AMX_TILE"] == got["GGML_AMX_INT8"] == got["GGML_AMX_BF16"] == "OFF"
    assert got["GGML_AVX512_VNNI"] == got["GGML_AVX512_BF16"] == got["GGML_AVX_VNNI"] == "ON"


def test_avx512_needs_the_whole_base_set():
    """ggml's AVX512 option compiles with -mavx512{f,cd,vl,dq,bw}: a CPU missing one gets
    none of the AVX-512 options, its extensions included."""
    got = options(EPYC_ZEN4.replace(" avx512bw", ""))
    assert got["GGML_AVX512"] == got["GGML_AVX512_BF16"] == got["GGML_AVX512_VNNI"] == "OFF"
    assert got["GGML_AVX2"] == "ON"


def test_flags_are_read_from_cpuinfo():
    cpuinfo = (f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {AVX2_ONLY}\n\n"
               f"processor\t: 1\nflags\t\t: {AVX2_ONLY}\n")  # fmt: skip
    assert cpu_flags(cpuinfo) == set(AVX2_ONLY.split())
    assert cpu_flags("processor\t: 0\n") == set()


needs_llamacpp = pytest.mark.skipif(not available(), reason="llama-cpp-python is not installed (make llamacpp)")


@needs_llamacpp
def test_the_peer_produces_each_requests_output_length():
    """Two requests of different lengths in one context: each gets exactly its tokens,
    stamped in order, one per step once its prompt is in."""
    workload = Workload(0, (5, 40), (3, 9), [BenchRequest("a", list(range(1000, 1040)), 9),
                                             BenchRequest("b", list(range(2000, 2005)), 3)])  # fmt: skip
    out = run_llamacpp(bundled_gguf_path(), workload, threads=torch.get_num_threads())
    assert {r: len(t) for r, t in out["tokens"].items()} == {"a": 9, "b": 3}
    for times in out["token_times"].values():
        assert times == sorted(times) and len(set(times)) == len(times)
    assert "AVX" in out["system_info"]


@needs_llamacpp
def test_greedy_tokens_match_transformers_on_a_real_prompt(smollm2_reference):
    """The same weights (Q4_1, which the engine dequantizes): greedy decoding of a plain
    question starts with transformers' float32 tokens. llama.cpp rounds activations to
    8 bits for its dot products, so only the first tokens are compared."""
    tokenizer, model = smollm2_reference.tokenizer, smollm2_reference.model
    prompts = [[{"role": "user", "content": "What is the capital of France?"}],
               [{"role": "user", "content": "Name three primary colors."}]]  # fmt: skip
    requests = [BenchRequest(f"r{i}", encode_prompt(tokenizer, p), 8) for i, p in enumerate(prompts)]
    out = run_llamacpp(bundled_gguf_path(), Workload(0, (1, 1), (8, 8), requests), threads=torch.get_num_threads())
    for request in requests:
        with torch.inference_mode():
            want = model.generate(torch.tensor([request.prompt_ids]), max_new_tokens=8, do_sample=False)
        want = want[0, len(request.prompt_ids) :].tolist()
        got = out["tokens"][request.request_id]
        assert got[:4] == want[:4], (tokenizer.decode(got), tokenizer.decode(want))
