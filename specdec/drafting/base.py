"""The tree-policy protocol."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from specdec.drafting.builder import Draft, DraftContext

if TYPE_CHECKING:
    from specdec.sources.base import DraftSource
    from specdec.stats import StepRecord


class TreePolicy(Protocol):
    """Decides the shape of each step's draft tree."""

    name: str
    uses_draft: bool
    """False only for plain autoregressive decoding"""

    def draft(self, source: DraftSource, roots: torch.Tensor, ctx: DraftContext) -> Draft:
        """Build this step's trees. roots: [B] int64."""
        ...

    def feedback(self, record: StepRecord) -> None:
        """Called after every verification step with its record (adaptive policies learn here)."""
        ...
