"""LongRoPE frequencies chosen per token, the way `generate()` chooses them one forward at a time.

transformers' LongRoPE (Phi-3/3.5/4-mini's `rope_type: longrope`) picks one set of rotary
frequencies for a whole forward: the long factors when the forward's largest position id is at
or past `original_max_position_embeddings` (4096 for Phi-3.5-mini), the short ones otherwise.
`generate()` forwards one new token at a time, so a token at position p gets the long factors
exactly when p >= that length; a prompt longer than it gets them at every position (one prefill
forward). A verification forward holds several positions at once, and a batch holds several rows:
with the model's own rule, a tree whose root is below the boundary and whose deepest node is past
it, or a row beside another row past it, would rotate its earlier tokens with the long factors,
and their keys would stay in the cache that way (on a tiny Phi-3 crossing the boundary, every
method's greedy tokens left `generate()`'s a few tokens later).

`LongRopeSelector` wraps each such rotary module of a model so that, inside `ModelRunner`'s
forwards only (`scope`), every token gets the frequencies `generate()` gives it: long where its
position is past the boundary (`prefill=False`), or, in a prefill, where its row's prompt is longer
than the boundary (`prefill=True`). Outside `scope` the module runs unchanged, so transformers'
own `generate()` on the same model (the bench's Hugging Face peers) keeps its behaviour. The
selection is a few tensor ops on the device with no host read, so it replays inside CUDA graphs.

Phi-3, Phi-3.5, Phi-4-mini and PhiMoE go further: their `generate()` (`prepare_inputs_for_generation`)
drops the cache when the sequence first reaches `config.original_max_position_embeddings + 1`
tokens and re-encodes the whole sequence in one forward, so with the long factors everywhere
(`REENCODING_MODEL_TYPES`). `reencode_length` is that length; the decode session does the same for
each row (`DecodeSession._reencode_rows`): a step commits no token past it, and the row's target
and draft caches are prefilled again from its whole sequence, whose last logits choose the next
token. Rows whose prompts have images are not re-encoded (their length in tokens is the model's).

Dynamic NTK scaling (`rope_type: dynamic`) is not covered: its frequencies follow the longest
sequence the module has seen so far (state kept across calls, so even `generate()` gives a prompt
different logits after a longer one) and change at every position past the original length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

REENCODING_MODEL_TYPES = frozenset({"phi3", "phimoe", "phi4_multimodal"})
"""LongRoPE models whose `generate()` re-encodes the whole sequence with the long factors when it
first passes `original_max_position_embeddings` (their `prepare_inputs_for_generation` drops the cache)"""


class LongRopeSelector:
    """The LongRoPE rotary modules of one model, wrapped once (`for_model`)."""

    def __init__(self, modules: list[tuple[nn.Module, int]], reencode_length: int | None = None) -> None:
        self.modules = modules
        """(rotary module, original_max_position_embeddings) of each wrapped module"""
        self.reencode_length = reencode_length
        """the sequence length (prompt and generated tokens) at which the model's `generate()` drops its cache and
        re-encodes the whole sequence with the long factors (`REENCODING_MODEL_TYPES`); None for other models"""

    @classmethod
    def for_model(cls, model: nn.Module) -> LongRopeSelector | None:
        """The model's selector (made and installed on first use, then shared by every runner of
        the model); None when no rotary module uses LongRoPE with one frequency set for the model."""
        existing = getattr(model, "_specdec_longrope", None)
        if existing is not None:
            return existing if existing.modules else None
        found: list[tuple[nn.Module, int]] = []
        for module in model.modules():
            if getattr(module, "rope_type", None) != "longrope" or not hasattr(module, "original_inv_freq"):
                continue  # (a per-layer-type dict of rope types is left to the model's own rule)
            params = getattr(getattr(module, "config", None), "rope_parameters", None) or {}
            boundary = params.get("original_max_position_embeddings") if isinstance(params, dict) else None
            if isinstance(boundary, int) and boundary > 0:
                _wrap(module, boundary)
                found.append((module, boundary))
        config = getattr(model, "config", None)
        boundary = getattr(config, "original_max_position_embeddings", None)  # the attribute their generate() reads
        reencodes = found and getattr(config, "model_type", None) in REENCODING_MODEL_TYPES and isinstance(boundary, int) and boundary > 0
        selector = cls(found, reencode_length=boundary + 1 if reencodes else None)
        model._specdec_longrope = selector  # type: ignore[assignment]
        return selector if found else None

    @contextmanager
    def scope(self, prefill: bool) -> Iterator[None]:
        """Within: the wrapped modules choose frequencies per token (`prefill`: by each row's
        longest position, as one prefill forward per prompt would; else by each token's own)."""
        previous = [getattr(module, "_specdec_rope_mode", None) for module, _ in self.modules]
        for module, _ in self.modules:
            module._specdec_rope_mode = "prefill" if prefill else "token"  # type: ignore[assignment]
        try:
            yield
        finally:
            for (module, _), mode in zip(self.modules, previous, strict=True):
                module._specdec_rope_mode = mode  # type: ignore[assignment]


def _wrap(module: nn.Module, boundary: int) -> None:
    """Replace `module.forward` (the model's decorated rotary forward) by one that, in a runner's
    scope, computes both frequency sets and picks one per token."""
    original: Callable[..., Any] = module.forward
    module._specdec_rope_mode = None  # type: ignore[assignment]

    def forward(x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        mode = module._specdec_rope_mode
        if mode is None or position_ids.dim() != 2 or args or kwargs:
            return original(x, position_ids, *args, **kwargs)
        # position_ids [B, n]; long [B, n]: the tokens generate() would rotate with the long factors
        if mode == "prefill":
            long = (position_ids.amax(dim=1, keepdim=True) >= boundary).expand_as(position_ids)
        else:
            long = position_ids >= boundary
        # the model's rule picks by the forward's largest position: short with every long token's
        # position zeroed (all below the boundary), long with one extra position at the boundary
        cos_short, sin_short = original(x, position_ids.masked_fill(long, 0))
        padded = torch.cat([position_ids, position_ids.new_full((position_ids.shape[0], 1), boundary)], dim=1)
        cos_long, sin_long = original(x, padded)
        pick = long[..., None]  # [B, n, 1] against cos/sin [B, n, rotary dim]
        return torch.where(pick, cos_long[:, :-1], cos_short), torch.where(pick, sin_long[:, :-1], sin_short)

    module.forward = forward  # type: ignore[method-assign]
