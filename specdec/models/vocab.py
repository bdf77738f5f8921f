"""Draft and target output widths that differ while the tokenizer is the same.

Checkpoints of one family pad their embedding matrices to different multiples: Qwen2.5-7B
has 152,064 rows, Qwen2.5-0.5B 151,936, and both use the same tokenizer of 151,665 tokens.
Every distribution the tree policy, the draft source and the accept rule compare must
have the target's width, and no token the tokenizer cannot produce may be drafted:

    draft logits [..., V_draft]  --fit_draft_logits-->  [..., V_target]
    ids < drafted            : the draft's logits (drafted = min(len(tokenizer), V_draft, V_target))
    drafted <= id < V_target : -inf (never drafted; the target may still emit them, as alone)

Worked example, V_draft = 5, V_target = 7, len(tokenizer) = 4:
    [a, b, c, d, e] -> [a, b, c, d, -inf, -inf, -inf]
and V_draft = 7, V_target = 5, len(tokenizer) = 4:
    [a, b, c, d, e, f, g] -> [a, b, c, d, -inf]

The accept rules stay lossless: they only need the draft distribution the tree was drafted
from, whatever it is. The other way round, a narrower draft may be fed an id it has no row
for: only when the target itself emits an id beyond the tokenizer (an untrained padding
row). `fit_draft_inputs` feeds the draft id 0 in its place; that only changes what the
draft guesses next, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel


def output_width(model: PreTrainedModel) -> int:
    """Rows of the model's output layer: the width of its logits."""
    head = model.get_output_embeddings()
    width = getattr(head, "out_features", None)  # nn.Linear and quantized linears keep the logical width here
    if isinstance(width, int):
        return width
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


@dataclass(frozen=True)
class VocabFit:
    """How draft logits are brought to the target's width."""

    target_width: int
    """V_target: the width of every distribution the engine compares"""
    drafted: int
    """ids [0, drafted) may be drafted: min(len(tokenizer), V_draft, V_target)"""
    draft_width: int
    """V_draft: ids at or beyond it reach the draft as 0"""

    @classmethod
    def for_pair(cls, target: PreTrainedModel, draft: PreTrainedModel, tokenizer_len: int) -> VocabFit | None:
        """The fit for a target/draft pair sharing a tokenizer of `tokenizer_len` tokens; None
        when the draft's logits need no change (same width, every id a token)."""
        target_width, draft_width = output_width(target), output_width(draft)
        drafted = min(tokenizer_len, draft_width, target_width)
        if draft_width == target_width == drafted:
            return None
        return cls(target_width=target_width, drafted=drafted, draft_width=draft_width)


def fit_draft_logits(logits: torch.Tensor, fit: VocabFit | None) -> torch.Tensor:
    """logits: [..., V_draft] -> [..., V_target] with ids >= fit.drafted at -inf (see the module
    docstring); unchanged when `fit` is None."""
    if fit is None:
        return logits
    out = logits.new_full((*logits.shape[:-1], fit.target_width), float("-inf"))  # [..., V_target]
    out[..., : fit.drafted] = logits[..., : fit.drafted]
    return out


def fit_draft_inputs(ids: torch.Tensor, fit: VocabFit | None) -> torch.Tensor:
    """Token ids [...] about to be fed to the draft, with ids it has no row for replaced by 0;
    unchanged when `fit` is None."""
    if fit is None:
        return ids
    return ids.masked_fill(ids >= fit.draft_width, 0)
