"""Loading target/draft models and tokenizers from local folders or hub ids."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specdec.errors import SpecDecError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_PAIR = ASSETS / "pair"
BUNDLED_LVLM = ASSETS / "lvlm"
"""the bundled tiny LLaVA-style pair (trained by `specdec train lvlm`)"""
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def bundled_target() -> str:
    """Folder of the bundled GPT-NeoX target (trained by `specdec train pair`)."""
    return str(BUNDLED_PAIR / "target")


def bundled_draft() -> str:
    """Folder of the bundled GPT-NeoX draft."""
    return str(BUNDLED_PAIR / "draft")


def bundled_lvlm_target() -> str:
    """Folder of the bundled LLaVA-style target (trained by `specdec train lvlm`)."""
    return str(BUNDLED_LVLM / "target")


def bundled_lvlm_draft() -> str:
    """Folder of the bundled LLaVA-style draft."""
    return str(BUNDLED_LVLM / "draft")


def resolve_device(device: str | None) -> torch.device:
    """'auto'/None -> CUDA when present, else CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise SpecDecError(f"device={device!r} is not a torch device; use 'cpu', 'cuda', 'cuda:0' or 'auto'") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecDecError(f"device={device!r} asked for CUDA but torch sees no GPU; use --device cpu")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto'/None -> float32 on CPU, bfloat16 on CUDA (float16 where bf16 is unsupported)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise SpecDecError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or os.sep in name and Path(name).parent.exists() or Path(name).exists()


def _check_source(name: str, what: str) -> str:
    if not name:
        raise SpecDecError(f"the {what} model name is empty; pass a local folder or a hub id")
    expanded = os.path.expanduser(name)
    if _looks_like_path(name) and not Path(expanded).exists():
        raise SpecDecError(f"{what} model path {name!r} does not exist; pass a folder saved with save_pretrained() or a hub id")
    return expanded if Path(expanded).exists() else name


def is_multimodal_source(name: str, what: str = "target") -> bool:
    """True when the model at `name` is a vision-language (LLaVA-family) model."""
    source = _check_source(name, what)
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise SpecDecError(f"could not read the config of {what} model {name!r}: {err}".strip()) from err
    return getattr(config, "vision_config", None) is not None


def load_model(name: str, what: str = "target", device: str | torch.device | None = None, dtype: str | torch.dtype | None = None) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` (`AutoModelForImageTextToText` for LLaVA-family
    models) with clear errors; returns the model in eval mode."""
    source = _check_source(name, what)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    auto = AutoModelForImageTextToText if is_multimodal_source(name, what) else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(source, dtype=torch_dtype)
    except (OSError, ValueError) as err:
        raise SpecDecError(f"could not load {what} model {name!r}: {err}".strip()) from err
    return model.to(dev).eval()


def load_tokenizer(name: str, what: str = "target") -> PreTrainedTokenizerBase:
    source = _check_source(name, what)
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise SpecDecError(f"could not load the tokenizer of {what} model {name!r}: {err}") from err


def load_processor(name: str, what: str = "target") -> Any:
    """The image+text processor of a LLaVA-family model (`AutoProcessor`)."""
    source = _check_source(name, what)
    try:
        return AutoProcessor.from_pretrained(source)
    except (OSError, ValueError, TypeError) as err:
        raise SpecDecError(f"could not load the processor of {what} model {name!r}: {err}; a vision-language model needs its processor files") from err


def check_same_tokenizer(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase) -> None:
    """Refuse a pair whose tokenizers map text to different ids."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        only_t = len(set(t_vocab.items()) - set(d_vocab.items()))
        raise SpecDecError(
            f"the target and draft tokenizers differ ({len(t_vocab)} vs {len(d_vocab)} tokens, {only_t} target entries "
            "missing or mapped differently in the draft); speculative decoding needs a draft that shares the target's tokenizer"
        )
    if target_tok.eos_token_id != draft_tok.eos_token_id:
        raise SpecDecError(f"the target's EOS id {target_tok.eos_token_id} differs from the draft's {draft_tok.eos_token_id}; use a draft with the same tokenizer")


def context_length(model: PreTrainedModel) -> int | None:
    """The model's maximum number of positions, from its config (None when it sets none)."""
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> list[int]:
    """EOS ids the way `generate()` sees them: generation_config first, then config, then tokenizer."""
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            return [value] if isinstance(value, int) else list(value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [tokenizer.eos_token_id]
    return []
