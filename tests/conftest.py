"""Shared fixtures: tiny randomly initialised models of several architectures, and a tiny
saved target/draft pair with a trained tokenizer (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

torch.set_num_threads(1)

VOCAB = 96
EOS = 2
ARCHS = ("llama", "gpt_neox", "gpt2", "qwen2")


def tiny_config(arch: str, layers: int = 2, hidden: int = 32, vocab: int = VOCAB, eos: int = EOS, max_pos: int = 256):
    """A tiny config of `arch` (random weights come from the seed set before from_config)."""
    common = {"vocab_size": vocab, "eos_token_id": eos, "bos_token_id": 1, "pad_token_id": 0}
    if arch == "llama":
        return LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos, **common)
    if arch == "gpt_neox":
        return GPTNeoXConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=max_pos, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=max_pos, **common)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int, **kwargs):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **kwargs)).eval()


def sharpen(model, scale: float = 6.0):
    """Scale the output layer so the random model has peaked (less tie-prone) distributions."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory) -> Path:
    """A saved GPT-NeoX target/draft pair with a small trained BPE tokenizer: dir/target, dir/draft."""
    from specdec.training.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("pair")
    text = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n", "class A:\n    pass\n"] * 50
    tok = train_tokenizer(text, root / "tokenizer", vocab_size=300, min_frequency=1)
    vocab = len(tok)
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        torch.manual_seed(seed)
        cfg = tiny_config("gpt_neox", layers=layers, vocab=vocab, eos=tok.eos_token_id)
        cfg.pad_token_id = tok.pad_token_id
        model = sharpen(AutoModelForCausalLM.from_config(cfg).eval())
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def cli_args(command: str, pair: Path, prompts: Path, out: Path, max_new_tokens: int, repeats: int, *extra: str) -> list[str]:
    """`specdec bench`/`sweep` arguments for the tiny pair on CPU, quiet."""
    return [
        command, "--prompts", str(prompts), "--target", str(pair / "target"), "--draft", str(pair / "draft"), "--device", "cpu",
        "--max-new-tokens", str(max_new_tokens), "--repeats", str(repeats), "--no-progress", "--out", str(out), *extra,
    ]
