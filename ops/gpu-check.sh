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
set -uo pipefail
if [ -n "${OUT:-}" ]; then OUT=$(realpath -m "$OUT"); fi  # as the caller meant it, before the cd
cd "$(dirname "$0")/.."
source ops/gpu-env.sh

if ! "$PYTHON" -c 'import torch, cupy, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: needs a CUDA GPU, torch with CUDA and cupy (cupy-cuda12x or cupy-cuda13x)" >&2
  exit 1
fi
"$PYTHON" -c 'import torch; print("gpu-check on", torch.cuda.get_device_name())'
results=${OUT:-$GPU_SCRATCH}
mkdir -p "$results"
rm -f "$results/summary.json" "$results/pytest.xml" "$results/decode_bandwidth.json"  # a killed part leaves none

started=$SECONDS
# A test hung past 150 s ends the run with every thread's stack (pytest-timeout), before
# the whole run's limit kills it silently.
timeout 210 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -o timeout=150 --junitxml="$results/pytest.xml" \
  tests/test_gpu_kernels.py
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
