"""The layout: imports run one way, from the edge to the engine to the kernels.

    service/  the Redis edge, metrics, logging, the CLI   → may import workers/, gpu/
    workers/  the engine                                  → may import gpu/
    gpu/      the kernels (gpu/cpu/, gpu/cuda/)           → imports none of them
    bench/    the benchmarks, a driver of all of the above (the CLI's `bench` command)
Nothing shipped imports tests/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("service", "workers", "gpu", "bench", "tests")
MAY_IMPORT = {
    "gpu": set(),
    "workers": {"gpu"},
    "service": {"workers", "gpu"},
    "bench": {"service", "workers", "gpu"},
}
# The CLI hands `inflight bench` over to the benchmarks.
EXCEPTIONS = {("service/cli.py", "bench")}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in PACKAGES)
    return found


@pytest.mark.parametrize("package", sorted(MAY_IMPORT), ids=lambda package: f"{package}-package")
def test_imports_run_one_way(package):
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for imported in imported_packages(path) - MAY_IMPORT[package] - {package}:
            if (relative, imported) not in EXCEPTIONS:
                wrong.append(f"{relative} imports {imported}")
    assert not wrong


def test_the_cpu_and_cuda_paths_live_in_their_own_folders():
    assert not list((ROOT / "gpu" / "cpu").rglob("*.cu"))
    assert not list((ROOT / "gpu" / "cuda").rglob("*.cpp"))
    assert not list((ROOT / "gpu").glob("*.cu")) and not list((ROOT / "gpu").glob("*.cpp"))
