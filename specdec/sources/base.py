"""The draft-source protocol: next-token distributions for a batch of tree nodes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from specdec.sampling import SamplingParams

if TYPE_CHECKING:
    from specdec.drafting.builder import TreeBuilder
    from specdec.stats import StepRecord


class DraftSource(Protocol):
    """Where draft distributions come from (a draft model, an ensemble of views, n-gram lookup).

    A step is `begin_step` (the root's distribution), any number of `expand` calls (one per
    tree level, all frontier nodes of all rows batched), then `end_step` with the verdict.
    """

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[int] | None = None, prompts: Sequence[Sequence[int]] | None = None
    ) -> None:
        """input_ids, attention_mask: [B', L] left-padded prompts (1 = real token), as the
        target sees them. With `rows` None they start a new batch; otherwise they replace
        those rows of the running batch. `prompts` are the prompt objects themselves (a
        `MultimodalPrompt` carries images and text, from which a source builds its own view)."""
        ...

    def keep_rows(self, rows: list[int]) -> None:
        """Shrink the batch to `rows` (finished rows retire)."""
        ...

    def begin_step(self, roots: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """roots: [B] int64, the last committed token of each row. Returns the draft
        log-distribution of the root's children: [B, V] float32 (after `params`)."""
        ...

    def expand(self, builder: TreeBuilder, nodes: torch.Tensor, valid: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """nodes: [B, k] builder node indices to expand (valid: [B, k] bool). Returns the draft
        log-distribution over each node's children: [B, k, V] float32."""
        ...

    needs_target_logprobs: bool
    """whether `end_step` wants the target's distributions on the accepted path"""

    def end_step(self, builder: TreeBuilder, accepted_nodes: list[list[int]], target_logprobs: list[torch.Tensor | None] | None = None) -> None:
        """accepted_nodes: per row, builder indices of the accepted path (root excluded).
        target_logprobs (only when `needs_target_logprobs`): per row, [1 + len(path), V], the
        target's log-distributions at the root and each accepted node (None for finished rows)."""
        ...

    def feedback(self, record: StepRecord) -> None:
        """Called after every step (adaptive sources learn here)."""
        ...

    @property
    def forward_s(self) -> float:
        """Cumulative wall time inside model forwards (0 for sources without a model)."""
        ...
