"""The tree-policy protocol."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from specdec.drafting.builder import Draft, DraftContext

if TYPE_CHECKING:
    from specdec.cost.profile import CostTableResolver
    from specdec.cost.table import CostTable
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


@runtime_checkable
class CostAwarePolicy(TreePolicy, Protocol):
    """A policy that shapes its trees from the pair's forward costs (CAST): the decoder binds
    it to the loaded models once, sharing one cost-table resolver per `cost_profile`."""

    cost_profile: str | None
    """a JSON file from `specdec profile`, or None (measure or use an injected table)"""
    cost_table: CostTable | None
    """an injected table (used as is), or None"""

    def bind_models(self, target: torch.nn.Module, draft: torch.nn.Module | None, resolver: CostTableResolver | None = None) -> None:
        """Attach the target and draft models (and a shared resolver of their cost tables)."""
        ...
