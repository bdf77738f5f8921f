"""Prompt lookup as a draft source: draft tokens copied from earlier in the context.

For a node, the context is the committed tokens plus the node's path. The source finds
the most recent earlier occurrence of the context's last n tokens (n from `max_ngram`
down to `min_ngram`) and proposes the token that followed it, as a point mass. With no
match it proposes nothing (all -inf), so tree policies stop growing that branch. No
model, no KV cache: `expand` costs a list search, not a forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.errors import SpecDecError
from specdec.sampling import SamplingParams
from specdec.sources.base import AcceptedPaths, NodeBatch

if TYPE_CHECKING:
    from specdec.stats import StepRecord


def lookup_next(context: list[int], max_ngram: int, min_ngram: int) -> int | None:
    """The token after the latest earlier occurrence of the context's trailing n-gram.

    Example: context [5, 6, 7, 9, 5, 6] with n=2 finds [5, 6] at index 0 -> proposes 7.
    """
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == tail:
                return context[start + n]
    return None


@dataclass
class LookupDraftSource:
    """n-gram prompt lookup (Saxena 2023; `generate(prompt_lookup_num_tokens=...)` in HF)."""

    vocab_size: int
    max_ngram: int = 3
    """longest n-gram matched"""
    min_ngram: int = 1
    """shortest n-gram matched"""
    always_proposes = False
    """a row without a match is all -inf (`DraftSource.always_proposes`)"""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_ngram", "min_ngram"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecDecError(f"lookup {name}={value!r} must be a positive integer")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise SpecDecError(f"lookup n-grams min={self.min_ngram}, max={self.max_ngram} need 1 <= min <= max")
        self.history: list[list[int]] = []

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[int] | None = None, prompts=None) -> None:
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)]
        if rows is None:
            self.history = prompts
        else:
            for row, prompt in zip(rows, prompts, strict=True):
                self.history[row] = prompt

    def keep_rows(self, rows: list[int], room: int | None = None) -> None:
        self.history = [self.history[r] for r in rows]

    def _propose(self, contexts: list[list[int]], device: torch.device) -> torch.Tensor:
        """Point-mass log-distributions [len(contexts), V] (all -inf where nothing matches)."""
        out = torch.full((len(contexts), self.vocab_size), float("-inf"), device=device)
        for i, ctx in enumerate(contexts):
            token = lookup_next(ctx, self.max_ngram, self.min_ngram)
            if token is not None:
                out[i, token] = 0.0
        return out

    def defer(self, roots: torch.Tensor) -> bool:
        """A step that drafts nothing: the root joins the history at `end_step`."""
        self._roots = roots.tolist()
        return True

    def begin_step(self, roots: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        self._roots = roots.tolist()
        return self._propose([h + [r] for h, r in zip(self.history, self._roots, strict=True)], roots.device)

    def expand(self, batch: NodeBatch, params: SamplingParams) -> torch.Tensor:
        b, k = batch.nodes.shape
        tokens, nodes, ancestors = batch.tokens.tolist(), batch.nodes.tolist(), batch.ancestors.tolist()  # one read each (a CPU method)
        contexts = []
        for row in range(b):
            for node in nodes[row]:
                path = [tokens[row][i] for i, on in enumerate(ancestors[row][node]) if on]  # root..node (BFS order)
                contexts.append(self.history[row] + path)
        return self._propose(contexts, batch.nodes.device).view(b, k, self.vocab_size)

    def end_step(self, accepted: AcceptedPaths) -> None:
        for row, tokens in enumerate(accepted.host_tokens):
            self.history[row] = self.history[row] + [self._roots[row]] + tokens

    def feedback(self, record: StepRecord) -> None:
        return None

    @property
    def forward_s(self) -> float:
        """Time inside model forwards: none, lookup runs no model."""
        return 0.0
