"""The fields every benchmark command shares, declared once (importable without torch).

`PairRunConfig`: prompts, output folder and the target/draft pair with its loading options
(`specdec bench`, `bench-serve`, `sweep`); `MeasuredRunConfig` adds the measurement's
length, repeats, seed and progress bar (`bench`, `sweep`). Each command's config extends one
of them, so results.json keeps one flat object per run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PairRunConfig:
    """Prompts, output folder and the model pair of a benchmark run."""

    prompts: str
    """'stdlib-heldout' (the bundled set), a scenario set or a JSONL(.gz) file"""
    out: str
    """output folder"""
    num_prompts: int | None = None
    """N prompts spread evenly over the set; None = all"""
    target: str | None = None
    """None: the bundled pair's target (and its draft unless `draft` is given)"""
    draft: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    load_options: dict[str, Any] = field(default_factory=dict)
    """loading keywords of `SpeculativeDecoder.from_pretrained` (device_map, quantization, revision, ...)"""


@dataclass
class MeasuredRunConfig(PairRunConfig):
    """A pair run measured in interleaved rounds of up to `max_new_tokens` per prompt."""

    max_new_tokens: int = 128
    repeats: int = 3
    """measured rounds over every prompt"""
    seed: int = 0
    """seeds the method order shuffle and every sampled call (the same seed for every method)"""
    progress: bool = True


def shared_fields(config: PairRunConfig, base: type[PairRunConfig]) -> dict[str, Any]:
    """The values of `base`'s fields in `config` (for building one command's config from another's)."""
    return {f.name: _copy(getattr(config, f.name)) for f in dataclasses.fields(base)}


def _copy(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value
