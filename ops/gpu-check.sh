#!/usr/bin/env bash
# On a machine with a CUDA GPU: the kernels' correctness sweep and the end-to-end greedy
# equality on random-weight models (pytest -m gpu), then the decode-attention bandwidth
# benchmark, then a short summary. Runs as it is on a stock PyTorch + cupy image with
# no venv and no network (ops/gpu-env.sh; README, "The GPU path"). Sized to fit in
# 5 minutes. Every part runs; the exit status is non-zero if any failed.
#   ops/gpu-check.sh            (or make gpu-check)
#   PYTHON=/path/to/python      another interpreter than the host's python3
#   OUT=folder                  keep the figures there: summary.json, pytest.xml (JUnit),
#                               decode_bandwidth.json
#   ops/gpu-check.sh --dry-run  only the parts that need no CUDA, on the CPU, kept short
#                               (CI runs it under the host's versions: ops/gpu-dry-run.sh)
set -uo pipefail
dry_run=false
if [ "${1:-}" = --dry-run ]; then dry_run=true; fi
if [ -n "${OUT:-}" ]; then OUT=$(realpath -m "$OUT"); fi  # as the caller meant it, before the cd
cd "$(dirname "$0")/.."
source ops/gpu-env.sh

results=${OUT:-$GPU_SCRATCH}
mkdir -p "$results"
rm -f "$results/summary.json" "$results/pytest.xml" "$results/decode_bandwidth.json"  # a killed part leaves none

# Without CUDA: the GPU tests' imports (collected as on the GPU, then deselected), the
# kernels' NVRTC compile (with cupy), the random-weight models through the engine on the
# torch backend and on the emulated kernels, the benchmark's imports, and the summary.
cpu_parts() {
  echo "gpu-check --dry-run: the parts that need no CUDA, on the CPU (versions in the summary)"
  # The emulated kernels' own tests touch no transformers code and run in make test; here
  # only what serves the host's transformers models through them.
  local tests=(
    tests/gpu/test_gpu_kernels.py
    tests/workers/test_random_models.py
    tests/gpu/test_kernel_emulation.py::test_random_models_on_the_emulated_kernels_generate_the_torch_backends_tokens
  )
  # NVRTC found and compiling from this environment, on the small source for the H200's
  # sm_90: compiling every instantiation would take the most time of all, and make test
  # does it with the same NVRTC.
  if "$PYTHON" -c 'import cupy' 2>/dev/null; then
    tests+=(tests/gpu/test_cuda_compile.py::test_nvrtc_is_installed
            "tests/gpu/test_cuda_compile.py::test_every_instantiation_compiles[cache_ops.cu-sm_90]")
  else
    echo "gpu-check --dry-run: no cupy here, so no NVRTC compile"
  fi
  # No 135M-parameter model on the CPU either: its random weights alone take longer to
  # draw than the tiny models take to serve.
  local started=$SECONDS
  timeout 180 "$PYTHON" -m pytest -q -p no:cacheprovider -o timeout=150 --junitxml="$results/pytest.xml" \
    -m 'not gpu' -k 'not smollm2' "${tests[@]}"
  local pytest_status=$? pytest_s=$((SECONDS - started))

  # Their --help imports all they need and touches no device (the bench without redis:
  # its Redis scenarios are left out).
  started=$SECONDS
  "$PYTHON" ops/decode_bandwidth.py --help >/dev/null && "$PYTHON" -m bench --help >/dev/null
  local imports_status=$? imports_s=$((SECONDS - started))

  "$PYTHON" ops/gpu_summary.py "$results" pytest "$pytest_status" "$pytest_s" \
    decode_bandwidth_imports "$imports_status" "$imports_s"
}

if $dry_run; then
  cpu_parts
  status=$?
  if [ -n "${OUT:-}" ]; then echo "gpu-check --dry-run: results in $OUT (summary.json, pytest.xml)"; fi
  exit $status
fi

if ! "$PYTHON" -c 'import torch, cupy, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: needs a CUDA GPU, torch with CUDA and cupy (cupy-cuda12x or cupy-cuda13x)" >&2
  exit 1
fi
"$PYTHON" -c 'import torch; print("gpu-check on", torch.cuda.get_device_name())'

started=$SECONDS
# A test hung past 150 s ends the run with every thread's stack (pytest-timeout), before
# the whole run's limit kills it silently.
timeout 210 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -o timeout=150 --junitxml="$results/pytest.xml" \
  tests/gpu/test_gpu_kernels.py
pytest_status=$?
pytest_s=$((SECONDS - started))

started=$SECONDS
timeout 60 "$PYTHON" ops/decode_bandwidth.py >"$results/decode_bandwidth.json"
bandwidth_status=$?
bandwidth_s=$((SECONDS - started))

"$PYTHON" ops/gpu_summary.py "$results" pytest "$pytest_status" "$pytest_s" \
  decode_bandwidth "$bandwidth_status" "$bandwidth_s"
status=$?
if [ -n "${OUT:-}" ]; then
  echo "gpu-check: figures in $OUT (summary.json, pytest.xml, decode_bandwidth.json)"
fi
exit $status
