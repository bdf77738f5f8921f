"""Sampled tree children (`tree_sampling`): Gumbel-top-k draws and their keys, what each
policy hands the verifier, greedy left untouched, and the option's wiring (policy, CLI, bench
items). The output distribution itself is checked in test_sampling_distribution.py."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from specdec.bench.variants import parse_method_specs
from specdec.cli import build_parser, collect_method_options
from specdec.cost import CostTable
from specdec.drafting.builder import DraftContext, TreeBuilder
from specdec.drafting.ranks import RankAcceptance, sibling_ranks
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.sources.base import TargetPath
from specdec.verification import GreedyRule, SamplingRule, make_rule

V = 8


class FixedDraft:
    """Every node's children distribution is `logprobs` [V]."""

    def __init__(self, logprobs: torch.Tensor) -> None:
        self.logprobs = logprobs

    def begin_step(self, roots, params):
        return self.logprobs.expand(roots.shape[0], -1)

    def expand(self, batch, params):
        return self.logprobs.expand(*batch.nodes.shape, -1)


def builder_for(logprobs: torch.Tensor, rows: int, seed: int = 0) -> TreeBuilder:
    ctx = DraftContext(
        params=SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(seed), max_depth=8, active=torch.ones(rows, dtype=torch.bool)
    )
    return TreeBuilder(FixedDraft(logprobs), torch.zeros(rows, dtype=torch.long), ctx, keep_draft_probs=True)


def test_draws_are_without_replacement_in_draft_order():
    """The first draw follows q; the second follows q without the first, renormalised."""
    q = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0, 0.0, 0.0])
    rows = 40000
    b = builder_for(q.log(), rows)
    root = torch.zeros(rows, 1, dtype=torch.long)
    _, tokens, logq, valid, keys = b.sample_children(root, b.root_logprobs[:, None, :], 2, torch.ones(rows, 1, dtype=torch.bool))
    assert (tokens[:, 0] != tokens[:, 1]).all()
    assert torch.allclose(logq, q.log()[tokens])
    first = torch.bincount(tokens[:, 0], minlength=V) / rows
    assert (first - q).abs().max() < 0.01
    # P(second = y) = sum_x q(x) q(y) / (1 - q(x)), x != y
    second = torch.bincount(tokens[:, 1], minlength=V) / rows
    expected = torch.tensor([sum(float(q[x] * q[y] / (1 - q[x])) for x in range(V) if x != y) for y in range(V)])
    assert (second - expected).abs().max() < 0.01


def test_keys_never_increase_and_the_first_draw_keeps_its_parents_key():
    logprobs = torch.log_softmax(torch.randn(V, generator=torch.Generator().manual_seed(1)), -1)
    b = builder_for(logprobs, rows=64)
    root = torch.zeros(64, 1, dtype=torch.long)
    parents, tokens, logq, valid, keys = b.sample_children(root, b.root_logprobs[:, None, :], 4, torch.ones(64, 1, dtype=torch.bool))
    nodes = b.add(parents, tokens, logq, valid, sampled=True, score=keys)  # [64, 4]
    assert (keys[:, 0] == 0).all()  # the root's key is 0
    assert (keys[:, 1:] <= keys[:, :-1]).all()
    # a second level: children of each of the 4 nodes
    parents, tokens, logq, valid, keys2 = b.sample_children(nodes, b.expand(nodes, valid), 3, valid)
    keys2 = keys2.reshape(64, 4, 3)
    assert torch.equal(keys2[:, :, 0], b.score.gather(1, nodes))
    assert (keys2[:, :, 1:] <= keys2[:, :, :-1]).all()


def test_children_beyond_the_support_are_invalid():
    q = torch.tensor([0.7, 0.3] + [0.0] * (V - 2))
    b = builder_for(q.log(), rows=16)
    root = torch.zeros(16, 1, dtype=torch.long)
    nodes = b.add(*b.sample_children(root, b.root_logprobs[:, None, :], 4, torch.ones(16, 1, dtype=torch.bool))[:4], sampled=True)
    assert b.valid.gather(1, nodes).sum(dim=1).tolist() == [2] * 16
    assert set(b.tokens.gather(1, nodes)[b.valid.gather(1, nodes)].tolist()) == {0, 1}


CAST_TABLE = CostTable.synthetic(lambda b, c, n: 10.0 + 0.1 * n, lambda b, c, n: 1.0)
POLICIES = {
    "static": {"depth": 3, "branching": 2, "max_nodes": 10},
    "eagle2": {"depth": 3, "top_k": 3, "total_tokens": 7},
    "dynatree": {"d0": 3, "d_max": 4, "max_nodes": 8},
    "cast": {"depth": 3, "top_k": 3, "total_tokens": 7, "cost_table": CAST_TABLE},
}


def pair():
    target = tiny_model("llama", seed=3, vocab=V, eos=V - 1)
    draft = tiny_model("llama", seed=11, vocab=V, layers=1, eos=V - 1)
    return target, draft


def draft_once(method: str, params: SamplingParams, rows: int = 6, seed: int = 0, **extra):
    """One draft step from a prefilled draft source; returns (draft, source)."""
    _, draft = pair()
    source = ModelDraftSource(draft)
    prompt = torch.tensor([[1, 4, 2, 5, 3]] * rows)
    source.prefill(prompt, torch.ones_like(prompt))
    ctx = DraftContext(params=params, generator=torch.Generator().manual_seed(seed), max_depth=4, active=torch.ones(rows, dtype=torch.bool))
    policy = make_policy(method, **{**POLICIES[method], **extra})
    return policy.draft(source, torch.full((rows,), 6, dtype=torch.long), ctx)


@pytest.mark.parametrize("method", list(POLICIES))
def test_sampled_trees_carry_their_proposals(method):
    """Every kept node is sampled, the kept set is a subtree whose siblings are the first ones
    drawn (keys non-increasing in tree order), and each parent's draft distribution is kept."""
    d = draft_once(method, SamplingParams(temperature=1.0, top_p=0.95))
    tree = d.tree
    tree.check_closed()
    non_root = tree.valid & (tree.parents >= 0)
    assert non_root.any() and torch.equal(tree.sampled, non_root)
    assert tree.draft_logprobs is not None
    builder = d.builder
    # kept siblings keep their draw order and are a prefix of it: builder columns are consecutive from the first child
    for row in range(tree.batch_size):
        for node in range(tree.num_nodes):
            kids = tree.children(row, node)
            if not kids:
                continue
            cols = d.builder_nodes[row, kids].tolist()
            assert cols == sorted(cols)
            assert torch.equal(tree.draft_logprobs[row, node].exp().sum().round(), torch.tensor(1.0))
            scores = builder.score[row, cols]
            assert (scores[1:] <= scores[:-1]).all()
            all_kids = ((builder.parents[row] == int(d.builder_nodes[row, node])) & builder.valid[row]).nonzero().flatten().tolist()
            assert cols == all_kids[: len(cols)], "a kept sampled child skipped an earlier-drawn sibling"


@pytest.mark.parametrize("mode", ["sampled", "topk", "greedy"])
@pytest.mark.parametrize("method", [*POLICIES, "chain"])
def test_trees_bound_their_children_without_a_read(method, mode):
    """`TokenTree.max_children` (what the device tests loop over) is at least every node's
    count of valid children, and `sibling_ranks` agrees with the host's 1-based ranks."""
    params = SamplingParams() if mode == "greedy" else SamplingParams(temperature=1.0)
    extra = {"k": 3} if method == "chain" else {**POLICIES[method], "tree_sampling": "topk" if mode == "topk" else "sampled"}
    _, draft = pair()
    source = ModelDraftSource(draft)
    prompt = torch.tensor([[1, 4, 2, 5, 3]] * 6)
    source.prefill(prompt, torch.ones_like(prompt))
    ctx = DraftContext(params=params, generator=torch.Generator().manual_seed(0), max_depth=4, active=torch.ones(6, dtype=torch.bool))
    tree = make_policy(method, **extra).draft(source, torch.full((6,), 6, dtype=torch.long), ctx).tree
    ranks = tree.sibling_ranks()
    assert tree.max_children is not None and tree.max_children >= int(ranks.max()) + 1 >= 1
    host = sibling_ranks(tree.parents.masked_fill(~tree.valid, -1).tolist())
    assert (ranks + 1).tolist() == host
    assert tree.select(tree.valid).max_children == tree.max_children  # a subtree keeps the bound


@pytest.mark.parametrize("method", list(POLICIES))
def test_topk_rule_and_greedy_draft_deterministic_children(method):
    d = draft_once(method, SamplingParams(temperature=1.0), tree_sampling="topk")
    assert not d.tree.sampled.any() and d.tree.draft_logprobs is None
    greedy = {mode: draft_once(method, SamplingParams(), tree_sampling=mode).tree for mode in ("sampled", "topk")}
    assert not greedy["sampled"].sampled.any()
    for field in ("tokens", "parents", "valid", "logq"):
        assert torch.equal(getattr(greedy["sampled"], field), getattr(greedy["topk"], field))


@pytest.mark.parametrize("method", list(POLICIES))
def test_accepted_paths_are_in_the_builders_numbering(method):
    """`Draft.accepted_paths` maps a path of the verified (compacted) tree to the builder nodes
    the draft source knows: same tokens, each node's builder parent the previous one."""
    d = draft_once(method, SamplingParams())
    tree, builder = d.tree, d.builder
    paths = []
    for row in range(tree.batch_size):  # the path to each row's last valid node, root excluded
        last = max(i for i in range(tree.num_nodes) if tree.valid[row, i])
        paths.append(tree.path_to(row, last)[1:])
    d_max = max(len(p) for p in paths)
    path = torch.tensor([p + [0] * (d_max - len(p)) for p in paths])  # [B, D]
    length = torch.tensor([len(p) for p in paths])
    host_tokens = [tree.tokens[row, p].tolist() for row, p in enumerate(paths)]
    target = TargetPath(torch.zeros(tree.batch_size, tree.num_nodes, V), torch.arange(tree.batch_size), torch.nn.functional.pad(path, (1, 0)), SamplingParams())
    accepted = d.accepted_paths(path, length, host_tokens, [True] * tree.batch_size, target)
    assert torch.equal(accepted.nodes, d.builder_nodes.gather(1, path)) and accepted.tokens is not None
    for row, p in enumerate(paths):
        nodes = accepted.nodes[row, : len(p)].tolist()
        assert accepted.tokens[row, nodes].tolist() == host_tokens[row]
        assert builder.parents[row, nodes].tolist() == [0, *nodes[:-1]]
    if method == "eagle2":  # it verifies 7 of its 22 builder nodes: the numberings differ
        assert not torch.equal(accepted.nodes, path)


@pytest.mark.parametrize("method", ["eagle2", "dynatree"])
def test_greedy_decoding_ignores_tree_sampling(method):
    target, draft = pair()
    outs = {}
    for mode in ("sampled", "topk"):
        engine = SpeculativeEngine(target, make_policy(method, **POLICIES[method], tree_sampling=mode), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[])
        outs[mode] = [(o.token_ids, [s.accepted_len for s in o.steps]) for o in engine.generate([[1, 4, 2, 5]] * 3, 12, SamplingParams(), keep_steps=True)]
    assert outs["sampled"] == outs["topk"]


def test_option_wiring():
    with pytest.raises(SpecDecError, match="tree_sampling='beam'"):
        make_policy("eagle2", tree_sampling="beam")
    parser = build_parser()
    args = parser.parse_args(["generate", "--method", "dynatree", "--prompt", "x", "--tree-sampling", "topk"])
    assert collect_method_options(args, "dynatree") == {"tree_sampling": "topk"}
    args = parser.parse_args(["generate", "--method", "chain", "--prompt", "x", "--tree-sampling", "topk"])
    with pytest.raises(SpecDecError, match="--tree-sampling does not apply to --method chain"):
        collect_method_options(args, "chain")
    specs = parse_method_specs("eagle2,eagle2:tree_sampling=topk,cast:tree-sampling=topk")
    assert [dict(s.options) for s in specs[1:]] == [{}, {"tree_sampling": "topk"}, {"tree_sampling": "topk"}]
    assert specs[2].base_label == "eagle2[tree_sampling=topk]"
    # where trees are tested: an option of the sampling rule
    spec = parse_method_specs("eagle2@sampling:walk=host")[-1]
    assert spec.rule == "sampling" and dict(spec.rule_options) == {"walk": "host"}
    assert make_rule("sampling", walk="device").walks_on_device(torch.device("cpu"))
    assert not make_rule("sampling").walks_on_device(torch.device("cpu")) and make_rule("sampling").walks_on_device(torch.device("meta"))
    with pytest.raises(SpecDecError, match="walk='gpu' must be one of auto, device, host"):
        make_rule("sampling", walk="gpu")
    with pytest.raises(SpecDecError, match="walk='gpu'"):
        parse_method_specs("eagle2@sampling:walk=gpu")


def test_sibling_ranks_and_positional_rates():
    parents = torch.tensor([[-1, 0, 0, 1, 0, 3]])
    valid = torch.tensor([[True, True, True, True, True, False]])
    assert sibling_ranks(parents.masked_fill(~valid, -1).tolist()) == [[0, 1, 2, 1, 3, 0]]
    rates = RankAcceptance(ranks=3, prior=(0.5, 0.2), prior_weight=1.0, decay=1.0)
    assert rates.rates().tolist() == [0.5, 0.2, 0.2]
    # the root's children are observed (rank 1 accepted, ranks 2 and 3 not); node 1 was reached: its child (rank 1) rejected
    rates.observe(parents.masked_fill(~valid, -1).tolist(), [[1]], [False])  # a finished row: no observation
    assert rates.observations == 0
    rates.observe(parents.masked_fill(~valid, -1).tolist(), [[1]], [True])
    assert rates.observations == 4
    assert rates.rates().round(6).tolist() == [0.5, 0.1, 0.1]  # rank 1: (1 + 1 * 0.5 + 0) / (2 + 1); rank 2: 0.2 / 2
    assert torch.allclose(rates.log_rates(5), torch.log(torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1])))


def test_eagle2_learns_positional_rates_from_sampled_verdicts():
    target, draft = pair()
    policy = make_policy("eagle2", **POLICIES["eagle2"])
    engine = SpeculativeEngine(target, policy, SamplingRule(), ModelDraftSource(draft), eos_token_ids=[])
    engine.generate([[1, 4, 2, 5]] * 4, 12, SamplingParams(temperature=1.0), seed=0)
    assert policy.ranks.observations > 0
    rates = policy.ranks.rates()
    assert (rates[1:] <= rates[:-1]).all()
    before = policy.ranks.observations
    greedy = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[])
    greedy.generate([[1, 4, 2, 5]], 8, SamplingParams())
    assert policy.ranks.observations == before  # top-k trees teach nothing about sampled ranks


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["chain", *POLICIES])
def test_level_depth_hints_match_the_parents(method, temperature, monkeypatch):
    """A policy's level `depth` hint (no gather of the parents' depths) must be the real one: the
    draft source's positions come from it (`NodeBatch.depth`), and the builder stores it as the
    children's depth. A wrong hint leaves greedy output lossless (only the draft degrades), so it
    is checked here directly: each hinted forward's nodes sit at the hinted depth, and every
    valid node is one deeper than its parent."""
    hinted = []
    expand = ModelDraftSource.expand

    def checked(self, batch, params):
        if batch.depth is not None:
            depths = batch.depths.gather(1, batch.nodes)  # [B, k]
            assert torch.equal(depths[batch.valid], torch.full_like(depths[batch.valid], batch.depth))
            hinted.append(batch.depth)
        return expand(self, batch, params)

    monkeypatch.setattr(ModelDraftSource, "expand", checked)
    options = POLICIES.get(method, {"k": 4})
    _, draft = pair()
    source = ModelDraftSource(draft)
    prompt = torch.tensor([[1, 4, 2, 5, 3]] * 3)
    source.prefill(prompt, torch.ones_like(prompt))
    ctx = DraftContext(params=SamplingParams(temperature=temperature), generator=torch.Generator().manual_seed(0), max_depth=4, active=torch.ones(3, dtype=torch.bool))
    d = make_policy(method, **options).draft(source, torch.full((3,), 6, dtype=torch.long), ctx)
    assert hinted, "no level forward carried a depth hint"
    builder = d.builder
    valid = builder.valid[:, 1:]  # non-root builder nodes
    parent_depth = builder.depths.gather(1, builder.parents[:, 1:].clamp(min=0))
    assert torch.equal(builder.depths[:, 1:][valid], (parent_depth + 1)[valid])


def test_step_result_carries_the_verified_tree_parents():
    """The verdict's one read also brings each verified node's parent (-1 for the root and padding,
    whatever the padding's stored parent), for policies that learn from the tree's shape."""
    from specdec.engine import StepResult
    from specdec.tree import TokenTree
    from specdec.verification.base import Verdict

    parents = torch.tensor([[-1, 0, 0, 1, 0], [-1, 0, 1, 0, 0]])  # row 1: nodes 3 and 4 are padding (stored parent 0)
    valid = torch.tensor([[True, True, True, True, True], [True, True, True, False, False]])
    depths = torch.tensor([[0, 1, 1, 2, 1], [0, 1, 2, 0, 0]])
    zeros = torch.zeros(2, 5)
    tree = TokenTree(tokens=torch.arange(10).view(2, 5), parents=parents, depths=depths, logq=zeros, cum_logq=zeros, valid=valid,
                     sampled=torch.zeros(2, 5, dtype=torch.bool))
    verdict = Verdict.from_lists([[1, 3], [1]], [7, 8], [0, 0], [0, 0], torch.device("cpu"))
    result = StepResult.read(tree, verdict)
    assert result.tree_parents == [[-1, 0, 0, 1, 0], [-1, 0, 1, -1, -1]]
    assert result.accepted_nodes == [[1, 3], [1]] and result.drafted == [4, 2]


@pytest.mark.parametrize("max_nodes", [3, 7])
def test_dynatree_node_budget_binds_on_sampled_levels(max_nodes):
    """Sampled levels keep every candidate column, so DynaTree's node budget must still cut them
    when it can bind (it is skipped only where a level cannot reach it): no row drafts more than
    `max_nodes` tokens, and the cut keeps a subtree of first draws (the trees are closed)."""
    for seed in range(4):
        d = draft_once("dynatree", SamplingParams(temperature=1.0), seed=seed, b_min=3, b_mid=3, b_max=3, prune_tau=0.0, rho_stop=0.0, max_nodes=max_nodes)
        d.tree.check_closed()
        drafted = (d.tree.valid & (d.tree.parents >= 0)).sum(dim=1)  # [B] draft tokens per row
        assert int(drafted.max()) == max_nodes  # 3 children a node, 4 levels: the budget is what stops it
