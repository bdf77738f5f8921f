"""Tree policies: who decides each step's draft-tree shape."""

from specdec.drafting.base import TreePolicy
from specdec.drafting.builder import DraftContext, TreeBuilder
from specdec.drafting.policies import ARPolicy, ChainPolicy, Eagle2Policy, StaticTreePolicy

__all__ = ["ARPolicy", "ChainPolicy", "DraftContext", "Eagle2Policy", "StaticTreePolicy", "TreeBuilder", "TreePolicy"]
