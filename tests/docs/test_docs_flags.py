"""The flag tables of the docs name exactly the flags the CLI takes, both ways: every flag of
`inflight worker` and `inflight gateway` has its row (docs/configuration.md, docs/gateway.md),
every flag the README's short table and its `inflight submit` list name exists, and no doc
names a flag the command does not take. Read from `--help`, as a user would. No model, no Redis.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def cli_flags(command: str) -> set[str]:
    """The flags `inflight COMMAND --help` lists, `--help` itself left out."""
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr
    return set(FLAG.findall(result.stdout)) - {"--help"}


def section(path: Path, heading: str) -> str:
    """The text under a heading, up to the next heading of any level."""
    text = path.read_text()
    assert heading in text, f"{path.name}: no {heading!r}"
    return text.split(heading, 1)[1].split("\n#", 1)[0]


def table_flags(text: str, column: int) -> set[str]:
    """The flags named in one column of the markdown tables in `text`."""
    flags = set()
    for line in text.splitlines():
        cells = line.split("|")[1:-1]
        if len(cells) > column and not set(line) <= set("|- "):
            flags |= set(FLAG.findall(cells[column]))
    return flags


@pytest.fixture(scope="module")
def worker_flags() -> set[str]:
    return cli_flags("worker")


def test_the_configuration_table_has_every_worker_flag_and_no_other(worker_flags):
    documented = table_flags(section(ROOT / "docs" / "configuration.md", "## The worker's settings"), 1)
    assert worker_flags - documented == set(), "flags with no row in docs/configuration.md"
    assert documented - worker_flags == set(), "rows naming flags the worker does not take"


def test_the_gateway_table_has_every_gateway_flag_and_no_other():
    documented = table_flags(section(ROOT / "docs" / "gateway.md", "## Configuration"), 1)
    flags = cli_flags("gateway")
    assert flags - documented == set(), "flags with no row in docs/gateway.md"
    assert documented - flags == set(), "rows naming flags the gateway does not take"


def test_the_readme_names_only_flags_that_exist(worker_flags):
    readme = ROOT / "README.md"
    short_table = table_flags(section(readme, "## Configuration"), 0)
    assert len(short_table) >= 10 and short_table <= worker_flags
    submit_line = section(readme, "## Submitting jobs").split("`inflight submit TEXT`", 1)[1].split("\n\n", 1)[0]
    submit_flags = set(FLAG.findall(submit_line))
    assert submit_flags == cli_flags("submit"), "the README's `inflight submit` flags, both ways"
