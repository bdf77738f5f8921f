"""Draft sources: a draft model (and, later, ensembles of views and n-gram lookup)."""

from specdec.sources.base import DraftSource
from specdec.sources.ensemble import EnsembleConfig, EnsembleDraftSource
from specdec.sources.model import ModelDraftSource

__all__ = ["DraftSource", "EnsembleConfig", "EnsembleDraftSource", "ModelDraftSource"]
