"""The chain's own path through the engine: a chain builder (`TreeBuilder(chain=True)`) lays out
parents, depths and ancestors up front, the draft source reads no ancestor rows, the accepted
prefix is found without the ancestor matrix and both caches keep it in place. Each piece must
give exactly what the general tree path gives for the same chain."""

from __future__ import annotations

import pytest
import torch
from conftest import sharpen, tiny_model

from specdec.drafting import ChainPolicy, DraftContext
from specdec.drafting.builder import TreeBuilder
from specdec.engine import SpeculativeEngine
from specdec.hostwork import HostWorkCounter
from specdec.models.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.tree import TokenTree
from specdec.verification import GreedyRule
from specdec.verification.base import deepest_path

V = 11


class RandomDraft:
    """A draft source whose distributions are fixed random rows, one per forward (no model)."""

    always_proposes = True

    def __init__(self, rows: int, levels: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.dists = torch.randn(levels + 1, rows, V, generator=g).log_softmax(-1)
        self.calls = 0

    def begin_step(self, roots, params):
        self.calls = 1
        return self.dists[0]

    def expand(self, batch, params):
        out = self.dists[self.calls][:, None, :].expand(*batch.nodes.shape, V)
        self.calls += 1
        return out


def _trees(active: list[bool], logq_inf: tuple[int, int] | None, sampled: bool) -> tuple[TokenTree, TokenTree]:
    """The same 4-node chain grown by the chain builder and by the general one."""
    rows, depth = len(active), 4
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (depth, rows, 1), generator=g)
    logq = -torch.rand(depth, rows, 1, generator=g)
    if logq_inf is not None:  # a row whose draft had no mass at some level: that node and the rest are invalid
        level, row = logq_inf
        logq[level, row] = float("-inf")
    params = SamplingParams(temperature=1.0) if sampled else SamplingParams()
    trees = []
    for chain in (True, False):
        ctx = DraftContext(params, None, max_depth=depth, active=torch.tensor(active), host_active=active)
        builder = TreeBuilder(RandomDraft(rows, depth, seed=0), torch.arange(rows), ctx, keep_draft_probs=sampled, capacity=1 + depth, chain=chain)
        parent = builder.root
        for level in range(depth):
            if chain:
                node = builder.add_chain_child(tokens[level], logq[level], sampled=sampled)
            else:
                node = builder.add(parent, tokens[level], logq[level], None, sampled=sampled, depth=level + 1)
            assert node.shape == (rows, 1)
            if level < depth - 1:
                builder.expand(node, builder.last_valid, depth=level + 1)
            parent = node
        trees.append(builder.finish().tree)
    return trees[0], trees[1]


@pytest.mark.parametrize("active", [[True, True, True], [True, False, True]], ids=["all-active", "a-finished-row"])
@pytest.mark.parametrize("logq_inf", [None, (1, 2)], ids=["finite", "no-mass-at-level-2"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_chain_builder_tree_equals_the_general_builders(active, logq_inf, sampled):
    chain, general = _trees(active, logq_inf, sampled)
    for field in ("tokens", "parents", "depths", "logq", "cum_logq", "valid", "sampled", "ancestors"):
        assert torch.equal(getattr(chain, field), getattr(general, field)), field
    assert (chain.depth_bound, chain.max_children) == (general.depth_bound, general.max_children)
    if sampled:  # each valid node's draft distribution (padding nodes' and the leaf's are never read)
        read = chain.valid[:, :-1]
        assert torch.equal(chain.draft_logprobs[:, :-1][read], general.draft_logprobs[:, :-1][read])
    expected_valid = torch.tensor(active)[:, None].expand(-1, 5).clone()
    expected_valid[:, 0] = True
    if logq_inf is not None:
        expected_valid[logq_inf[1], 2:] = False
    assert torch.equal(chain.valid, expected_valid)


def test_chain_builder_refuses_branching_and_overfilling():
    ctx = DraftContext(SamplingParams(), None, max_depth=2, active=torch.ones(2, dtype=torch.bool), host_active=[True, True])
    builder = TreeBuilder(RandomDraft(2, 2, seed=0), torch.zeros(2, dtype=torch.long), ctx, keep_draft_probs=False, capacity=2, chain=True)
    with pytest.raises(RuntimeError, match="add_chain_child only"):
        builder.add(builder.root, torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1), None)
    builder.add_chain_child(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1))
    with pytest.raises(RuntimeError, match="is full"):
        builder.add_chain_child(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1))
    general = TreeBuilder(RandomDraft(2, 2, seed=0), torch.zeros(2, dtype=torch.long), ctx, keep_draft_probs=False)
    with pytest.raises(RuntimeError, match="chain=True"):
        general.add_chain_child(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1))


@pytest.mark.parametrize("seed", range(6))
def test_chain_accepted_prefix_equals_the_ancestor_rule(seed):
    """deepest_path's chain branch against its general rule on the same tree, tree.chain unset."""
    g = torch.Generator().manual_seed(seed)
    b, n = 5, 6
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, 3:] = False  # a row whose chain ends early (padding nodes)
    valid[2, 1:] = False  # a finished row: the root alone
    tokens = torch.randint(0, V, (b, n), generator=g)
    parents = torch.where(valid, torch.arange(n) - 1, -1)
    depths = torch.where(valid, torch.arange(n), 0)
    logq = torch.zeros(b, n)
    chain = TokenTree(tokens, parents, depths, logq, logq, valid, torch.zeros_like(valid), depth_bound=n - 1)
    chain.chain = True
    general = TokenTree(tokens, parents, depths, logq, logq, valid, torch.zeros_like(valid), depth_bound=n - 1)
    ok = torch.rand(b, n, generator=g) < 0.75
    ok[3] = True  # a row that accepts everything
    for got, want in zip(deepest_path(chain, ok), deepest_path(general, ok), strict=True):
        assert torch.equal(got, want)


def test_in_place_commit_equals_the_gathering_commit():
    """A chain's accepted prefix is committed where it is: the same cache as gathering it."""
    model = tiny_model("llama", seed=0)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    step = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    caches = []
    for in_place in (True, False):
        runner = ModelRunner(model)
        runner.prefill(ids, torch.ones_like(ids))
        visible = torch.ones(4, 4, dtype=torch.bool).tril()[None].expand(2, 4, 4)
        runner.forward(step, runner.committed_len()[:, None] + torch.arange(4), visible)
        keep = torch.tensor([[0, 1, 2], [0, 1, 0]])  # row 1 accepted one node: its last column is padding
        keep_valid = torch.tensor([[True, True, True], [True, True, False]])
        runner.commit(keep, keep_valid, in_place=in_place)
        caches.append(runner)
    a, b = caches
    assert torch.equal(a.slot_valid, b.slot_valid)
    for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
        valid = a.slot_valid
        for row in range(2):
            assert torch.equal(la.keys[row][:, valid[row]], lb.keys[row][:, valid[row]])
            assert torch.equal(la.values[row][:, valid[row]], lb.values[row][:, valid[row]])


def test_greedy_chain_step_ops_outside_forwards():
    """The chain's path keeps a greedy K = 4 step to a small, fixed number of tensor ops outside
    the forwards (the general tree path took about 140 here: ancestor rows per node, a gathered
    commit in both caches)."""
    target = sharpen(tiny_model("llama", seed=0))
    draft = sharpen(tiny_model("llama", seed=1, layers=1))
    engine = SpeculativeEngine(target, ChainPolicy(k=4), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[])
    engine.generate([[5, 6, 7, 8]], 4)  # warm-up (the shared constants)
    with HostWorkCounter() as counter:
        out = engine.generate([[5, 6, 7, 8], [9, 10, 11]], 24)
    steps = max(o.stats.steps for o in out)
    assert counter.ops / steps < 100, counter.ops / steps


def test_large_builder_layouts_are_kept_between_steps_within_a_memory_bound(monkeypatch):
    """A builder's initial layout is made once per (B, capacity) and copied each step. CAST's
    builders pass a capacity of 1024 with GPU-like costs (1352 on the bundled pair with an H200
    table), so layouts up to 4096 nodes are kept too; the cached ancestor matrices stay under a
    byte bound, past which the cache starts over."""
    from specdec.drafting import builder as builder_module

    monkeypatch.setattr(builder_module, "_BUFFERS", {})
    big = builder_module._initial_buffers(1, 1352, False, torch.device("cpu"))
    assert builder_module._initial_buffers(1, 1352, False, torch.device("cpu")) is big  # reused, not remade
    assert big[3].shape == (1, 1352, 1352) and bool(big[3][0].diagonal().all()) and int(big[3][0].sum()) == 1352
    monkeypatch.setattr(builder_module, "_MAX_CACHED_ANCESTOR_BYTES", 1352 * 1352 + 100 * 100)
    builder_module._initial_buffers(1, 100, False, torch.device("cpu"))
    assert len(builder_module._BUFFERS) == 2  # within the bound: both kept
    builder_module._initial_buffers(1, 200, False, torch.device("cpu"))  # past it: the cache starts over
    assert list(builder_module._BUFFERS) == [("tree_builder", 1, 200, False, torch.device("cpu"))]
    huge = builder_module._initial_buffers(1, 4097, False, torch.device("cpu"))  # over 16 MiB of ancestors: never kept
    assert huge[3].shape[-1] == 4097 and ("tree_builder", 1, 4097, False, torch.device("cpu")) not in builder_module._BUFFERS
