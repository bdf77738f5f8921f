"""Byte-level BPE tokenizer trained with Hugging Face `tokenizers`, saved in the standard format."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from specdec.errors import SpecDecError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MIN_VOCAB = 300
"""the smallest vocabulary trained: the 256 byte tokens, the specials and a few merges"""


def bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, eos: str, pad: str, max_length: int, min_frequency: int = 2, image_token: str | None = None
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts`, with `eos` (also BOS) and `pad` (and `image_token`,
    for vision-language pairs) as special tokens, wrapped for transformers."""
    bpe = ByteLevelBPETokenizer(add_prefix_space=False, trim_offsets=True)
    specials = [eos, pad, *([image_token] if image_token is not None else [])]
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials)
    extra = {"extra_special_tokens": {"image_token": image_token}} if image_token is not None else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=eos, eos_token=eos, pad_token=pad, unk_token=None, model_max_length=max_length,
        clean_up_tokenization_spaces=False, **extra,
    )


def train_tokenizer(texts: Iterable[str], out_dir: Path, vocab_size: int = 8192, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and save it so `AutoTokenizer.from_pretrained(out_dir)` loads it."""
    if vocab_size < MIN_VOCAB:
        raise SpecDecError(f"vocab_size={vocab_size} is too small for byte-level BPE (256 bytes + specials); use >= {MIN_VOCAB}")
    tokenizer = bpe_tokenizer(texts, vocab_size, EOS_TOKEN, PAD_TOKEN, max_length=2048, min_frequency=min_frequency)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer
