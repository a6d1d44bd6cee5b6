# Sourced from the checkout's root by ops/gpu-check.sh (and its CPU test): the Python to
# run and its import path, on a host that has a framework image (torch, cupy,
# transformers, pytest) but neither this project's venv nor a network.
#   PYTHON     the interpreter; the host's python3 unless set
#   PYTHONPATH the checkout first, so the code runs from here without being installed
#   GPU_SCRATCH a fresh folder, removed when the calling shell exits
# A pure-Python package in ops/gpu-wheels/requirements.txt that the host lacks is
# installed from the wheels beside it into GPU_SCRATCH/site, put on PYTHONPATH: never
# from the network.
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
GPU_SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/inflight-gpu-check.XXXXXX")
trap 'rm -rf "$GPU_SCRATCH"' EXIT

gpu_wheels=ops/gpu-wheels
gpu_site=$GPU_SCRATCH/site
while read -r requirement _; do
  case $requirement in '' | '#'*) continue ;; esac
  package=${requirement%%[=<>]*}
  module=${package//-/_}  # each package listed imports under its name with - as _
  if "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"; then
    continue
  fi
  if [ ! -d "$gpu_site" ]; then
    mkdir "$gpu_site"
    export PYTHONPATH="$gpu_site:$PYTHONPATH"
  fi
  echo "gpu-check: $package is not installed; installing it from $gpu_wheels into $gpu_site (no network)"
  # Going on without it is better than nothing: the checks may still run.
  "$PYTHON" -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-index --no-deps \
    --find-links "$gpu_wheels" --target "$gpu_site" "$requirement" ||
    echo "gpu-check: could not install $package from $gpu_wheels; going on without it" >&2
done <"$gpu_wheels/requirements.txt"
