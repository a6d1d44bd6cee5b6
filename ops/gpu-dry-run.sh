#!/usr/bin/env bash
# On a CI or developer machine without a GPU: gpu-check's parts that need no CUDA
# (ops/gpu-check.sh --dry-run), run the way the GPU host runs them, so that version drift
# shows up here and not in the GPU's few minutes (README, "The GPU path"):
#   - a Python without redis, structlog, gguf or the installed project (ops/host_like_env.py);
#   - the host's transformers and what it pulls in, installed into a cached folder from
#     the package registry (ops/gpu-dry-run-requirements.txt) and put on PYTHONPATH
#     before the venv's own;
#   - the checkout on PYTHONPATH too, by gpu-check itself.
# torch stays the venv's (a CPU build, not the host's CUDA build).
#   ops/gpu-dry-run.sh          (or make gpu-dry-run)
#   BASE_PYTHON=python          the venv to start from; .venv's by default
#   OUT=folder                  keep summary.json and pytest.xml there
# Exits 3, having run nothing, when the host's packages cannot be installed (an offline
# machine whose registry lacks them); otherwise with gpu-check's status.
set -euo pipefail
if [ -n "${OUT:-}" ]; then export OUT=$(realpath -m "$OUT"); fi  # as the caller meant it, before the cd
cd "$(dirname "$0")/.."
BASE_PYTHON=${BASE_PYTHON:-.venv/bin/python}
unset PYTHONPATH  # set below as the GPU host's invocation sets it, and only so
requirements=ops/gpu-dry-run-requirements.txt
transformers_version=$(sed -n 's/^transformers==//p' "$requirements")

# Keyed by the pins and the Python version: a repeated run installs nothing.
key=$(cat "$requirements" <("$BASE_PYTHON" -c 'import sys; print(sys.version_info[:2])') | sha256sum | cut -c1-16)
site=${XDG_CACHE_HOME:-$HOME/.cache}/inflight/gpu-dry-run/site-$key
if [ ! -d "$site" ]; then
  echo "gpu-dry-run: installing the GPU host's versions ($requirements) into $site"
  partial=$site.partial-$$
  trap 'rm -rf "$partial"' EXIT
  # Few retries: an unreachable registry fails in seconds, not minutes.
  if ! "$BASE_PYTHON" -m pip install -q --disable-pip-version-check --retries 1 --timeout 30 --no-deps \
    --target "$partial" -r "$requirements"; then
    echo "gpu-dry-run: cannot install the GPU host's transformers $transformers_version" \
      "($requirements) from the package registry" >&2
    exit 3
  fi
  # Whole or not at all, even when two runs race.
  mv -T "$partial" "$site" 2>/dev/null || rm -rf "$partial"
fi

scratch=$(mktemp -d "${TMPDIR:-/tmp}/inflight-gpu-dry-run.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
host_python=$("$BASE_PYTHON" ops/host_like_env.py "$scratch/env")

for absent in redis structlog gguf; do
  if "$host_python" -c "import $absent" 2>/dev/null; then
    echo "gpu-dry-run: $absent is importable, but the GPU host has none" >&2
    exit 1
  fi
done
if ! PYTHONPATH=$site "$host_python" -c "import sys, transformers
sys.exit(transformers.__version__ != '$transformers_version')"; then
  echo "gpu-dry-run: transformers is not the GPU host's $transformers_version" >&2
  exit 1
fi

PYTHON=$host_python PYTHONPATH=$site ops/gpu-check.sh --dry-run
