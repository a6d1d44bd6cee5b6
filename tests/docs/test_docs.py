"""Every relative link in the docs resolves: to a file that exists and, with a
`#fragment`, to a heading of that file (GitHub's anchors). Cheap, no model, no Redis."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "ops" / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a file's headings: lowercase, punctuation dropped, spaces
    to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    result = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def broken(path: Path) -> list[str]:
    problems = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(f"{target}: no heading #{fragment} in {resolved.name}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken(path) == []


def test_the_checker_sees_links_and_catches_broken_ones(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n## Two `code` words, again\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#two-code-words-again) [self](#local) [web](https://example.com) ![img](x.png)\n"
        "# Local\n[gone](missing.md) [bad anchor](a.md#nope)\n```\n[in code](nowhere.md)\n```\n"
    )
    assert broken(page) == ["missing.md: no such file", "a.md#nope: no heading #nope in a.md"]


TOP_LEVEL = ("service", "workers", "gpu", "bench", "ops", "docs", "tests", ".ci")
CODE_PATH = re.compile(rf"`((?:{'|'.join(re.escape(d) for d in TOP_LEVEL)})/[\w./*-]*)`")


def stale_paths(path: Path) -> list[str]:
    """Repository paths named in code spans (`gpu/cpu/attention.py`, `gpu/cuda/kernels/*.cu`)
    that match nothing: the layout moved on and the text did not."""
    text = path.read_text()
    named = set(CODE_PATH.findall(text))
    for span in re.findall(r"`([^`\n]+)`", text):  # `file.py:function` and `path function`
        head = re.split(r"[:\s]", span)[0]
        if CODE_PATH.fullmatch(f"`{head}`"):
            named.add(head)
    return sorted(p for p in named if not any(ROOT.glob(p.rstrip("/"))))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_the_docs_name_exists(path):
    assert stale_paths(path) == []
