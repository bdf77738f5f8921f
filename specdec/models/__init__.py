"""Model loading and the KV-cached model runner."""

from specdec.models.loading import check_same_tokenizer, load_model, load_tokenizer
from specdec.models.runner import ModelRunner

__all__ = ["ModelRunner", "check_same_tokenizer", "load_model", "load_tokenizer"]
