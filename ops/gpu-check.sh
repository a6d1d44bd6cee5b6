#!/usr/bin/env bash
# On a machine with a CUDA GPU: the kernels' correctness sweep and an end-to-end greedy
# generation on the device (pytest -m gpu), then the decode-attention bandwidth
# benchmark. Sized to fit in 5 minutes (not yet timed on a GPU: docs/benchmarks.md).
# Every part runs; the exit status is non-zero if any failed.
#   make gpu-check   (or ops/gpu-check.sh in a venv with a CUDA build of torch and the gpu and dev extras)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}

if ! "$PYTHON" -c 'import torch, cupy, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: needs a CUDA GPU, torch with CUDA and cupy (pip install -e '.[gpu]')" >&2
  exit 1
fi
"$PYTHON" -c 'import torch; print("gpu-check on", torch.cuda.get_device_name())'

status=0
timeout 240 "$PYTHON" -m pytest -m gpu -q tests/test_gpu_kernels.py || status=1
timeout 60 "$PYTHON" ops/decode_bandwidth.py || status=1
exit $status
