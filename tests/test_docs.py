"""The README and docs/ point at things that exist: every `from specdec... import ...` in their
examples imports, and every relative markdown link names a file of the repository (and, with an
anchor into a markdown file, one of its headings)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

IMPORT = re.compile(r"^\s*from (specdec(?:\.\w+)*) import ([\w, ]+)\s*$", re.MULTILINE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lowercased, punctuation but '-' and '_'
    dropped, spaces made '-' (repeats numbered -1, -2, ...)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        match = re.match(r"^#{1,6} (.+?)\s*$", line)
        if in_code or not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_imports_in_the_docs_resolve(doc: Path):
    for module_name, names in IMPORT.findall(doc.read_text()):
        module = importlib.import_module(module_name)
        for name in (n.strip() for n in names.split(",") if n.strip()):
            assert hasattr(module, name), f"{doc.name}: `from {module_name} import {name}` fails: {module_name} has no {name}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_in_the_docs_resolve(doc: Path):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # a URL (http:, https:, mailto:)
        path_part, _, anchor = target.partition("#")
        path = doc if not path_part else (doc.parent / path_part).resolve()
        missing_heading = bool(anchor) and path.suffix == ".md" and path.exists() and anchor not in heading_anchors(path)
        if not path.exists() or missing_heading:
            broken.append(target)
    assert not broken, f"{doc.name}: links to nothing: {broken}"


def test_the_link_check_catches_a_broken_link(tmp_path: Path):
    """The checks above can fail: a missing file and a missing heading are both reported."""
    (tmp_path / "a.md").write_text("# Title\n\n## Real heading\n")
    assert heading_anchors(tmp_path / "a.md") == {"title", "real-heading"}
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md#real-heading) [gone](missing.md) [no heading](a.md#nothing)\n")
    with pytest.raises(AssertionError, match=r"missing\.md.*a\.md#nothing"):
        test_relative_links_in_the_docs_resolve(doc)
