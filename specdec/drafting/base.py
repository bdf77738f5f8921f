"""The tree-policy protocol."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from specdec.drafting.builder import DraftContext, TreeBuilder
from specdec.tree import TokenTree

if TYPE_CHECKING:
    from specdec.sources.base import DraftSource
    from specdec.stats import StepRecord


class TreePolicy(Protocol):
    """Decides the shape of each step's draft tree."""

    name: str
    uses_draft: bool
    """False only for plain autoregressive decoding"""

    def draft(self, source: DraftSource, roots: torch.Tensor, ctx: DraftContext) -> tuple[TokenTree, TreeBuilder | None, torch.Tensor]:
        """Build this step's trees. roots: [B] int64. Returns (tree, builder, origin) where
        origin [B, N] maps tree nodes to builder nodes (for committing the draft cache)."""
        ...

    def feedback(self, record: StepRecord) -> None:
        """Called after every verification step with its record (adaptive policies learn here)."""
        ...
