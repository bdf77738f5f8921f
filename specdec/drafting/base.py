"""The tree-policy protocol."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

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
    """A policy that reads the pair's forward costs: CAST shapes its trees from them, DynaTree
    sizes its free verification width from them (on CUDA, or given a profile). The decoder binds
    it to the loaded models once, sharing one cost-table resolver per `cost_profile`."""

    cost_profile: str | None
    """a JSON file from `specdec profile`, or None (measure or use an injected table)"""
    cost_table: CostTable | None
    """an injected table (used as is), or None"""
    requires_cost_table: ClassVar[bool]
    """True: the policy cannot run without costs (CAST), so a draft source with no model to time
    needs a profile given; False: it falls back to a default without them (DynaTree)"""

    def wants_cost_table(self, device: torch.device) -> bool:
        """Whether, bound to a target on `device`, the policy loads or measures a cost table (the
        decoder registers a shared resolver only then, so nothing is measured for nothing)."""
        ...

    def bind_models(self, target: torch.nn.Module, draft: torch.nn.Module | None, resolver: CostTableResolver | None = None) -> None:
        """Attach the target and draft models (and a shared resolver of their cost tables)."""
        ...
