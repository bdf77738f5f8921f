"""Benchmark prompt sets: the bundled `stdlib-heldout` set or any JSONL file (optionally gzipped).

Each line is one JSON object with either
- `prompt`: a string (HumanEval style; one generation), or
- `turns`: a non-empty list of strings (MT-bench style; one generation per turn, each turn
  appended to the conversation so far together with the previous answer).
Optional fields: `id` (or `task_id` / `question_id`), `reference` (or `canonical_solution`),
`language` (e.g. "python": `--quality` checks such completions with `ast.parse`),
`images` (kept but not used yet).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.errors import SpecDecError
from specdec.models.loading import BUNDLED_PAIR

STDLIB_HELDOUT = "stdlib-heldout"
"""the name of the bundled held-out prompt set"""


@dataclass
class BenchPrompt:
    """One benchmark item: a single prompt or a multi-turn conversation."""

    id: str
    turns: list[str]
    """one entry for a plain prompt; several for a multi-turn conversation"""
    reference: Any = None
    images: list[Any] = field(default_factory=list)
    """image references (ignored for now; multimodal targets come later)"""
    language: str | None = None
    """the line's `language` field, e.g. "python" (None when absent)"""


def bundled_heldout_path() -> Path:
    """The bundled held-out prompt set (shipped next to the bundled pair)."""
    return BUNDLED_PAIR / f"{STDLIB_HELDOUT}.jsonl"


def resolve_prompt_source(source: str) -> Path:
    """`stdlib-heldout` -> the bundled set; anything else -> an existing JSONL(.gz) file."""
    if source == STDLIB_HELDOUT:
        path = bundled_heldout_path()
        if not path.is_file():
            raise SpecDecError(
                f"the bundled prompt set {STDLIB_HELDOUT!r} is missing ({path} does not exist); "
                "pass a JSONL file with --prompts PATH (e.g. the stdlib-heldout.jsonl written by `specdec train pair --out DIR`)"
            )
        return path
    path = Path(source).expanduser()
    if not path.is_file():
        raise SpecDecError(
            f"--prompts {source!r}: no such file; pass {STDLIB_HELDOUT!r} or a JSONL file whose lines have a 'prompt' or 'turns' field"
        )
    return path


def _read_lines(path: Path) -> list[str]:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                return fh.read().splitlines()
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError, EOFError) as err:
        raise SpecDecError(f"could not read prompt file {path}: {err}") from err


def _parse_line(obj: Any, where: str, lineno: int) -> BenchPrompt:
    if not isinstance(obj, dict):
        raise SpecDecError(f"{where}: expected a JSON object with a 'prompt' or 'turns' field, got {type(obj).__name__}")
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise SpecDecError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise SpecDecError(f"{where}: 'prompt' must be a non-empty string")
        turns = [obj["prompt"]]
    else:
        raise SpecDecError(f"{where}: the line has neither a 'prompt' string nor a 'turns' list (keys: {', '.join(sorted(obj)) or 'none'})")
    ident = next((obj[k] for k in ("id", "task_id", "question_id") if obj.get(k) is not None), f"line{lineno}")
    reference = next((obj[k] for k in ("reference", "canonical_solution") if k in obj), None)
    images = obj.get("images") or []
    language = obj.get("language")
    return BenchPrompt(
        id=str(ident),
        turns=list(turns),
        reference=reference,
        images=images if isinstance(images, list) else [images],
        language=str(language) if language is not None else None,
    )


def load_prompts(path: str | Path, limit: int | None = None) -> list[BenchPrompt]:
    """Parse a JSONL(.gz) prompt file. Errors name file and line.

    `limit` keeps N items spread evenly over the file (indices round(i * total / N)), so a
    file sorted by topic or module is sampled across its whole range, not at its head.
    """
    path = Path(path)
    prompts: list[BenchPrompt] = []
    for lineno, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise SpecDecError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must be one JSON object") from err
        prompts.append(_parse_line(obj, where, lineno))
    if not prompts:
        raise SpecDecError(f"prompt file {path} has no prompts; each line must be a JSON object with a 'prompt' or 'turns' field")
    if limit is not None and limit < len(prompts):
        prompts = [prompts[round(i * len(prompts) / limit)] for i in range(limit)]
    return prompts
