"""Grouped prefill: a batch of prompts of very different lengths is prefilled one group of similar
lengths at a time (`prefill_groups`), and leaves the same logits, cache and output as one padded
forward."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS, sharpen, tiny_any_config, tiny_model
from transformers import AutoModelForCausalLM

from specdec.engine import SpeculativeEngine
from specdec.methods import make_policy
from specdec.models.runner import PREFILL_FORWARD_TOKENS, ModelRunner, prefill_groups
from specdec.padding import pad_rows
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule

CPU = torch.device("cpu")


def test_groups_follow_the_docstring_example():
    assert prefill_groups([600, 40, 580, 30], CPU) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("lengths", [[50, 50, 50], [7], [], [100, 90, 95, 99], [300, 0, 10]])
def test_one_padded_forward_when_grouping_saves_nothing(lengths):
    """Equal or close lengths, one row, or an empty prompt (nothing to slice): no groups."""
    assert prefill_groups(lengths, CPU) is None


@pytest.mark.parametrize("seed", range(5))
def test_groups_cover_every_row_and_cost_no_more(seed):
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 2000, (int(torch.randint(2, 33, (1,), generator=rng)),), generator=rng).tolist()
    groups = prefill_groups(lengths, CPU)
    if groups is None:
        return
    assert sorted(row for g in groups for row in g) == list(range(len(lengths)))
    longest = [max(lengths[r] for r in g) for g in groups]
    assert longest == sorted(longest, reverse=True) and longest[0] == max(lengths)
    overhead = PREFILL_FORWARD_TOKENS["cpu"]
    grouped = sum(len(g) * m + overhead for g, m in zip(groups, longest, strict=True))
    assert grouped < len(lengths) * max(lengths) + overhead
    assert prefill_groups(lengths, torch.device("cuda")) is None or len(prefill_groups(lengths, torch.device("cuda"))) <= len(groups)


PROMPTS = [list(range(5, 85)), [10, 11, 12], list(range(3, 81)), [40, 41], list(range(20, 60))]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral", "deepseek_v3"])
def test_grouped_prefill_equals_one_padded_forward(arch):
    """Same last logits, same valid slots, and the same logits for a next token forwarded after it.
    DeepSeek-V3's cache holds keys and values of different widths: the batch cache built from the
    groups' must keep their views (it crashed at its next forward before)."""
    if arch in ("mistral", "deepseek_v3"):  # mistral: a sliding window of 8, positions after the splice must still be right
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_any_config(arch, vocab=128)).eval()
    else:
        model = tiny_model(arch, seed=0, vocab=128)
    ids, mask = pad_rows(PROMPTS, 0, side="left")
    assert prefill_groups(mask.sum(dim=1).tolist(), CPU) is not None, "the prompts must be grouped"
    grouped, padded = ModelRunner(model), ModelRunner(model)
    with torch.inference_mode():
        got = grouped.prefill(ids, mask)
        ref = padded._prefill_padded(ids, mask, None, dense=False)
    assert torch.allclose(got, ref, atol=1e-5)
    assert torch.equal(grouped.committed_len(), padded.committed_len())
    nxt = torch.tensor([[7], [8], [9], [10], [11]])
    see = torch.ones(5, 1, 0, dtype=torch.bool)
    with torch.inference_mode():
        a = grouped.forward(nxt, grouped.committed_len()[:, None], see)
        b = padded.forward(nxt, padded.committed_len()[:, None], see)
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("static_shapes", [False, True], ids=["dynamic", "static-shapes"])
@pytest.mark.parametrize("method", ["ar", "chain", "eagle2", "dynatree"])
def test_greedy_output_after_a_grouped_prefill_equals_generate(method, static_shapes):
    target = sharpen(tiny_model("llama", seed=0, vocab=128))
    draft = sharpen(tiny_model("llama", seed=0, vocab=128))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn_like(p))
        refs = [target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(p) :].tolist() for p in PROMPTS]
    options = {"chain": {"k": 4}, "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10}, "dynatree": {"max_nodes": 12}}.get(method, {})
    source = ModelDraftSource(draft, static_shapes=static_shapes)
    engine = SpeculativeEngine(target, make_policy(method, **options), GreedyRule(), source, eos_token_ids=[EOS], static_shapes=static_shapes)
    outs = engine.generate(PROMPTS, 16)
    outs += engine.generate(PROMPTS[::-1], 16, batch_size=2)[::-1]  # rolling: later prompts prefilled into finished rows
    refs += refs
    assert [o.token_ids for o in outs] == refs
