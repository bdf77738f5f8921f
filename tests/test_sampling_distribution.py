"""Invariant 2: sampling verification leaves the target's output distribution unchanged.

On a 6-token vocabulary the exact joint distribution of the first four generated tokens is
computed by enumeration (1 + 6 + 36 + 216 sequential target forwards). The first token comes
from the prefill; the first speculative step drafts trees up to depth 2, the next up to depth 1,
so a tree's own pruning (eagle2's reranking, dynatree's budget, CAST's cost cuts) acts across
levels. Many independent samples (rows of one batch, each batch with its own seed, 8 seeds)
are compared to the exact joint with a chi-square test.

Tolerance: every lossless case must give p > 1e-3 (the seeds are fixed, so the test is
deterministic; at that threshold a correct rule fails one case in a thousand by chance).
Each deliberately broken variant must give p < 1e-6 on the same data size: accepting every
drafted token; not removing earlier sampled siblings from a sampled child's proposal; not
updating the target residual after a rejection; keeping sampled children by their own draft
probability (what EAGLE-2's cum_logq reranking would do to them).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import tiny_model
from distribution import chi2_pvalue, exact_joint

from specdec.cost import CostTable
from specdec.drafting.builder import Draft, DraftContext, TreeBuilder
from specdec.engine import SpeculativeEngine
from specdec.methods import make_policy
from specdec.sampling import SamplingParams, logits_to_logprobs, sample_from_probs
from specdec.sources import ModelDraftSource
from specdec.sources.lookup import LookupDraftSource
from specdec.verification import MarsRule, SamplingRule, Verdict
from specdec.verification.sampling import (
    BlockChainTests,
    BlockSiblingTests,
    BlockTreeTests,
    ChainTests,
    SiblingTests,
    TraversalTests,
    TraversalTreeTests,
    TreeTests,
)

V = 6
PROMPT = [1, 4, 2, 5]
BATCH = 500
SEEDS = 8
"""batches of BATCH rows, seeds 1000.. (4000 samples per case)"""
TOKENS = 4
P_PASS = 1e-3


def test_sample_from_probs_draws_each_row_from_its_distribution():
    """The exponential race every sampled draft token and bonus token goes through: each row of
    a batch from its own (unnormalised) distribution, never a token of probability 0."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.05, 0.0, 0.15, 0.8], [2.0, 2.0, 2.0, 2.0]])
    draws = 30000
    tokens = sample_from_probs(probs[:, None, :].expand(3, draws, 4), generator)  # [3, draws]
    assert tokens.shape == (3, draws)
    for row in range(3):
        counts = torch.bincount(tokens[row], minlength=4).double()
        want = probs[row].double() / probs[row].sum()
        assert counts[want == 0].sum() == 0, (row, counts)
        assert chi2_pvalue(counts.numpy(), want.numpy()) > P_PASS, (row, counts)
P_FAIL = 1e-6


def models(draft_scale: float = 3.0):
    """The target and a draft; scale 3: peaked-ish distributions, so drafts are sometimes right,
    sometimes wrong; scale 10: an overconfident draft (rejected often, with much mass on the
    rejected token), where wrong residuals show most."""
    target = tiny_model("llama", seed=3, vocab=V, eos=-1 % V)
    draft = tiny_model("llama", seed=11, vocab=V, layers=1, eos=-1 % V)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)
        draft.get_output_embeddings().weight.mul_(draft_scale)
    return target, draft


@pytest.fixture(scope="module")
def pair():
    return models()


@pytest.fixture(scope="module")
def peaked_pair():
    return models(draft_scale=10.0)


@pytest.fixture(scope="module")
def joints(pair):
    """The exact joint of the first TOKENS tokens per SamplingParams, computed once each
    (both pairs share the target)."""
    cache: dict[SamplingParams, np.ndarray] = {}

    def joint(params: SamplingParams) -> np.ndarray:
        if params not in cache:
            cache[params] = exact_joint(pair[0], PROMPT, V, TOKENS, params)
            assert abs(cache[params].sum() - 1) < 1e-4
        return cache[params]

    return joint


def sample_counts(engine: SpeculativeEngine, params: SamplingParams, seed: int = 1000) -> np.ndarray:
    counts = np.zeros((V,) * TOKENS)
    for i in range(SEEDS):
        for o in engine.generate([PROMPT] * BATCH, TOKENS, params, seed=seed + i):
            counts[tuple(o.token_ids)] += 1
    return counts


def pvalue_of(pair, joints, policy, rule, params: SamplingParams) -> float:
    target, draft = pair
    engine = SpeculativeEngine(target, policy, rule, ModelDraftSource(draft), eos_token_ids=[])
    return chi2_pvalue(sample_counts(engine, params), joints(params))


CAST_TABLE = CostTable.synthetic(lambda b, c, n: 10.0 + 0.1 * n, lambda b, c, n: 1.0)

TREES = {
    "static": ("static", {"depth": 2, "branching": 3, "max_nodes": 8}),
    # reranking keeps 5 of up to 3 + 9 candidates: pruning acts on sampled children
    "eagle2": ("eagle2", {"depth": 2, "top_k": 3, "total_tokens": 5}),
    # confidence branching up to 3 children, path-probability pruning and a 4-node budget cut
    "dynatree": ("dynatree", {"d0": 2, "d_max": 3, "b_mid": 2, "b_max": 3, "tau_high": 0.8, "tau_low": 0.5, "prune_tau": 0.05, "max_nodes": 4}),
    # CAST's tree shape adapts to earlier verdicts (calibrated values); deterministic: no step times
    # learned from the wall clock, so a seed gives the same draws on every run and the p-value is
    # fixed (timed shapes made it a fresh draw per run: 1.7e-4 < P_PASS once in CI)
    "cast": ("cast", {"depth": 2, "top_k": 3, "total_tokens": 5, "cost_table": CAST_TABLE, "deterministic": True}),
}

PARAMS = {
    "t0.7": SamplingParams(temperature=0.7),
    "t1": SamplingParams(temperature=1.0),
    "t0.7-top-p": SamplingParams(temperature=0.7, top_p=0.9),
    "t1-top-p": SamplingParams(temperature=1.0, top_p=0.8),
}

CASES = {
    **{f"{tree}-sampled-{p}": (*TREES[tree], PARAMS[p]) for tree, p in itertools.product(TREES, PARAMS)},
    # the older rule (deterministic top-k children, point-mass proposals), kept selectable
    **{f"{tree}-topk-t1": (TREES[tree][0], {**TREES[tree][1], "tree_sampling": "topk"}, PARAMS["t1"]) for tree in TREES},
    "chain": ("chain", {"k": 3}, SamplingParams(temperature=1.0)),
    "chain-top-k": ("chain", {"k": 2}, SamplingParams(temperature=1.2, top_k=4)),
    "eagle2-sampled-top-k": ("eagle2", TREES["eagle2"][1], SamplingParams(temperature=1.0, top_k=3)),
    # DynaTree inside a free verification width (5 draft tokens a row at BATCH rows): no pruning,
    # each level's 5 best growing nodes, the tree the 5 best nodes by p over all levels
    **{f"dynatree-free-{p}": ("dynatree", {**TREES["dynatree"][1], "free_tokens": 6 * BATCH}, PARAMS[p]) for p in ("t1", "t0.7-top-p")},
    # CAST verifying its plan's predicted count, its values read after the verification (the CUDA default)
    "cast-unread-t1": ("cast", {**TREES["cast"][1], "depth": 3, "reads_while_drafting": False}, PARAMS["t1"]),
}


WALKED = [(case, walk) for case in CASES for walk in (("host", "device") if CASES[case][0] != "chain" else ("host",))]
"""every case with each place trees are tested (`SamplingRule.walk`; chains are tested on the device either way)"""


@pytest.mark.parametrize(("case", "walk"), WALKED, ids=[f"{c}-{w}" for c, w in WALKED])
def test_sampling_rule_is_lossless(case, walk, pair, joints):
    method, options, params = CASES[case]
    pvalue = pvalue_of(pair, joints, make_policy(method, **options), SamplingRule(walk=walk), params)
    assert pvalue > P_PASS, f"{case} ({walk} walk): chi-square p = {pvalue:.2e}"
    # the draft really disagrees sometimes, so the test exercises rejections
    target, draft = pair
    engine = SpeculativeEngine(target, make_policy(method, **options), SamplingRule(walk=walk), ModelDraftSource(draft), eos_token_ids=[])
    stats = engine.generate([PROMPT] * 200, TOKENS, params, seed=5)
    accepted = sum(o.stats.accepted_tokens for o in stats)
    drafted = sum(o.stats.drafted_tokens for o in stats)
    assert 0 < accepted < drafted


TOKEN_CASES = [("chain", "host"), ("chain-top-k", "host"), *((c, w) for c in ("dynatree-sampled-t1", "static-sampled-t0.7-top-p") for w in ("host", "device"))]


@pytest.mark.parametrize(("case", "walk"), TOKEN_CASES, ids=[f"{c}-{w}" for c, w in TOKEN_CASES])
def test_token_by_token_rule_is_lossless(case, walk, pair, joints):
    """The rules before block and traversal verification, kept selectable: chains token by token
    (`chains="token"`) and trees child by child (`segments="token"`: `SiblingTests` on the host
    walk, `TreeTests` on the device)."""
    method, options, params = CASES[case]
    pvalue = pvalue_of(pair, joints, make_policy(method, **options), SamplingRule(chains="token", segments="token", walk=walk), params)
    assert pvalue > P_PASS, f"{case} (token by token, {walk} walk): chi-square p = {pvalue:.2e}"


SEGMENT_CASES = [(case, walk) for case in ("dynatree-sampled-t1", "dynatree-sampled-t0.7-top-p", "dynatree-free-t1", "eagle2-sampled-t1", "static-topk-t1") for walk in ("host", "device")]


@pytest.mark.parametrize(("case", "walk"), SEGMENT_CASES, ids=[f"{c}-{w}" for c, w in SEGMENT_CASES])
def test_block_segments_are_lossless(case, walk, pair, joints):
    """Trees whose chain segments are verified as blocks (`segments="block"`) on either walk:
    DynaTree's trees have segments of several nodes under branching nodes."""
    method, options, params = CASES[case]
    pvalue = pvalue_of(pair, joints, make_policy(method, **options), SamplingRule(walk=walk, segments="block"), params)
    assert pvalue > P_PASS, f"{case} ({walk} walk, block segments): chi-square p = {pvalue:.2e}"


TRAVERSAL_CASES = ("dynatree-sampled-t1", "dynatree-sampled-t0.7-top-p", "dynatree-free-t1", "eagle2-sampled-t1", "static-topk-t1", "cast-sampled-t1-top-p")


@pytest.mark.parametrize("walk", ["host", "device"])
@pytest.mark.parametrize("case", TRAVERSAL_CASES)
def test_traversal_verification_is_lossless(case, walk, pair, joints):
    """Whole trees verified from the leaves up (`segments="traversal"`), walked on the host
    (`TraversalTests`) or arranged for tensors on the device (`TraversalTreeTests`)."""
    method, options, params = CASES[case]
    pvalue = pvalue_of(pair, joints, make_policy(method, **options), SamplingRule(segments="traversal", walk=walk), params)
    assert pvalue > P_PASS, f"{case} (traversal, {walk} walk): chi-square p = {pvalue:.2e}"


@pytest.mark.parametrize("method", ["chain", *TREES])
def test_lookup_drafts_are_lossless_when_sampling(method, pair, joints):
    """n-gram lookup proposes a point mass where the context's tail repeats and nothing (a row of
    -inf) where it does not: both happen on this 6-token vocabulary. Every policy drafts from it
    at T = 1 without failing (a sampled chain drew from an empty row: 'invalid multinomial
    distribution') and the output keeps the target's distribution."""
    target, _ = pair
    options = {"k": 3} if method == "chain" else TREES[method][1]
    engine = SpeculativeEngine(target, make_policy(method, **options), SamplingRule(), LookupDraftSource(V, max_ngram=2), eos_token_ids=[])
    params = PARAMS["t1"]
    pvalue = chi2_pvalue(sample_counts(engine, params), joints(params))
    assert pvalue > P_PASS, f"lookup {method}: chi-square p = {pvalue:.2e}"
    outs = engine.generate([PROMPT] * 200, TOKENS, params, seed=5)
    assert sum(o.stats.accepted_tokens for o in outs) > 0  # matches were proposed and accepted


@pytest.mark.parametrize("walk", ["host", "device"])
@pytest.mark.parametrize("tree", list(TREES))
def test_sampled_trees_are_lossless_with_an_overconfident_draft(tree, walk, peaked_pair, joints):
    """The set-up where the broken variants below fail."""
    method, options = TREES[tree]
    pvalue = pvalue_of(peaked_pair, joints, make_policy(method, **options), SamplingRule(walk=walk), PARAMS["t0.7"])
    assert pvalue > P_PASS, f"{tree} ({walk} walk): chi-square p = {pvalue:.2e}"


@pytest.mark.parametrize("tree", ["eagle2", "dynatree"])
def test_mars_without_relaxation_is_lossless_on_sampled_trees(tree, pair, joints):
    """MARS composes: with theta >= 1 it is the lossless rule on sampled trees too."""
    method, options = TREES[tree]
    pvalue = pvalue_of(pair, joints, make_policy(method, **options), MarsRule(1.0), PARAMS["t1"])
    assert pvalue > P_PASS, f"{tree}/mars: chi-square p = {pvalue:.2e}"


# ----- broken variants: each must fail the same test ---------------------------------------


class AcceptEverything:
    """A broken rule: keeps the first root-to-leaf path whole, bonus from the target."""

    name = "broken"

    def verify(self, tree, target_logits, params, generator) -> Verdict:
        paths, bonus = [], []
        probs = logits_to_logprobs(target_logits, params).exp()
        for row in range(tree.batch_size):
            path, node = [], 0
            while kids := tree.children(row, node):
                node = kids[0]
                path.append(node)
            paths.append(path)
            bonus.append(int(torch.multinomial(probs[row, node], 1, generator=generator)))
        zeros = [0] * tree.batch_size
        return Verdict.from_lists(paths, bonus, zeros, list(zeros), target_logits.device)


class KeepsEarlierSiblings(SiblingTests):
    """Broken: every sampled child's proposal is the full draft distribution (as if drawn with replacement)."""

    def proposal(self, draft_probs: np.ndarray, removed: list[int]) -> np.ndarray:
        return super().proposal(draft_probs, [])


class NoResidual(SiblingTests):
    """Broken: after a rejection the next child is tested against the unchanged target distribution."""

    def residual(self, target_probs: np.ndarray, proposal: np.ndarray) -> np.ndarray:
        return target_probs


class ChainNoResidual(ChainTests):
    """Broken chain tests (on the device): after a rejection the bonus is drawn from the
    unchanged target distribution instead of the residual."""

    def residual(self, target_probs, draft_probs, token, sampled):
        return target_probs


class BlockUnweightedResidual(BlockChainTests):
    """Broken block verification (on the device): the bonus after the accepted prefix is drawn
    from the token-by-token residual, ignoring the prefix's weight."""

    def weighted_residual(self, target_probs, weight, draft_probs, token, sampled):
        return super().weighted_residual(target_probs, torch.ones_like(weight), draft_probs, token, sampled)


class HostBlockUnweightedResidual(BlockSiblingTests):
    """Broken host walk: a tree's chain segments are verified as blocks, but the bonus after a
    partly accepted segment is drawn from the unweighted residual."""

    def weighted_residual(self, target_probs, weight, proposal, token):
        return super().weighted_residual(target_probs, 1.0, proposal, token)


class DeviceBlockUnweightedResidual(BlockTreeTests):
    """Broken device tests: a tree's chain segments are verified as blocks, but the bonus after a
    partly accepted segment is drawn from the unweighted residual."""

    def weighted_residual(self, target_probs, weight, draft_probs, token, sampled):
        return super().weighted_residual(target_probs, torch.ones_like(weight), draft_probs, token, sampled)


class TraversalUnweightedResidual(TraversalTests):
    """Broken traversal: a rejected child updates its parent's target with the unweighted
    residual max(0, P - Q) (recursive rejection sampling's), while weights still carry down."""

    def weighted_residual(self, target_probs, weight, proposal, token):
        return super().weighted_residual(target_probs, 1.0, proposal, token)


class DeviceTraversalUnweightedResidual(TraversalTreeTests):
    """Broken device traversal: a rejected child leaves its parent the unweighted residual."""

    def weighted_residual(self, target_probs, weight, draft_probs, token, sampled):
        return super().weighted_residual(target_probs, torch.ones_like(weight), draft_probs, token, sampled)


class TreeNoResidual(TreeTests):
    """Broken device tests: after a rejection the next sibling (and the bonus) are tested against
    the unchanged target distribution."""

    def residual(self, target, proposal):
        return target.clone()


class TreeKeepsEarlierSiblings(TreeTests):
    """Broken device tests: a rejected drawn sibling stays in the next one's proposal (as if drawn with replacement)."""

    def remove_drawn(self, draft_left, x, drawn):
        return None


class RankedByOwnLogq:
    """Broken drafting: draws 3 root children without replacement, keeps the one the draft
    likes best (highest logq), verified as if it were the first draw. The exact version keeps
    the first draw (the best Gumbel key)."""

    name = "ranked-by-logq"
    uses_draft = True

    def __init__(self, score: str) -> None:
        self.score = score

    def draft(self, source, roots: torch.Tensor, ctx: DraftContext) -> Draft:
        builder = TreeBuilder(source, roots, ctx, keep_draft_probs=True)
        b = roots.shape[0]
        root = torch.zeros(b, 1, dtype=torch.long)
        parents, tokens, logq, valid, keys = builder.sample_children(root, builder.root_logprobs[:, None, :], 3, torch.ones(b, 1, dtype=torch.bool))
        builder.add(parents, tokens, logq, valid, sampled=True, score=keys)
        keep = builder.top_by_score(builder.cum_logq if self.score == "logq" else builder.score, 1)
        return builder.finish(keep, width=2)

    def feedback(self, record) -> None:
        return None


BROKEN = {
    "accept-everything-chain": (lambda: make_policy("chain", k=3), AcceptEverything, "mild", "t1"),
    "accept-everything-static": (lambda: make_policy("static", depth=2, branching=2, max_nodes=6), AcceptEverything, "mild", "t1"),
    "keeps-earlier-siblings": (lambda: make_policy("static", **TREES["static"][1]), lambda: SamplingRule(tests=KeepsEarlierSiblings()), "peaked", "t0.7"),
    "no-residual-update": (lambda: make_policy("static", **TREES["static"][1]), lambda: SamplingRule(tests=NoResidual()), "peaked", "t0.7"),
    "ranked-by-own-logq": (lambda: RankedByOwnLogq("logq"), SamplingRule, "mild", "t1"),
    "chain-no-residual": (lambda: make_policy("chain", k=3), lambda: SamplingRule(chain_tests=ChainNoResidual()), "peaked", "t0.7"),
    "chain-block-unweighted-residual": (lambda: make_policy("chain", k=3), lambda: SamplingRule(chain_tests=BlockUnweightedResidual()), "peaked", "t0.7"),
    # DynaTree's budget leaves chain segments under branching nodes (the static, EAGLE-2 and CAST
    # cases here branch at every level, so their segments are one node long and the variant passes)
    "host-block-unweighted-residual": (
        lambda: make_policy("dynatree", **TREES["dynatree"][1]),
        lambda: SamplingRule(tests=HostBlockUnweightedResidual(), walk="host"),
        "peaked",
        "t0.7",
    ),
    "device-block-unweighted-residual": (
        lambda: make_policy("dynatree", **TREES["dynatree"][1]),
        lambda: SamplingRule(tree_tests=DeviceBlockUnweightedResidual(), walk="device"),
        "peaked",
        "t0.7",
    ),
    "traversal-unweighted-residual": (
        lambda: make_policy("dynatree", **TREES["dynatree"][1]),
        lambda: SamplingRule(tests=TraversalUnweightedResidual(), segments="traversal"),
        "peaked",
        "t0.7",
    ),
    "device-traversal-unweighted-residual": (
        lambda: make_policy("dynatree", **TREES["dynatree"][1]),
        lambda: SamplingRule(tree_tests=DeviceTraversalUnweightedResidual(), segments="traversal", walk="device"),
        "peaked",
        "t0.7",
    ),
    "device-keeps-earlier-siblings": (
        lambda: make_policy("static", **TREES["static"][1]),
        lambda: SamplingRule(tree_tests=TreeKeepsEarlierSiblings(), walk="device"),
        "peaked",
        "t0.7",
    ),
    "device-no-residual-update": (
        lambda: make_policy("static", **TREES["static"][1]),
        lambda: SamplingRule(tree_tests=TreeNoResidual(), walk="device"),
        "peaked",
        "t0.7",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_variant_fails_the_same_test(case, pair, peaked_pair, joints):
    policy, rule, which, params = BROKEN[case]
    pvalue = pvalue_of(pair if which == "mild" else peaked_pair, joints, policy(), rule(), PARAMS[params])
    assert pvalue < P_FAIL, f"the broken variant {case} passed: p = {pvalue:.2e}"


# ----- one node, hand-built distributions ----------------------------------------------------


class FixedDraft:
    """A draft source whose every distribution is `draft_probs` [V] (no model)."""

    def __init__(self, draft_probs: torch.Tensor) -> None:
        self.logprobs = draft_probs.log()

    def begin_step(self, roots: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return self.logprobs.expand(roots.shape[0], -1)

    def expand(self, batch, params: SamplingParams) -> torch.Tensor:
        return self.logprobs.expand(*batch.nodes.shape, -1)


ONE_NODE_DRAFT = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05, 0.0])
ONE_NODE_TARGET = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.2, 0.1])


def one_node_counts(
    tests: SiblingTests, children: int, rows: int = 20000, seed: int = 0, rule: SamplingRule | None = None, device: str = "cpu"
) -> np.ndarray:
    """First committed token of `rows` one-level trees: `children` root children drawn without
    replacement from ONE_NODE_DRAFT, verified against ONE_NODE_TARGET (tensors on `device`)."""
    params = SamplingParams(temperature=1.0)
    dev = torch.device(device)
    generator = torch.Generator(device=dev).manual_seed(seed)
    ctx = DraftContext(params=params, generator=generator, max_depth=1, active=torch.ones(rows, dtype=torch.bool, device=dev))
    builder = TreeBuilder(FixedDraft(ONE_NODE_DRAFT.to(dev)), torch.zeros(rows, dtype=torch.long, device=dev), ctx, keep_draft_probs=True)
    root = torch.zeros(rows, 1, dtype=torch.long, device=dev)
    parents, tokens, logq, valid, keys = builder.sample_children(
        root, builder.root_logprobs[:, None, :], children, torch.ones(rows, 1, dtype=torch.bool, device=dev)
    )
    builder.add(parents, tokens, logq, valid, sampled=True, score=keys)
    tree = builder.finish().tree
    logits = ONE_NODE_TARGET.to(dev).log().expand(rows, tree.num_nodes, V)  # temperature 1: the target distribution is ONE_NODE_TARGET
    rule = rule or SamplingRule(tests=tests)
    rule.prepare(tree, params)  # as the engine does before the verify forward
    verdict = rule.verify(tree, logits, params, generator)
    first = torch.where(verdict.accepted_len > 0, tree.tokens.gather(1, verdict.path[:, :1]).squeeze(1), verdict.bonus_tokens)
    return np.bincount(first.cpu().numpy(), minlength=V)


@pytest.mark.parametrize("children", [1, 2, 3, 5])
def test_one_node_sampled_siblings_commit_the_target_distribution(children):
    counts = one_node_counts(SiblingTests(), children)
    pvalue = chi2_pvalue(counts, ONE_NODE_TARGET.double().numpy())
    assert pvalue > P_PASS, f"{children} children: chi-square p = {pvalue:.2e}"


@pytest.mark.parametrize("children", [1, 2, 3, 5])
def test_one_node_sampled_siblings_on_the_device(children):
    counts = one_node_counts(SiblingTests(), children, rule=SamplingRule(walk="device"))
    pvalue = chi2_pvalue(counts, ONE_NODE_TARGET.double().numpy())
    assert pvalue > P_PASS, f"{children} children: chi-square p = {pvalue:.2e}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("children", [1, 3])
def test_one_node_sampled_siblings_on_cuda(children):
    """On a GPU the default rule (walk 'auto') tests trees there, exactly."""
    assert SamplingRule().walks_on_device(torch.device("cuda"))
    counts = one_node_counts(SiblingTests(), children, device="cuda")
    pvalue = chi2_pvalue(counts, ONE_NODE_TARGET.double().numpy())
    assert pvalue > P_PASS, f"{children} children on cuda: chi-square p = {pvalue:.2e}"


@pytest.mark.parametrize("tests", [KeepsEarlierSiblings(), NoResidual()], ids=["keeps-earlier-siblings", "no-residual-update"])
def test_one_node_broken_tests_fail(tests):
    pvalue = chi2_pvalue(one_node_counts(tests, 3), ONE_NODE_TARGET.double().numpy())
    assert pvalue < P_FAIL, f"{type(tests).__name__} passed: p = {pvalue:.2e}"


@pytest.mark.parametrize("tests", [TreeKeepsEarlierSiblings(), TreeNoResidual()], ids=["keeps-earlier-siblings", "no-residual-update"])
def test_one_node_broken_device_tests_fail(tests):
    counts = one_node_counts(SiblingTests(), 3, rule=SamplingRule(tree_tests=tests, walk="device"))
    pvalue = chi2_pvalue(counts, ONE_NODE_TARGET.double().numpy())
    assert pvalue < P_FAIL, f"{type(tests).__name__} passed: p = {pvalue:.2e}"


def test_first_draw_by_key_is_the_exact_counterpart(pair, joints):
    """The same one-child tree kept by Gumbel key (the first draw) passes."""
    pvalue = pvalue_of(pair, joints, RankedByOwnLogq("key"), SamplingRule(), PARAMS["t1"])
    assert pvalue > P_PASS, f"chi-square p = {pvalue:.2e}"


def test_same_seed_same_output_and_seeds_differ(pair):
    """A seed reproduces a sample on a fresh engine (as each CLI run is). EAGLE-2 learns its
    positional rates from the verdicts across calls, so on one engine a later call's trees (and
    with them which uniforms the walk uses) may differ: the distribution is the same, the sample not."""
    target, draft = pair
    params = SamplingParams(temperature=1.0)
    for method, options in (("chain", {"k": 3}), TREES["eagle2"]):

        def sample(seed: int, method: str = method, options: dict = options) -> list[list[int]]:
            engine = SpeculativeEngine(target, make_policy(method, **options), SamplingRule(), ModelDraftSource(draft), eos_token_ids=[])
            return [o.token_ids for o in engine.generate([PROMPT] * 8, 12, params, seed=seed)]

        a, b, c = sample(42), sample(42), sample(43)
        assert a == b
        assert a != c


@pytest.mark.parametrize("walk", ["host", "device"])
def test_mixed_drawn_and_point_mass_siblings(walk):
    """One node with a drawn child, a point-mass child and a second drawn child (the rule must
    switch proposals per sibling), over two levels: the drawn child itself has a point-mass child.
    The first committed token follows the target distribution with either walk."""
    from specdec.tree import TokenTree

    rows, params = 20000, SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(7)
    q = ONE_NODE_DRAFT
    draws = torch.multinomial(q.expand(rows, V), 2, replacement=False, generator=generator)  # [rows, 2] without replacement
    # nodes: 0 root; 1 drawn; 2 point mass on token 3; 3 drawn (the second draw); 4 point mass on token 0 under node 1
    tokens = torch.stack([torch.zeros(rows, dtype=torch.long), draws[:, 0], torch.full((rows,), 3), draws[:, 1], torch.zeros(rows, dtype=torch.long)], dim=1)
    parents = torch.tensor([-1, 0, 0, 0, 1]).expand(rows, 5)
    depths = torch.tensor([0, 1, 1, 1, 2]).expand(rows, 5)
    sampled = torch.tensor([False, True, False, True, False]).expand(rows, 5)
    zeros = torch.zeros(rows, 5)
    tree = TokenTree(
        tokens=tokens, parents=parents, depths=depths, logq=zeros, cum_logq=zeros, valid=torch.ones(rows, 5, dtype=torch.bool),
        sampled=sampled, draft_logprobs=q.log().expand(rows, 5, V).clone(),
    )
    logits = ONE_NODE_TARGET.log().expand(rows, 5, V)
    verdict = SamplingRule(walk=walk).verify(tree, logits, params, generator)
    first = torch.where(verdict.accepted_len > 0, tree.tokens.gather(1, verdict.path[:, :1]).squeeze(1), verdict.bonus_tokens)
    pvalue = chi2_pvalue(np.bincount(first.numpy(), minlength=V), ONE_NODE_TARGET.double().numpy())
    assert pvalue > P_PASS, f"{walk} walk: chi-square p = {pvalue:.2e}"
    assert 0 < int((verdict.accepted_len == 2).sum()) < rows  # the second level is reached, sometimes
    # after node 1 (the target's distribution there is the same): the second token, node 4's or the bonus
    via_node1 = (verdict.accepted_len > 0) & (verdict.path[:, 0] == 1)
    second = torch.where(verdict.accepted_len == 2, tree.tokens[:, 4], verdict.bonus_tokens)[via_node1]
    pvalue = chi2_pvalue(np.bincount(second.numpy(), minlength=V), ONE_NODE_TARGET.double().numpy())
    assert pvalue > P_PASS, f"{walk} walk, second token: chi-square p = {pvalue:.2e}"


def test_temperature_one_changes_no_logit():
    """At T = 1 the division is skipped: the log-probabilities are the model's own, and the logits
    the caller passed are left as they were."""
    logits = torch.randn(2, 5, 50, generator=torch.Generator().manual_seed(1)) * 3
    before = logits.clone()
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=7), SamplingParams(temperature=1.0, top_p=0.8)):
        got = logits_to_logprobs(logits, params)
        assert torch.equal(logits, before)
        scaled = SamplingParams(temperature=1.0 + 1e-7, top_k=params.top_k, top_p=params.top_p)  # the division path, a hair away
        assert torch.allclose(got, logits_to_logprobs(logits, scaled), atol=1e-5, equal_nan=True)
    assert torch.equal(logits_to_logprobs(logits, SamplingParams(temperature=1.0)), torch.log_softmax(logits, dim=-1))
