"""Forward-latency profiles f(B, c, n) of a target/draft pair, for cost-aware trees (CAST)."""

from specdec.cost.profile import (
    SHIPPED_PROFILE,
    CostTableResolver,
    ProfileGrid,
    ProfileSource,
    batch_grid,
    forget_measured,
    profile_models,
    quick_grid,
)
from specdec.cost.table import CostTable, FieldDiff, device_identity, model_identity, model_shape, select_context

__all__ = [
    "SHIPPED_PROFILE",
    "CostTable",
    "CostTableResolver",
    "FieldDiff",
    "ProfileGrid",
    "ProfileSource",
    "batch_grid",
    "device_identity",
    "forget_measured",
    "model_identity",
    "model_shape",
    "profile_models",
    "quick_grid",
    "select_context",
]
