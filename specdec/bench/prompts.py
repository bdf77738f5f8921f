"""Benchmark prompt sets: the bundled `stdlib-heldout` set, the synthetic multimodal `scenes-*` sets, or any JSONL file (optionally gzipped).

Each line is one JSON object with either
- `prompt`: a string (HumanEval style; one generation), or
- `turns`: a non-empty list of strings (MT-bench style; one generation per turn, each turn
  appended to the conversation so far together with the previous answer).
Optional fields: `id` (or `task_id` / `question_id`), `reference` (or `canonical_solution`),
`language` (e.g. "python": `--quality` checks such completions with `ast.parse`),
`category` (e.g. Spec-Bench's "writing", "translation", "math_reasoning": the report then has a
per-category table),
`images` (a list of image paths, relative to the JSONL file's directory unless absolute; each
must exist, and is kept as a `Path`).

The named sets "scenes-first-turn", "scenes-second-turn" and "scenes-ood"
(`specdec.multimodal.scenes.SCENARIOS`) are generated in memory: one prompt per item, its
`images` PIL images and its `reference` the expected answer (None for scenes-ood).
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
SCENARIO_SIZE = 24
"""items in a generated scenes-* set (`specdec.multimodal.scenes.scenario_items`' default n)"""


@dataclass
class BenchPrompt:
    """One benchmark item: a single prompt or a multi-turn conversation."""

    id: str
    turns: list[str]
    """one entry for a plain prompt; several for a multi-turn conversation"""
    reference: Any = None
    images: list[Any] = field(default_factory=list)
    """the prompt's images, one per `<image>` placeholder: `Path`s (JSONL files) or PIL images (the scenes-* sets)"""
    language: str | None = None
    """the line's `language` field, e.g. "python" (None when absent)"""
    category: str | None = None
    """the line's `category` field, e.g. "translation" (Spec-Bench question files; None when absent)"""


def bundled_heldout_path() -> Path:
    """The bundled held-out prompt set (shipped next to the bundled pair)."""
    return BUNDLED_PAIR / f"{STDLIB_HELDOUT}.jsonl"


def resolve_prompt_source(source: str) -> Path | str:
    """`stdlib-heldout` -> the bundled set; a scenes-* name -> that name (for `load_prompts`); anything else -> an existing JSONL(.gz) file."""
    from specdec.multimodal.scenes import SCENARIOS

    if source in SCENARIOS:
        return source
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
            f"--prompts {source!r}: {'a directory' if path.is_dir() else 'no such file'}; pass {STDLIB_HELDOUT!r}, one of the generated sets ({', '.join(SCENARIOS)}) "
            "or a JSONL file whose lines have a 'prompt' or 'turns' field"
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


def _image_paths(images: Any, base: Path, where: str) -> list[Path]:
    """The line's `images` as existing paths, relative ones resolved against `base` (the JSONL file's directory)."""
    items = images if isinstance(images, list) else [images]
    paths = []
    for item in items:
        if not isinstance(item, str) or not item:
            raise SpecDecError(f"{where}: 'images' must be a list of image file paths, got {item!r}")
        path = Path(item).expanduser()
        path = path if path.is_absolute() else base / path
        if not path.is_file():
            raise SpecDecError(f"{where}: image {item!r} not found (looked for {path}); image paths are relative to the JSONL file")
        paths.append(path)
    return paths


def _parse_line(obj: Any, where: str, lineno: int, base: Path) -> BenchPrompt:
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
    category = obj.get("category")
    if category is not None and not isinstance(category, str | int):
        raise SpecDecError(f"{where}: 'category' must be a string, got {category!r}")
    return BenchPrompt(
        id=str(ident),
        turns=list(turns),
        reference=reference,
        images=_image_paths(images, base, where) if images else [],
        language=str(language) if language is not None else None,
        category=str(category) if category not in (None, "") else None,
    )


def _scenario_prompts(name: str, limit: int | None) -> list[BenchPrompt]:
    """A generated scenes-* set: its default size, or `limit` items when more are asked for."""
    from specdec.multimodal.scenes import scenario_items

    items = scenario_items(name, max(SCENARIO_SIZE, limit or 0))
    return [BenchPrompt(id=item.id, turns=[item.prompt], reference=item.answer, images=list(item.images)) for item in items]


def load_prompts(path: str | Path, limit: int | None = None) -> list[BenchPrompt]:
    """Parse a JSONL(.gz) prompt file, or generate a scenes-* set given its name (a `str`). Errors name file and line.

    `limit` keeps N items spread evenly over the file (indices round(i * total / N)), so a
    file sorted by topic or module is sampled across its whole range, not at its head.
    A scenes-* set has `SCENARIO_SIZE` items (or `limit`, if larger), sampled the same way.
    """
    from specdec.multimodal.scenes import SCENARIOS

    prompts: list[BenchPrompt] = []
    if isinstance(path, str) and path in SCENARIOS:
        prompts = _scenario_prompts(path, limit)
        if limit is not None and limit < len(prompts):
            prompts = [prompts[round(i * len(prompts) / limit)] for i in range(limit)]
        return prompts
    path = Path(path)
    for lineno, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise SpecDecError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must be one JSON object") from err
        prompts.append(_parse_line(obj, where, lineno, path.parent))
    if not prompts:
        raise SpecDecError(f"prompt file {path} has no prompts; each line must be a JSON object with a 'prompt' or 'turns' field")
    if limit is not None and limit < len(prompts):
        prompts = [prompts[round(i * len(prompts) / limit)] for i in range(limit)]
    return prompts
