"""ops/gpu-check.sh's preparation, on a Python shaped like the GPU host's: a stock image
with torch, cupy, transformers and pytest, without this project's venv, its other
dependencies (redis, structlog, gguf, ...), the bundled model, pytest-timeout or a
network; and its dry run, the parts that need no CUDA, under the host's transformers.
The device checks themselves need a GPU (tests/gpu/test_gpu_kernels.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "ops" / "gpu-wheels"
HOST_TRANSFORMERS = "5.17.0"  # the GPU host image's


def requirements() -> list[str]:
    lines = (WHEELS / "requirements.txt").read_text().splitlines()
    return [line.split()[0] for line in lines if line.strip() and not line.startswith("#")]


def test_the_wheel_folder_holds_exactly_the_listed_pure_python_wheels():
    """What `make gpu-wheels` downloads, and nothing else: small, and any platform's."""
    wanted = set()
    for requirement in requirements():
        name, _, version = requirement.partition("==")
        assert version, f"{requirement}: pin an exact version, so the folder can match it"
        wanted.add(f"{name.replace('-', '_')}-{version}-py3-none-any.whl")
    assert {p.name for p in WHEELS.glob("*.whl")} == wanted
    assert sum(p.stat().st_size for p in WHEELS.iterdir()) < 1 << 20
    makefile = (ROOT / "Makefile").read_text()
    assert "-r ops/gpu-wheels/requirements.txt" in makefile and "--python-version 3.12" in makefile


@pytest.fixture(scope="module")
def host_python(tmp_path_factory) -> Path:
    """A venv with this venv's packages except those the host lacks (ops/host_like_env.py)."""
    folder = tmp_path_factory.mktemp("host") / "env"
    built = subprocess.run([sys.executable, "ops/host_like_env.py", str(folder)], cwd=ROOT, check=True,
                           capture_output=True, text=True)  # fmt: skip
    return Path(built.stdout.strip())


def run(script: str, python: Path, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**environment, "PYTHON": str(python), **env})  # fmt: skip


def test_the_host_python_really_lacks_them(host_python):
    result = run('"$PYTHON" -c "import structlog"', host_python)
    assert "No module named 'structlog'" in result.stderr


def test_preparation_takes_missing_wheels_from_the_folder_and_the_gpu_path_imports(host_python, tmp_path):
    """Without the wheel, pyproject's pytest-timeout options only warn; with gpu-env.sh,
    pytest-timeout comes from ops/gpu-wheels, and the GPU tests collect and a random-weight
    model runs through the engine, all without the packages the host lacks."""
    collect = '"$PYTHON" -m pytest -p no:cacheprovider --collect-only -qq -m gpu tests/gpu/test_gpu_kernels.py'
    serve = (
        "from tests.conftest import run_to_completion; from workers.config import *; "
        "from workers.engine import Engine; from workers.api import SamplingParams; "
        "import runpy; runpy.run_path('ops/decode_bandwidth.py'); "  # its imports, not its main
        "e = Engine.from_config(EngineConfig(model=ModelConfig(source='random:tiny-llama', device='cpu'), "
        "cache=CacheConfig(kv_memory_bytes=1 << 20, swap_memory_bytes=0))); "
        "print('tokens', run_to_completion(e, {0: [('a', 'Hi', SamplingParams(max_tokens=2))]})['a'][0])"
    )
    script = f"""
        PYTHONPATH=$PWD {collect} 2>&1; echo "without the wheel: $?"
        source ops/gpu-env.sh
        "$PYTHON" -c 'import pytest_timeout; print("from", pytest_timeout.__file__)'
        {collect} 2>&1
        "$PYTHON" -c "{serve}"
    """
    result = run(f"set -e; {script}", host_python)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    without, with_wheel = out.split("gpu-check: pytest-timeout is not installed; installing it from ops/gpu-wheels")
    assert "Unknown config option: timeout" in without and "without the wheel: 0" in without
    assert re.search(r"from /\S+/inflight-gpu-check\.\w+/site/pytest_timeout\.py", with_wheel)
    assert "Unknown config option" not in with_wheel
    assert re.search(r"tests/gpu/test_gpu_kernels.py: \d+", with_wheel)
    assert re.search(r"tokens \[\d+, \d+\]", with_wheel)


def test_gpu_check_without_cuda_says_what_it_needs(host_python, tmp_path):
    result = run("ops/gpu-check.sh", host_python, OUT=str(tmp_path / "out"))
    assert result.returncode == 1
    assert "gpu-check: needs a CUDA GPU, torch with CUDA and cupy" in result.stderr
    scratch = re.search(r"installing it from ops/gpu-wheels into (\S+)/site", result.stdout)
    assert scratch and not Path(scratch[1]).exists(), "the scratch folder outlives the run"


def test_summary_reads_the_reports(tmp_path):
    (tmp_path / "pytest.xml").write_text(
        '<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="2" tests="10" time="12.5"/></testsuites>'
    )
    (tmp_path / "decode_bandwidth.json").write_text(
        '{"shape": {"target": 0.7}, "kernel_gbps": 3900.0, "kernel_share_of_peak": 0.81, "peak_gbps": 4800.0, '
        '"sdpa_gathered_gbps": 3000.0}\n'
    )
    result = subprocess.run([sys.executable, "ops/gpu_summary.py", str(tmp_path), "pytest", "1", "40",
                             "decode_bandwidth", "0", "12"], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 1
    assert "pytest: exit 1 in 40 s; 7 passed, 1 failed, 2 skipped" in result.stdout
    assert "3900.0 GB/s = 81% of peak 4800.0 GB/s (target 70%)" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] is False and summary["parts"]["decode_bandwidth"]["report"]["kernel_gbps"] == 3900.0


@pytest.mark.slow
def test_dry_run_passes_under_the_gpu_hosts_transformers(tmp_path):
    """ops/gpu-dry-run.sh: gpu-check's parts that need no CUDA, as the GPU host runs them
    (the checkout on PYTHONPATH, no redis, structlog or gguf) and on its transformers,
    installed over this venv's: the GPU tests import, NVRTC compiles, the random-weight
    models serve through the engine on the torch backend and on the emulated kernels, and
    the summary is written. Skipped where the package registry lacks the host's versions."""
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHON")}
    result = subprocess.run(["ops/gpu-dry-run.sh"], cwd=ROOT, capture_output=True, text=True, timeout=280,
                            env={**environment, "BASE_PYTHON": sys.executable, "OUT": str(tmp_path)})  # fmt: skip
    if result.returncode == 3:
        pytest.skip(result.stderr.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpu-check: pytest-timeout is not installed; installing it from ops/gpu-wheels" in result.stdout

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["versions"]["device"] is None
    # torch is the venv's: only transformers and what it pulls in are the host's.
    assert (summary["versions"]["transformers"], summary["versions"]["torch"]) == (HOST_TRANSFORMERS, torch.__version__)
    assert f"transformers {HOST_TRANSFORMERS}" in result.stdout and "  PASS" in result.stdout
    assert summary["parts"]["decode_bandwidth_imports"]["status"] == 0
    counts = summary["parts"]["pytest"]["counts"]
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0
    ran = {case.get("classname") for case in ET.parse(tmp_path / "pytest.xml").getroot().iter("testcase")}
    assert {"tests.workers.test_random_models", "tests.gpu.test_kernel_emulation", "tests.gpu.test_cuda_compile"} <= ran
