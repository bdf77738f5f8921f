"""Invariant 1: greedy speculative output equals the target's own greedy `generate` output."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, EOS, sharpen, tiny_model

from specdec.bench.treesim import gpu_like_table
from specdec.cost import CostTable
from specdec.engine import SpeculativeEngine
from specdec.methods import make_policy
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule

METHODS = {
    "ar": {},
    "chain": {"k": 4},
    "static": {"depth": 3, "branching": 2, "max_nodes": 12},
    "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10},
}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]]


def reference(target, prompt: list[int], max_new: int, eos: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def run(target, draft, method: str, prompt: list[int], max_new: int, eos: int) -> list[int]:
    engine = SpeculativeEngine(target, make_policy(method, **METHODS[method]), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[eos])
    return engine.generate([prompt], max_new)[0].token_ids


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft_kind", ["close", "disagreeing"])
def test_greedy_matches_generate(arch, draft_kind):
    target = sharpen(tiny_model(arch, seed=0))
    if draft_kind == "close":  # same weights plus noise: often agrees, sometimes not
        draft = sharpen(tiny_model(arch, seed=0))
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(0.02 * torch.randn_like(p))
    else:  # an unrelated random model: almost never agrees
        draft = tiny_model(arch, seed=7, layers=1)
    accepted_any = False
    for method in METHODS:
        for prompt in PROMPTS:
            ref = reference(target, prompt, 24, EOS)
            engine = SpeculativeEngine(target, make_policy(method, **METHODS[method]), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
            out = engine.generate([prompt], 24)[0]
            assert out.token_ids == ref, f"{arch}/{draft_kind}/{method}/{prompt}"
            accepted_any |= out.stats.accepted_tokens > 0
    if draft_kind == "close":
        assert accepted_any, "the close draft should get some tokens accepted"


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_stops_at_eos_like_generate(arch):
    """Pick as EOS a token the target emits mid-sequence: every method must stop right there."""
    target = sharpen(tiny_model(arch, seed=0))
    draft = sharpen(tiny_model(arch, seed=0))
    prompt = PROMPTS[0]
    free = reference(target, prompt, 20, eos=-1 % 96)
    eos = free[6]
    ref = reference(target, prompt, 20, eos)
    assert ref[-1] == eos and len(ref) <= 7
    for method in METHODS:
        engine = SpeculativeEngine(target, make_policy(method, **METHODS[method]), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[eos])
        out = engine.generate([prompt], 20)[0]
        assert out.token_ids == ref, method
        assert out.finish_reason == "eos"


def test_exact_token_budget_with_long_trees():
    """Trees deeper than the remaining budget must not overshoot max_new_tokens."""
    target = sharpen(tiny_model("llama", seed=0))
    for max_new in (1, 2, 3, 7):
        for method in METHODS:
            out = run(target, target, method, PROMPTS[1], max_new, eos=-1 % 96)
            assert len(out) == max_new
            assert out == reference(target, PROMPTS[1], max_new, eos=-1 % 96)


def test_batched_greedy_equals_unbatched():
    """Rows of a batch (different prompt lengths, left padding) decode as they would alone."""
    target = sharpen(tiny_model("llama", seed=0))
    draft = sharpen(tiny_model("llama", seed=0))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn_like(p))
    for method in METHODS:
        engine = SpeculativeEngine(target, make_policy(method, **METHODS[method]), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
        batched = [o.token_ids for o in engine.generate(PROMPTS, 20)]
        alone = [run(target, draft, method, p, 20, EOS) for p in PROMPTS]
        assert batched == alone, method


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_rolling_batch_retires_and_admits(batch_size):
    """More prompts than rows: finished rows take waiting prompts (different lengths, EOS
    stops) and every prompt still gets its unbatched greedy output."""
    target = sharpen(tiny_model("gpt2", seed=0))
    draft = sharpen(tiny_model("gpt2", seed=0))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn_like(p))
    prompts = [*PROMPTS, [7, 8], [30 + i for i in range(12)], [50, 51, 52, 53]]
    eos = reference(target, prompts[0], 20, eos=-1 % 96)[4]  # an EOS some prompts hit early
    for method in ("ar", "chain", "eagle2"):
        engine = SpeculativeEngine(target, make_policy(method, **METHODS[method]), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[eos])
        streamed: dict[int, list[int]] = {}

        def collect(i: int, toks: list[int], into: dict[int, list[int]] = streamed) -> None:
            into.setdefault(i, []).extend(toks)

        outs = engine.generate(prompts, 16, batch_size=batch_size, stream=collect)
        for i, prompt in enumerate(prompts):
            assert outs[i].token_ids == reference(target, prompt, 16, eos), (method, batch_size, i)
            assert streamed[i] == outs[i].token_ids


SMALL_BUDGETS = {
    "static": {"depth": 5, "branching": 3, "max_nodes": 25},  # 3 + 9 + 13 of 27: the budget runs out inside level 3
    "eagle2": {"depth": 5, "top_k": 3, "total_tokens": 5},
    "dynatree": {"max_nodes": 4, "phase": 0},
    "cast": {"total_tokens": 5, "top_k": 3, "prune_rule": "threshold", "rerank_rule": "threshold"},  # cost table set below
}


def _dynatree_in_a_free_width(arch: str, batch_size: int, **options: object) -> list[tuple[int, int]]:
    """Decode PROMPTS with a DynaTree of `options` over a draft close to the target, assert the
    target's own greedy output, and return (rows, the widest row's tree) per step."""
    target = sharpen(tiny_model(arch, seed=0))
    draft = sharpen(tiny_model(arch, seed=0))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn_like(p))
    policy = make_policy("dynatree", **options)
    widths: list[tuple[int, int]] = []
    draft_step = policy.draft

    def recorded(source, roots, ctx):
        out = draft_step(source, roots, ctx)
        widths.append((roots.shape[0], int(out.tree.valid.sum(dim=1).max())))
        return out

    policy.draft = recorded  # type: ignore[method-assign]
    engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, 20, batch_size=batch_size), strict=True):
        assert out.token_ids == reference(target, prompt, 20, EOS), (arch, batch_size, options, prompt)
    return widths


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_dynatree_inside_a_free_verification_width(arch, batch_size):
    """DynaTree with a free verification width (no pruning, the best nodes by p over all levels,
    at most free_tokens // B - 1 a row) gives the target's own greedy output."""
    widths = _dynatree_in_a_free_width(arch, batch_size, free_tokens=12)
    assert all(width <= 12 // rows for rows, width in widths)  # the root and at most free_tokens // B - 1 draft tokens
    assert max(width for _, width in widths) > 2  # the trees did grow into the free width


@pytest.mark.parametrize("batch_size", [1, 2])
def test_dynatree_inside_a_measured_free_width(batch_size):
    """DynaTree whose free width is measured from a cost table (the knee of a table flat to 16
    tokens over the batch: 15 draft tokens a row at B = 1, 7 at B = 2) gives the target's own
    greedy output, and its trees stay inside that width."""
    widths = _dynatree_in_a_free_width("llama", batch_size, cost_table=gpu_like_table(flat_tokens=16))
    assert all(width <= 16 // rows for rows, width in widths)  # the root and the measured width
    assert max(width for _, width in widths) > 4  # more than the paper's pruning keeps on this draft


@pytest.mark.parametrize("method", sorted(SMALL_BUDGETS))
def test_node_budgets_that_end_inside_a_level(method):
    """A node budget running out part-way through a level (the old static tree crashed there)
    still gives the target's own greedy output, at batch sizes 1 and 2."""
    target = sharpen(tiny_model("llama", seed=0))
    draft = sharpen(tiny_model("llama", seed=0))  # agrees: deep trees, budgets bind
    options = dict(SMALL_BUDGETS[method])
    if method == "cast":  # a GPU-like table: verification nearly flat in tokens, so budgets bind
        options["cost_table"] = CostTable.synthetic(lambda b, c, n: 10.0 + 0.01 * b * n, lambda b, c, n: 1.0 + 0.01 * b * n)
    engine = SpeculativeEngine(target, make_policy(method, **options), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
    outs = engine.generate(PROMPTS[:2], 20)
    for prompt, out in zip(PROMPTS[:2], outs, strict=True):
        assert out.token_ids == reference(target, prompt, 20, EOS)
