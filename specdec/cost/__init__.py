"""Forward-latency profiles f(B, c, n) of a target/draft pair, for cost-aware trees (CAST)."""

from specdec.cost.profile import SHIPPED_PROFILE, CostTableResolver, ProfileGrid, profile_models, quick_grid
from specdec.cost.table import CostTable, device_identity, model_identity, select_context

__all__ = [
    "SHIPPED_PROFILE",
    "CostTable",
    "CostTableResolver",
    "ProfileGrid",
    "device_identity",
    "model_identity",
    "profile_models",
    "quick_grid",
    "select_context",
]
