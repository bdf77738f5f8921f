"""Byte-level BPE tokenizer trained with Hugging Face `tokenizers`, saved in the standard format."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from specdec.errors import SpecDecError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def train_tokenizer(texts: Iterable[str], out_dir: Path, vocab_size: int = 8192, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and save it so `AutoTokenizer.from_pretrained(out_dir)` loads it."""
    if vocab_size < 300:
        raise SpecDecError(f"vocab_size={vocab_size} is too small for byte-level BPE (256 bytes + specials); use >= 300")
    bpe = ByteLevelBPETokenizer(add_prefix_space=False, trim_offsets=True)
    bpe.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN, PAD_TOKEN]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=None,
        pad_token=PAD_TOKEN,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer
