"""docs/architecture.md stays true to the code: every `path:name` it names (a function, a
class, a method as `Class.method`, a module-level constant) exists in that file, and every
bare `Class.method` it names exists in the file the doc ties the class to. Cheap: the
source is parsed, never imported."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
# `service/worker.py:Worker.run`, `gpu/attention.py:paged_attention`
QUALIFIED = re.compile(r"`((?:service|workers|gpu|bench|ops)/[\w/]+\.py):([\w.]+)`")
# `Engine.step`, `Scheduler.update_from_output(plan, ...)`: a class of ours and a member
MEMBER = re.compile(r"`([A-Z]\w+)\.(\w+)[`(]")
PACKAGES = ("service", "workers", "gpu")


def class_members(node: ast.ClassDef) -> set[str]:
    """Methods, class-level fields, and attributes its methods set on `self`."""
    members = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(item.name)
            for inner in ast.walk(item):
                targets = inner.targets if isinstance(inner, ast.Assign) else [getattr(inner, "target", None)]
                for target in targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                        if target.value.id == "self":
                            members.add(target.attr)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            members.update(target.id for target in item.targets if isinstance(target, ast.Name))
    return members


@cache
def definitions(path: str) -> frozenset[str]:
    """Every name a module defines at its top level, and `Class.member` for each class."""
    tree = ast.parse((ROOT / path).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{member}" for member in class_members(node))
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


@cache
def class_files() -> dict[str, list[str]]:
    """Each class name defined in the shipped packages, and the files that define it."""
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(relative)
    return found


def missing_names(text: str) -> list[str]:
    missing = []
    for cls, member in MEMBER.findall(text):
        files = class_files().get(cls)
        if files and not any(f"{cls}.{member}" in definitions(path) for path in files):
            missing.append(f"{cls}.{member}")
    for path, name in QUALIFIED.findall(text):
        if not (ROOT / path).is_file():
            missing.append(f"{path}: no such file")
        elif name not in definitions(path):
            missing.append(f"{path}:{name}")
    return missing


def test_every_file_and_name_the_architecture_names_exists():
    assert missing_names(DOC.read_text()) == []


def test_the_checker_catches_a_name_that_moved():
    text = (
        "`workers/engine.py:Engine.step` and `workers/engine.py:Engine.no_such_step`, `gpu/gone.py:f`,"
        " `Engine.cancel`, `Engine.vanished(x)`"
    )
    assert missing_names(text) == [
        "Engine.vanished",
        "workers/engine.py:Engine.no_such_step",
        "gpu/gone.py: no such file",
    ]


def test_the_architecture_covers_the_gateway_and_the_lean_forward():
    text = DOC.read_text()
    assert "service/gateway/" in text and "gpu/cpu/lean_forward.py" in text
