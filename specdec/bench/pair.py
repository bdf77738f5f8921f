"""Loading a benchmark's target/draft pair the same way in every bench command."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.bench.config import PairRunConfig
from specdec.models.loading import (
    bundled_draft,
    bundled_target,
    check_same_tokenizer,
    load_model,
    load_processor,
    load_tokenizer,
    pair_load_options,
)
from specdec.multimodal.inputs import is_multimodal


@dataclass
class LoadedPair:
    """A benchmark's models, loaded once and shared by every method of the run."""

    target: PreTrainedModel
    draft: PreTrainedModel | None
    """None unless a measured method drafts with the draft model"""
    tokenizer: PreTrainedTokenizerBase
    target_path: str
    draft_path: str | None
    """the loaded draft's path (None when no draft was loaded)"""
    processor: Any = None
    """the target's image+text processor (vision-language targets only)"""


def pair_paths(config: PairRunConfig) -> tuple[str, str | None]:
    """The target and draft to load: the bundled pair's when no target is given (a given
    draft then replaces the bundled one)."""
    if config.target is None:
        return bundled_target(), config.draft or bundled_draft()
    return config.target, config.draft


def load_pair(config: PairRunConfig, target_path: str, draft_path: str | None) -> LoadedPair:
    """Load the tokenizer, the draft (when `draft_path` is given; it must share the target's
    tokenizer) and the target, with `config`'s device, dtype and loading options."""
    target_load, draft_load = pair_load_options(**config.load_options)
    tokenizer = load_tokenizer(target_path, "target", target_load)
    draft = None
    if draft_path is not None:
        check_same_tokenizer(tokenizer, load_tokenizer(draft_path, "draft", draft_load))
        draft = load_model(draft_path, "draft", config.device, config.dtype, draft_load)
    target = load_model(target_path, "target", config.device, config.dtype, target_load)
    processor = load_processor(target_path, "target", target_load) if is_multimodal(target) else None
    return LoadedPair(target=target, draft=draft, tokenizer=tokenizer, target_path=target_path, draft_path=draft_path, processor=processor)
