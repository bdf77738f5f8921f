"""TokenTree structure, and invariant 3: tree logits equal sequential logits on every architecture."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, MORE_ARCHS, VOCAB, sharpen, tiny_any_config, tiny_model
from transformers import AutoModelForCausalLM

from specdec.drafting import DraftContext, StaticTreePolicy
from specdec.models.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.tree import TokenTree


def example_tree() -> TokenTree:
    """r -> a, b; a -> c (the example in tree.py's docstring), plus a padded second row r -> x."""
    tokens = torch.tensor([[10, 11, 12, 13], [20, 21, 0, 0]])
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, -1]])
    depths = torch.tensor([[0, 1, 1, 2], [0, 1, 0, 0]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    logq = torch.tensor([[0.0, -0.1, -2.0, -0.3], [0.0, -0.5, 0.0, 0.0]])
    return TokenTree(tokens, parents, depths, logq, logq.cumsum(1), valid, torch.zeros_like(valid))


def test_ancestor_mask_paths_and_padding():
    tree = example_tree()
    anc = tree.ancestor_mask()
    expected_row0 = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(anc[0], expected_row0)
    # padding nodes see only themselves and nobody sees them
    assert torch.equal(anc[1, 2], torch.tensor([False, False, True, False]))
    assert not anc[1, :2, 2:].any()
    assert tree.leaf_paths(0) == [[0, 2], [0, 1, 3]] or sorted(tree.leaf_paths(0)) == [[0, 1, 3], [0, 2]]
    assert tree.path_to(0, 3) == [0, 1, 3]
    assert tree.children(0, 0) == [1, 2]
    assert tree.nodes_per_row().tolist() == [4, 2]
    assert tree.drafted_per_row().tolist() == [3, 1]


def test_select_reindexes_and_pads():
    tree = example_tree()
    keep = torch.tensor([[True, True, False, True], [True, True, False, False]])
    sub = tree.select(keep)
    assert sub.tokens[0].tolist() == [10, 11, 13]
    assert sub.parents[0].tolist() == [-1, 0, 1]
    assert sub.valid[1].tolist() == [True, True, False]
    with pytest.raises(ValueError, match="closed under parents"):
        tree.select(torch.tensor([[True, False, False, True], [True, False, False, False]]))
    same, origin = tree.select_with_origin(keep)
    assert origin[0].tolist() == [0, 1, 3] and origin[1, :2].tolist() == [0, 1]  # each kept node's old index
    assert torch.equal(same.tokens, sub.tokens) and torch.equal(same.parents, sub.parents)
    assert torch.equal(tree.tokens.gather(1, origin)[same.valid], same.tokens[same.valid])


def test_select_on_large_trees():
    """Regression: the sort key once overflowed int8 above 63 nodes."""
    n = 200
    parents = torch.cat([torch.tensor([-1]), torch.arange(n - 1)])[None]  # a chain of 200 nodes
    tokens = torch.arange(n)[None]
    valid = torch.ones(1, n, dtype=torch.bool)
    zeros = torch.zeros(1, n)
    tree = TokenTree(tokens, parents, torch.arange(n)[None], zeros, zeros, valid, torch.zeros_like(valid))
    keep = torch.arange(n)[None] < 150
    assert tree.select(keep).tokens[0].tolist() == list(range(150))


def _model(arch: str, seed: int, layers: int = 2):
    if arch in ARCHS:
        return tiny_model(arch, seed=seed, layers=layers)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_any_config(arch, layers=layers)).eval()


@pytest.mark.parametrize("arch", ARCHS + MORE_ARCHS)
def test_tree_logits_match_sequential(arch):
    """Invariant 3, on a batch of two prompts of different lengths (left padding) and a real draft
    tree (MORE_ARCHS' sliding windows of 8 slots are crossed by the longer prompt's deep nodes)."""
    target = _model(arch, seed=0)
    draft = sharpen(_model(arch, seed=1, layers=1))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    width = max(map(len, prompts))
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    runner, source = ModelRunner(target), ModelDraftSource(draft)
    runner.prefill(ids[:, :-1], mask[:, :-1])  # the last prompt token is the root
    source.prefill(ids[:, :-1], mask[:, :-1])
    roots = ids[:, -1]
    ctx = DraftContext(SamplingParams(), None, max_depth=3, active=torch.ones(2, dtype=torch.bool))
    tree = StaticTreePolicy(depth=3, branching=2, max_nodes=12).draft(source, roots, ctx).tree
    logits = runner.forward(tree.tokens, runner.committed_len()[:, None] + tree.depths, tree.ancestor_mask())
    worst = 0.0
    for row, prompt in enumerate(prompts):
        for node in range(tree.num_nodes):
            if not tree.valid[row, node]:
                continue
            path = prompt[:-1] + tree.tokens[row, tree.path_to(row, node)].tolist()
            with torch.no_grad():
                ref = target(torch.tensor([path])).logits[0, -1]
            worst = max(worst, (logits[row, node] - ref).abs().max().item())
    assert tree.num_nodes > 8
    assert worst < 1e-4, f"{arch}: max |tree - sequential| = {worst}"
    assert logits.shape[-1] == VOCAB
