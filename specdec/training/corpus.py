"""The training corpus: Python source files, split deterministically by module.

The default corpus is the running interpreter's standard library. A file's split is
decided by a hash of its module path (relative to the corpus root), so the split does
not depend on file order, the file system or the Python version's other files.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PERCENT = 5
"""Share of modules (by hash of their path) that are held out for evaluation and prompts."""


@dataclass(frozen=True)
class SourceFile:
    """One corpus file: `module` is its path relative to the corpus root (the split key)."""

    module: str
    path: Path


def stdlib_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _bucket(module: str) -> int:
    """A stable number in [0, 2**32) for `module` (sha1 of its path)."""
    return int(hashlib.sha1(module.encode("utf-8")).hexdigest()[:8], 16)


def is_heldout(module: str) -> bool:
    """True when `module` belongs to the held-out split (deterministic, hash based)."""
    return _bucket(module) % 100 < HELDOUT_PERCENT


def list_sources(roots: list[Path] | None = None, suffixes: tuple[str, ...] = (".py",)) -> list[SourceFile]:
    """All corpus files under `roots` (default: the standard library), sorted by module path.

    A root may also be a single text file. `site-packages` folders are skipped so the
    corpus is the same on every installation of one Python version.
    """
    roots = roots or [stdlib_root()]
    files: list[SourceFile] = []
    for root in roots:
        root = Path(root)
        if not root.exists():
            raise FileNotFoundError(f"corpus path {root} does not exist; pass an existing folder or text file")
        if root.is_file():
            files.append(SourceFile(module=root.name, path=root))
            continue
        for path in root.rglob("*"):
            if path.suffix not in suffixes or not path.is_file():
                continue
            rel = path.relative_to(root)
            if "site-packages" in rel.parts or "__pycache__" in rel.parts:
                continue
            files.append(SourceFile(module=rel.as_posix(), path=path))
    files.sort(key=lambda f: f.module)
    return files


def read_text(path: Path) -> str | None:
    """File text, or None for files that are not UTF-8 (a few stdlib test fixtures)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def split_sources(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, heldout) by `is_heldout` of each module path.

    A small corpus whose hash split holds out nothing gives up the one file with the
    smallest hash bucket, so both splits are non-empty whenever there are two files.
    """
    heldout = [f for f in files if is_heldout(f.module)]
    if not heldout and len(files) >= 2:
        heldout = [min(files, key=lambda f: _bucket(f.module) % 100)]
    train = [f for f in files if f not in heldout]
    return train, heldout


def iter_texts(files: list[SourceFile]) -> Iterator[str]:
    for f in files:
        text = read_text(f.path)
        if text and text.strip():
            yield text


def corpus_name(corpus: list[Path] | None) -> str:
    """How errors name a corpus: the --corpus flag as given, or the default."""
    return "--corpus " + " ".join(repr(str(p)) for p in corpus) if corpus else "the standard library"


def training_split(corpus: list[Path] | None, heldout_needed: bool = True) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, heldout) files of `corpus` (default: the standard library); a SpecDecError naming
    the corpus when its training split has no text (no .py files, only empty or non-UTF-8 ones),
    or with `heldout_needed` when its held-out split has none (a corpus of one file)."""
    from specdec.errors import SpecDecError

    files = list_sources(corpus)
    train, heldout = split_sources(files)
    if not files:
        why = "it holds no .py files"
    elif not any(True for _ in iter_texts(files)):
        why = f"its {len(files)} file(s) hold no UTF-8 text (empty or binary)"
    elif not any(True for _ in iter_texts(train)) or (heldout_needed and not any(True for _ in iter_texts(heldout))):
        split = "training" if not any(True for _ in iter_texts(train)) else "held-out"
        why = (
            f"its {split} split (a hash-chosen share of its {len(files)} file(s)) holds no text; "
            f"a corpus needs at least two files with text"
        )
    else:
        return train, heldout
    raise SpecDecError(f"{corpus_name(corpus)} has nothing to train on: {why}; give folders of UTF-8 .py files (or leave --corpus out for the standard library)")


def build_prompt_set(
    heldout: list[SourceFile],
    out_path: Path,
    prompt_lines: int = 24,
    reference_lines: int = 40,
    max_prompts: int = 64,
    max_prompt_chars: int = 2000,
) -> int:
    """Write the `stdlib-heldout` prompt set as JSONL and return how many prompts it has.

    A prompt is the first `prompt_lines` lines of a held-out file (files shorter than
    `prompt_lines + reference_lines` lines are skipped); `reference` is the file's real
    continuation, the next `reference_lines` lines, against which completions are judged.
    """
    rows = []
    for f in heldout:
        text = read_text(f.path)
        if text is None:
            continue
        lines = text.splitlines(keepends=True)
        if len(lines) < prompt_lines + reference_lines:
            continue
        prompt = "".join(lines[:prompt_lines])
        if not prompt.strip() or len(prompt) > max_prompt_chars:
            continue
        reference = "".join(lines[prompt_lines : prompt_lines + reference_lines])
        rows.append({"id": f.module, "prompt": prompt, "reference": reference})
        if len(rows) >= max_prompts:
            break
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return len(rows)
