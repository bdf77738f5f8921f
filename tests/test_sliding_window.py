"""Sliding-window attention: the window is part of every mask (prefill, tree levels, verify).

Each config has a window of 6 tokens and prompts longer than it, so every generated token
attends to a truncated context; greedy output must equal the target's own `generate()`
(transformers' sliding caches), for every method, batch size 1 and 2 (left padding), in dynamic and
static shapes, on an all-sliding architecture (Mistral) and on mixed full/sliding layers (Qwen2,
Gemma-2).
"""

from __future__ import annotations

import pytest
import torch
from conftest import EOS, VOCAB, sharpen
from transformers import AutoModelForCausalLM, Gemma2Config, MistralConfig, Qwen2Config

from specdec.engine import SpeculativeEngine
from specdec.methods import make_policy
from specdec.models.runner import ModelRunner
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule

WINDOW = 6
COMMON = {"vocab_size": VOCAB, "eos_token_id": EOS, "bos_token_id": 1, "pad_token_id": 0, "hidden_size": 32, "intermediate_size": 64,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "sliding_window": WINDOW}
METHODS = {"ar": {}, "chain": {"k": 4}, "eagle2": {"depth": 3, "top_k": 3, "total_tokens": 8}, "static": {"depth": 2, "branching": 2, "max_nodes": 6}}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]]


def config(arch: str, layers: int):
    if arch == "mistral":
        return MistralConfig(num_hidden_layers=layers, **COMMON)
    if arch == "qwen2":  # layers past max_window_layers slide
        return Qwen2Config(num_hidden_layers=layers, use_sliding_window=True, max_window_layers=1, **COMMON)
    if arch == "gemma2":  # alternating sliding / full layers
        return Gemma2Config(num_hidden_layers=layers, head_dim=8, attn_implementation="eager", **COMMON)
    raise ValueError(arch)


def model(arch: str, seed: int, layers: int = 2):
    torch.manual_seed(seed)
    return sharpen(AutoModelForCausalLM.from_config(config(arch, layers)).eval())


def reference(target, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma2"])
def test_greedy_matches_generate_beyond_the_window(arch):
    target = model(arch, seed=0)
    draft = model(arch, seed=0, layers=1)
    expected = [reference(target, p, 16) for p in PROMPTS]
    assert all(len(p) + len(e) > 2 * WINDOW for p, e in zip(PROMPTS, expected, strict=True))
    for method, options in METHODS.items():
        engine = SpeculativeEngine(target, make_policy(method, **options), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
        for prompt, want in zip(PROMPTS, expected, strict=True):
            assert engine.generate([prompt], 16)[0].token_ids == want, (arch, method, prompt)
        batch = engine.generate(PROMPTS, 16)  # rows of different lengths: left padding, holes after commits
        assert [o.token_ids for o in batch] == expected, (arch, method, "batch")


def test_the_window_changes_the_output():
    """Control: the same weights without a window give other tokens on these prompts, so the
    test above would catch a mask that ignored the window."""
    target = model("mistral", seed=0)
    torch.manual_seed(0)
    unwindowed = sharpen(AutoModelForCausalLM.from_config(MistralConfig(num_hidden_layers=2, **{**COMMON, "sliding_window": None})).eval())
    unwindowed.load_state_dict(target.state_dict())
    assert any(reference(target, p, 16) != reference(unwindowed, p, 16) for p in PROMPTS)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma2"])
def test_static_shapes_keep_the_window(arch):
    """Static-shape forwards (the CUDA-graph mode) on sliding models: greedy output equals
    generate's for every method at batch size 2 (the window mask is a static buffer too)."""
    target = sharpen(model(arch, seed=0))
    draft = sharpen(model(arch, seed=1, layers=1))
    assert ModelRunner(target, static_shapes=True).static_shapes
    refs = [reference(target, p, 16) for p in PROMPTS]
    for method, options in METHODS.items():
        source = ModelDraftSource(draft, static_shapes=True)
        engine = SpeculativeEngine(target, make_policy(method, **options), GreedyRule(), source, eos_token_ids=[EOS], static_shapes=True)
        assert [o.token_ids for o in engine.generate(PROMPTS, 16, batch_size=2)] == refs, f"{arch}/{method}"
