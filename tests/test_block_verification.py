"""Block verification of chains (`BlockChainTests`, Sun et al. 2024): exact, by enumeration;
and of trees' chain segments on the device (`BlockTreeTests`): the same outcomes in distribution
as the host walk's (`BlockSiblingTests`, exact by the chi-square tests of
test_sampling_distribution.py) and as the chain rule's on a chain.

Every drafted chain of a 3-token vocabulary is one row of a batch; the rule's tests
(`thresholds`: the acceptance thresholds h and the residuals) give each row's exact
distribution over the accepted prefix and the bonus token, with no random draw. Completing
each output with the target's own samples to K + 1 tokens must give exactly the target's
joint distribution of K + 1 tokens (float32 arithmetic: within 1e-5). The distributions
depend on the whole prefix (a random table per prefix), and the chains are drawn from the
draft, chosen deterministically (point-mass proposals), or a mix of both, and end early
in some rows.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from specdec.errors import SpecDecError
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from specdec.verification.sampling import (
    BLOCK_CHAIN,
    BLOCK_TREE,
    EXACT,
    EXACT_BLOCKS,
    EXACT_TREE,
    TOKEN_CHAIN,
    TRAVERSAL,
    TRAVERSAL_TREE,
    BlockChainTests,
    BlockTreeTests,
    ChainTests,
    ChildTable,
    RowTree,
    SamplingRule,
    TraversalTests,
    TraversalTreeTests,
    Wavefront,
)

V, K = 3, 3


class Tables:
    """A target and a draft distribution for every prefix of up to K + 1 tokens (random, seeded)."""

    def __init__(self, seed: int, target_shape: float = 0.7, draft_shape: float = 0.5, identical_at: tuple[int, ...] | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.target: dict[tuple[int, ...], np.ndarray] = {}
        self.draft: dict[tuple[int, ...], np.ndarray] = {}
        for length in range(K + 2):
            for prefix in itertools.product(range(V), repeat=length):
                t, d = rng.gamma(target_shape, size=V), rng.gamma(draft_shape, size=V)
                self.target[prefix] = t / t.sum()
                self.draft[prefix] = self.target[prefix] if prefix == identical_at else d / d.sum()

    def target_joint(self, length: int) -> dict[tuple[int, ...], float]:
        out = {}
        for seq in itertools.product(range(V), repeat=length):
            out[seq] = float(np.prod([self.target[seq[:j]][seq[j]] for j in range(length)]))
        return out

    def complete(self, prefix: tuple[int, ...], weight: float, length: int, into: dict[tuple[int, ...], float]) -> None:
        """Adds `weight` x P(prefix completed by target samples) for every completion to `length` tokens."""
        for rest in itertools.product(range(V), repeat=length - len(prefix)):
            seq = prefix + rest
            into[seq] = into.get(seq, 0.0) + weight * float(np.prod([self.target[seq[:j]][seq[j]] for j in range(len(prefix), length)]))


def chains(tables: Tables, sampled: tuple[bool, ...], gamma: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """Every chain of K tokens the draft can propose (its first `gamma` drafted, the rest padding
    with token 0): sampled positions drawn from the draft, the others its most likely token.
    Returns the chains and their probabilities."""
    out, probs = [], []
    for chain in itertools.product(range(V), repeat=gamma):
        prob = 1.0
        for i, tok in enumerate(chain):
            dist = tables.draft[chain[:i]]
            prob *= dist[tok] if sampled[i] else float(tok == int(dist.argmax()))
        if prob > 0:
            out.append(chain + (0,) * (K - gamma))
            probs.append(prob)
    return out, probs


def tree_of(tables: Tables, rows: list[tuple[int, ...]], sampled: tuple[bool, ...], gamma: int) -> tuple[TokenTree, torch.Tensor, torch.Tensor]:
    """The chains as a TokenTree (root token 0) with each node's target and draft distributions.
    Draft rows of nodes whose child is not sampled hold a uniform distribution the tests must not read."""
    b, n = len(rows), K + 1
    tokens = torch.tensor([(0, *r) for r in rows])
    valid = torch.tensor([[True] * (1 + gamma) + [False] * (K - gamma)] * b)
    flags = torch.tensor([[False, *sampled]] * b) & valid
    parents = torch.where(valid, torch.arange(n) - 1, -1).expand(b, n)
    zeros = torch.zeros(b, n)
    tree = TokenTree(tokens=tokens, parents=parents, depths=torch.arange(n).expand(b, n), logq=zeros, cum_logq=zeros, valid=valid, sampled=flags, chain=True)
    target = torch.tensor(np.array([[tables.target[r[:i]] for i in range(n)] for r in rows]), dtype=torch.float32)
    uniform = np.full(V, 1.0 / V)
    draft = np.array([[tables.draft[r[:i]] if i < K and i < gamma and sampled[i] else uniform for i in range(n)] for r in rows])
    return tree, target, torch.tensor(draft, dtype=torch.float32)


def output_joint(tests: BlockChainTests, tables: Tables, sampled: tuple[bool, ...], gamma: int) -> tuple[dict[tuple[int, ...], float], float]:
    """The exact joint of gamma + 1 tokens the rule's output gives (completed by target samples),
    and the expected accepted tokens."""
    rows, probs = chains(tables, sampled, gamma)
    tree, target, draft = tree_of(tables, rows, sampled, gamma)
    h, gam, residual = tests.thresholds(tree, target, draft if any(sampled) else None)
    h, residual = h.double().numpy(), residual.double().numpy()
    assert gam.tolist() == [gamma] * len(rows)
    joint: dict[tuple[int, ...], float] = {}
    expected = 0.0
    for r, (chain, prob) in enumerate(zip(rows, probs, strict=True)):
        for tau in range(gamma + 1):
            p_tau = (h[r, tau - 1] if tau else 1.0) * float(np.prod([1.0 - h[r, j - 1] for j in range(tau + 1, gamma + 1)]))
            if tau < gamma and residual[r, tau].sum() <= 1e-12:  # an empty residual: such an end has no probability
                assert p_tau < 1e-5
                continue
            bonus = tables.target[chain[:tau]] if tau == gamma else residual[r, tau] / residual[r, tau].sum()
            expected += prob * p_tau * tau
            for y in range(V):
                tables.complete(chain[:tau] + (y,), prob * p_tau * bonus[y], gamma + 1, joint)
    return joint, expected


def token_expected(tables: Tables, sampled: tuple[bool, ...], gamma: int) -> float:
    """Expected accepted tokens of the token-by-token tests on the same drafts."""
    rows, probs = chains(tables, sampled, gamma)
    total = 0.0
    for chain, prob in zip(rows, probs, strict=True):
        accept = [min(1.0, tables.target[chain[:i]][chain[i]] / (tables.draft[chain[:i]][chain[i]] if sampled[i] else 1.0)) for i in range(gamma)]
        total += prob * float(np.cumprod(accept).sum())
    return total


CASES = {
    "drawn": ((True, True, True), 3, {}),
    "drawn-shorter-row": ((True, True, True), 2, {}),
    "one-node": ((True, True, True), 1, {}),
    "point-masses": ((False, False, False), 3, {}),
    "mixed": ((True, False, True), 3, {}),
    "peaked-draft": ((True, True, True), 3, {"draft_shape": 0.2}),
    # the draft equals the target after the first token 1: weights stay 1 and residuals vanish there
    "identical-node": ((True, True, True), 3, {"identical_at": (1,)}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_block_verification_outputs_the_target_joint_exactly(case, seed):
    sampled, gamma, shape = CASES[case]
    tables = Tables(seed, **shape)
    joint, _ = output_joint(BlockChainTests(), tables, sampled, gamma)
    exact = tables.target_joint(gamma + 1)
    assert abs(sum(joint.values()) - 1.0) < 1e-5
    assert max(abs(joint.get(seq, 0.0) - p) for seq, p in exact.items()) < 1e-5


@pytest.mark.parametrize("seed", range(4))
def test_block_verification_accepts_at_least_what_token_tests_accept(seed):
    """In expectation over the drafts (the paper's optimality), on every seed; and strictly more
    somewhere (else the rule would be the token-by-token one)."""
    tables = Tables(seed)
    sampled = (True, True, True)
    _, block = output_joint(BlockChainTests(), tables, sampled, 3)
    token = token_expected(tables, sampled, 3)
    assert block >= token - 1e-6
    assert block > token + 1e-3, f"block {block:.4f} vs token {token:.4f}"


class UnweightedResidual(BlockChainTests):
    """Broken: the residual after the accepted prefix ignores the prefix's weight (the
    token-by-token residual with the block's acceptance)."""

    def weighted_residual(self, target_probs, weight, draft_probs, token, sampled):
        return super().weighted_residual(target_probs, torch.ones_like(weight), draft_probs, token, sampled)


def test_an_unweighted_residual_is_not_exact():
    tables = Tables(0)
    joint, _ = output_joint(UnweightedResidual(), tables, (True, True, True), 3)
    exact = tables.target_joint(4)
    assert max(abs(joint.get(seq, 0.0) - p) for seq, p in exact.items()) > 1e-3


def test_one_drafted_node_is_the_token_rule():
    """With one drafted node the block rule's threshold is min(1, p / q), the token rule's."""
    tables = Tables(3)
    rows, _ = chains(tables, (True, True, True), 1)
    tree, target, draft = tree_of(tables, rows, (True, True, True), 1)
    h, _, _ = BlockChainTests().thresholds(tree, target, draft)
    x = tree.tokens[:, 1]
    ratio = (target[:, 0].gather(1, x[:, None]) / draft[:, 0].gather(1, x[:, None])).clamp(max=1.0).squeeze(1)
    assert torch.allclose(h[:, 0], ratio, atol=1e-6)
    assert isinstance(BlockChainTests(), ChainTests)


# ----- trees on the device -----------------------------------------------------------------

TREE_V = 5
SHAPES = {
    # root: two drawn children and a point mass; segments [1, 4, 6] (drawn, drawn, point mass),
    # [2, 5] ending at a node with two drawn children [7], [8], and [3]
    "branching": ([-1, 0, 0, 0, 1, 2, 4, 5, 5], [False, True, True, False, True, True, False, True, True]),
    # one segment of three drawn nodes, in a tree not flagged as a chain
    "chain": ([-1, 0, 1, 2], [False, True, True, True]),
}


def tree_with_distributions(shape: str, rows: int, seed: int) -> tuple[TokenTree, torch.Tensor]:
    """One tree of `shape` repeated over `rows` rows, its random target and draft distributions
    (seeded); drawn children drawn from their parent's draft (siblings without replacement),
    point-mass children the draft's most likely token not drawn by a sibling. Returns the tree
    and the target logits [rows, N, V]."""
    parents, sampled = SHAPES[shape]
    rng = np.random.default_rng(seed)
    n = len(parents)
    target = rng.gamma(0.6, size=(n, TREE_V))
    draft = rng.gamma(0.6, size=(n, TREE_V))
    target, draft = target / target.sum(1, keepdims=True), draft / draft.sum(1, keepdims=True)
    tokens = [0] * n
    for node in range(n):
        kids = [c for c in range(n) if parents[c] == node]
        left = draft[node].copy()
        for c in kids:
            tokens[c] = int(rng.choice(TREE_V, p=left / left.sum())) if sampled[c] else int(np.argmax(left))
            left[tokens[c]] = 0.0
    depths = [0] * n
    for node in range(1, n):
        depths[node] = depths[parents[node]] + 1
    zeros = torch.zeros(rows, n)

    def fill(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).expand(rows, n)

    tree = TokenTree(
        tokens=fill(tokens, torch.long), parents=fill(parents, torch.long), depths=fill(depths, torch.long), logq=zeros, cum_logq=zeros,
        valid=fill([True] * n, torch.bool), sampled=fill(sampled, torch.bool),
        draft_logprobs=torch.tensor(draft, dtype=torch.float32).log().expand(rows, n, TREE_V).clone(),
    )
    return tree, torch.tensor(target, dtype=torch.float32).log().expand(rows, n, TREE_V)


def verdicts(rule, shape: str, tree_seed: int, rows: int = 40000, seed: int = 0) -> collections.Counter:
    """How often each outcome (accepted nodes, bonus token) occurs over `rows` rows."""
    tree, logits = tree_with_distributions(shape, rows, tree_seed)
    verdict = rule.verify(tree, logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(seed))
    lengths, paths, bonus = verdict.accepted_len.tolist(), verdict.path.tolist(), verdict.bonus_tokens.tolist()
    return collections.Counter((tuple(paths[r][: lengths[r]]), bonus[r]) for r in range(rows))


def same_distribution_pvalue(a: collections.Counter, b: collections.Counter) -> float:
    """Two-sample chi-square (a contingency table over the outcomes either saw)."""
    keys = sorted(set(a) | set(b))
    return float(chi2_contingency(np.array([[a[k] for k in keys], [b[k] for k in keys]], dtype=float))[1])


class TreeUnweightedResidual(BlockTreeTests):
    """Broken device tests: the bonus after a partly accepted segment comes from the unweighted residual."""

    def weighted_residual(self, target_probs, weight, draft_probs, token, sampled):
        return super().weighted_residual(target_probs, torch.ones_like(weight), draft_probs, token, sampled)


@pytest.mark.parametrize("tree_seed", [1, 2, 3])
def test_device_block_segments_match_the_host_walk(tree_seed):
    """Not just lossless: the device's accepted paths and bonus tokens follow the host walk's
    distribution (the same algorithm), and the broken residual does not (seeds 1 and 3: trees
    where a segment is partly accepted often enough to show it)."""
    host = verdicts(SamplingRule(walk="host", segments="block"), "branching", tree_seed, seed=1)
    device = verdicts(SamplingRule(walk="device", segments="block"), "branching", tree_seed, seed=2)
    assert isinstance(SamplingRule(walk="device", segments="block").tree_tests, BlockTreeTests)
    pvalue = same_distribution_pvalue(host, device)
    assert pvalue > 1e-3, f"device vs host: p = {pvalue:.2e}"
    assert any(len(path) == 3 for path, _ in device)  # the three-node segment is accepted whole, sometimes
    if tree_seed != 2:
        broken = verdicts(SamplingRule(walk="device", tree_tests=TreeUnweightedResidual()), "branching", tree_seed, seed=2)
        pvalue = same_distribution_pvalue(host, broken)
        assert pvalue < 1e-6, f"the broken residual passed: p = {pvalue:.2e}"


@pytest.mark.parametrize("tree_seed", [0, 1])
def test_device_block_segments_on_a_chain_are_block_verification(tree_seed):
    """A chain-shaped tree (not flagged as a chain) gets the chain rule's outcomes."""
    device = verdicts(BlockTreeTests(), "chain", tree_seed, seed=4)
    chain = verdicts(BLOCK_CHAIN, "chain", tree_seed, seed=5)
    pvalue = same_distribution_pvalue(device, chain)
    assert pvalue > 1e-3, f"device tree vs chain rule: p = {pvalue:.2e}"


def test_which_tests_each_setting_picks():
    """segments='auto' (the default): traversal on both walks; 'block' and 'token' the same on
    both; chains chosen apart from segments."""
    picks = {seg: (r.tests, r.tree_tests) for seg, r in ((seg, SamplingRule(segments=seg)) for seg in ("auto", "block", "token"))}
    assert picks == {"auto": (TRAVERSAL, TRAVERSAL_TREE), "block": (EXACT_BLOCKS, BLOCK_TREE), "token": (EXACT, EXACT_TREE)}
    assert SamplingRule().chain_tests is BLOCK_CHAIN and SamplingRule(chains="token", segments="block").chain_tests is TOKEN_CHAIN


# ----- traversal verification of whole trees (host walk), exact by enumeration ---------------
class Unscripted(Exception):
    def __init__(self, weight: float) -> None:
        self.weight = weight


class ScriptedTraversal(TraversalTests):
    """`TraversalTests` whose tests follow a script of outcomes; the first test past the script
    raises `Unscripted` with its acceptance probability, so every outcome can be enumerated."""

    def __init__(self, script: tuple[bool, ...]) -> None:
        self.script = script
        self.used = 0

    def accepts(self, weight: float, uniforms) -> bool:
        if self.used == len(self.script):
            raise Unscripted(weight)
        self.used += 1
        return self.script[self.used - 1]


class ScriptedUnweighted(ScriptedTraversal):
    """Broken: a rejected child leaves its parent recursive rejection sampling's residual max(0, P - Q)."""

    def weighted_residual(self, target_probs, weight, proposal, token):
        return super().weighted_residual(target_probs, 1.0, proposal, token)


Spec = tuple["Spec", ...]
"""a tree shape: each node's children's shapes (a leaf is ())"""


def drawn_trees(tables: Tables, prefix: tuple[int, ...], spec: Spec, sampled: bool) -> list[tuple[list[tuple[int, bool, object]], float]]:
    """Every tree of shape `spec` below `prefix` with its probability: children drawn without
    replacement from the draft (sampled) or its top tokens (probability 1). A tree is a list of
    (token, sampled, subtree)."""
    if not spec:
        return [([], 1.0)]
    q = tables.draft[prefix]
    k = len(spec)
    if sampled:
        draws = []
        for seq in itertools.permutations(range(V), k):
            p, left = 1.0, 1.0
            for t in seq:
                p, left = p * q[t] / left, left - q[t]
            draws.append((seq, p))
    else:
        draws = [(tuple(int(t) for t in np.argsort(-q, kind="stable")[:k]), 1.0)]
    out = []
    for seq, p in draws:
        subtrees = [drawn_trees(tables, prefix + (t,), sub, sampled) for t, sub in zip(seq, spec, strict=True)]
        for combo in itertools.product(*subtrees):
            tree = [(t, sampled, sub[0]) for t, sub in zip(seq, combo, strict=True)]
            out.append((tree, p * float(np.prod([sub[1] for sub in combo]))))
    return out


def row_of(tables: Tables, tree) -> tuple[RowTree, np.ndarray, np.ndarray, list[tuple[int, ...]]]:
    """The host walk's view of a tree (BFS order) and each node's prefix."""
    nodes = [((), -1, -1, False)]  # (prefix, parent, token, sampled)
    queue = [(0, (), tree)]
    while queue:
        index, prefix, kids = queue.pop(0)
        for tok, sampled, sub in kids:
            nodes.append((prefix + (tok,), index, tok, sampled))
            queue.append((len(nodes) - 1, prefix + (tok,), sub))
    children: list[list[int]] = [[] for _ in nodes]
    for i, (_, parent, _, _) in enumerate(nodes):
        if parent >= 0:
            children[parent].append(i)
    row = RowTree(tokens=[n[2] for n in nodes], sampled=[n[3] for n in nodes], children=children)
    prefixes = [n[0] for n in nodes]
    return row, np.stack([tables.target[p] for p in prefixes]), np.stack([tables.draft[p] for p in prefixes]), prefixes


def traversal_outputs(tests: type[ScriptedTraversal], row: RowTree, target: np.ndarray, draft: np.ndarray) -> list[tuple[list[int], np.ndarray, float]]:
    """Every outcome of the walk: (accepted nodes, bonus distribution, probability)."""
    out, pending = [], [((), 1.0)]
    while pending:
        script, p = pending.pop()
        try:
            path, probs = tests(script)._visit(0, 1.0, row, target, draft, None)
        except Unscripted as test:
            pending += [(script + (True,), p * test.weight), (script + (False,), p * (1.0 - test.weight))]
            continue
        out.append((path, probs, p))
    return out


TRAVERSAL_SHAPES: dict[str, Spec] = {
    "two-leaves": ((), ()),
    "chain-of-two": (((),),),
    "branch-below-a-chain": (((), ()),),
    "two-chains": (((),), ((),)),
    "ragged": (((), ()), ((),), ()),
    "deep": ((((),), ()),),
}


@pytest.mark.parametrize("sampled", [True, False], ids=["drawn", "top-k"])
@pytest.mark.parametrize("shape", TRAVERSAL_SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_traversal_outputs_the_target_joint_exactly(shape, sampled, seed):
    """Every drawn tree of a 3-token vocabulary through the real `TraversalTests` walk (every test
    outcome enumerated): completed with the target's own samples, the output is the target's
    joint exactly; recursive rejection sampling's residual in its place is not."""
    tables = Tables(seed, identical_at=(1,) if seed else None)
    spec = TRAVERSAL_SHAPES[shape]
    length = 4  # every shape accepts at most 3 tokens, and a bonus
    exact, broken = {}, {}
    for tree, p_tree in drawn_trees(tables, (), spec, sampled):
        row, target, draft, prefixes = row_of(tables, tree)
        for tests, into in ((ScriptedTraversal, exact), (ScriptedUnweighted, broken)):
            for path, probs, p in traversal_outputs(tests, row, target, draft):
                for t in range(V):
                    tables.complete(prefixes[path[-1]] + (t,) if path else (t,), p_tree * p * probs[t], length, into)
    joint = tables.target_joint(length)
    assert max(abs(exact[s] - joint[s]) for s in joint) < 1e-9
    if shape not in ("two-leaves",) and sampled:  # weights below 1 under a rejected child change its parent's residual
        assert max(abs(broken[s] - joint[s]) for s in joint) > 1e-3


def test_traversal_of_a_chain_is_block_verification():
    """On one chain the traversal walk accepts as block verification does (expected accepted tokens)."""
    tables = Tables(3)
    for sampled in (True, False):
        tau = 0.0
        for tree, p_tree in drawn_trees(tables, (), ((((),),),), sampled):
            row, target, draft, _ = row_of(tables, tree)
            tau += p_tree * sum(p * len(path) for path, _, p in traversal_outputs(ScriptedTraversal, row, target, draft))
        block_tau = output_joint(BLOCK_CHAIN, tables, (sampled,) * K, K)[1]
        assert tau == pytest.approx(block_tau, abs=1e-6)


# ----- traversal verification on the device, exact by enumeration ---------------------------


class TreeTraversalUnweighted(TraversalTreeTests):
    """Broken device traversal: a rejected child leaves its parent the unweighted residual max(0, P - Q)."""

    def weighted_residual(self, target_probs, weight, draft_probs, token, sampled):
        return super().weighted_residual(target_probs, torch.ones_like(weight), draft_probs, token, sampled)


def batch_of(tables: Tables, trees: list) -> tuple[TokenTree, torch.Tensor, torch.Tensor, list[list[tuple[int, ...]]]]:
    """Drawn trees of one shape as the rows of a TokenTree (BFS order: the same parents in every
    row), with each node's target and draft distributions [B, N, V] (float64) and prefixes."""
    rows = [row_of(tables, tree) for tree, _ in trees]
    first = rows[0][0]
    n = len(first.tokens)
    parents = [-1] * n
    for node, kids in enumerate(first.children):
        for kid in kids:
            parents[kid] = node
    depths = [0] * n
    for node in range(1, n):
        depths[node] = depths[parents[node]] + 1
    b = len(rows)
    zeros = torch.zeros(b, n)
    tree = TokenTree(
        tokens=torch.tensor([[0, *r[0].tokens[1:]] for r in rows]), parents=torch.tensor(parents).expand(b, n),
        depths=torch.tensor(depths).expand(b, n), logq=zeros, cum_logq=zeros, valid=torch.ones(b, n, dtype=torch.bool),
        sampled=torch.tensor([r[0].sampled for r in rows]), draft_logprobs=torch.tensor(np.stack([r[2] for r in rows])).log(),
    )
    return tree, torch.tensor(np.stack([r[1] for r in rows])), torch.tensor(np.stack([r[2] for r in rows])), [r[3] for r in rows]


def device_traversal_joint(tests: TraversalTreeTests, tables: Tables, spec: Spec, sampled: bool, length: int) -> dict[tuple[int, ...], float]:
    """The exact output joint of the device rule over every drawn tree of `spec` (completed with
    target samples to `length` tokens): its weights and final distributions from `states`, every
    pass/fail pattern of the nodes' tests through `accepted_node`, weighted by its probability."""
    trees = drawn_trees(tables, (), spec, sampled)
    tree, target, draft, prefixes = batch_of(tables, trees)
    b, n = tree.tokens.shape
    plan = Wavefront.of(tree)
    table = plan.table
    weight = tests.states(tree, plan, target, draft.clone())  # target: now each node's final P
    joint: dict[tuple[int, ...], float] = {}
    for pattern in itertools.product((True, False), repeat=n - 1):
        passing = torch.tensor((True, *pattern))
        at = tests.accepted_node(tree, table, weight, torch.where(passing, 0.0, 1.0).double().expand(b, n)).tolist()
        p_pattern = torch.where(passing[1:], weight[:, 1:], 1.0 - weight[:, 1:]).prod(dim=1).tolist()  # [B]
        for r, (_, p_tree) in enumerate(trees):
            for t in range(V):
                tables.complete(prefixes[r][at[r]] + (t,), p_tree * p_pattern[r] * float(target[r, at[r], t]), length, joint)
    return joint


@pytest.mark.parametrize("sampled", [True, False], ids=["drawn", "top-k"])
@pytest.mark.parametrize("shape", TRAVERSAL_SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_device_traversal_outputs_the_target_joint_exactly(shape, sampled, seed):
    """`TraversalTreeTests` (states first, draws after) over every drawn tree of a 3-token
    vocabulary and every outcome of its tests: the target's joint exactly (float64), as the host
    walk; the unweighted residual is not."""
    tables = Tables(seed, identical_at=(1,) if seed else None)
    spec = TRAVERSAL_SHAPES[shape]
    joint = tables.target_joint(4)
    exact = device_traversal_joint(TRAVERSAL_TREE, tables, spec, sampled, 4)
    assert max(abs(exact[s] - joint[s]) for s in joint) < 1e-9
    if shape != "two-leaves" and sampled:
        broken = device_traversal_joint(TreeTraversalUnweighted(), tables, spec, sampled, 4)
        assert max(abs(broken[s] - joint[s]) for s in joint) > 1e-3


def test_post_order_positions():
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, -1]])  # a padding node last
    valid = parents >= 0
    valid[0, 0] = True
    depths = torch.tensor([[0, 1, 1, 2, 2, 2, 0]])
    zeros = torch.zeros(1, 7)
    tree = TokenTree(tokens=torch.zeros(1, 7, dtype=torch.long), parents=parents, depths=depths, logq=zeros, cum_logq=zeros, valid=valid, sampled=torch.zeros(1, 7, dtype=torch.bool))
    position = TraversalTreeTests.post_order(tree, ChildTable.of(tree))[0, :6].tolist()
    assert position == [5, 2, 4, 0, 1, 3]  # post-order: 3, 4, 1, 5, 2, 0


@pytest.mark.parametrize("tree_seed", [1, 3])
def test_device_traversal_matches_the_host_walk(tree_seed):
    """Sampled outcomes of the device and host traversal (different uniforms) follow one distribution."""
    host = verdicts(SamplingRule(walk="host", segments="traversal"), "branching", tree_seed, seed=1)
    device = verdicts(SamplingRule(walk="device", segments="traversal"), "branching", tree_seed, seed=2)
    pvalue = same_distribution_pvalue(host, device)
    assert pvalue > 1e-3, f"device vs host traversal: p = {pvalue:.2e}"
    broken = verdicts(SamplingRule(walk="device", tree_tests=TreeTraversalUnweighted()), "branching", tree_seed, seed=2)
    pvalue = same_distribution_pvalue(host, broken)
    assert pvalue < 1e-6, f"the broken device traversal passed: p = {pvalue:.2e}"


def test_traversal_setting_walks_where_asked():
    """segments='traversal' picks `TraversalTests` on the host walk and `TraversalTreeTests` on the
    device walk, which it takes as every setting does (on accelerators)."""
    from specdec.verification import make_rule

    rule = make_rule("sampling", segments="traversal")
    assert rule.tests is TRAVERSAL and rule.tree_tests is TRAVERSAL_TREE
    assert rule.walks_on_device(torch.device("cuda")) and not rule.walks_on_device(torch.device("cpu"))
    assert SamplingRule(segments="traversal", walk="device").walks_on_device(torch.device("cpu"))
    with pytest.raises(SpecDecError, match="'traversal' the whole tree from the leaves up"):
        SamplingRule(segments="leaves")


def test_prepared_wavefront_gives_the_same_verdicts():
    """`SamplingRule.prepare` (called before the verify forward) plans traversal's device rounds;
    verifying with that plan or without one gives identical verdicts for one seed. Other settings
    and greedy decoding plan nothing."""
    from specdec.verification.sampling import Wavefront

    tree, logits = tree_with_distributions("branching", 64, 1)
    params = SamplingParams(temperature=1.0)
    rule = SamplingRule(walk="device", segments="traversal")
    plain = rule.verify(tree, logits, params, torch.Generator().manual_seed(7))
    rule.prepare(tree, params)
    # rounds: node 5 (child of node 2, rank 1 under the root) starts at 2 + 1 = 3 and has two children
    assert isinstance(tree.verify_plan, Wavefront) and tree.verify_plan.rounds() == 5
    planned = rule.verify(tree, logits, params, torch.Generator().manual_seed(7))
    assert torch.equal(plain.path, planned.path) and torch.equal(plain.bonus_tokens, planned.bonus_tokens)
    for other, p in ((SamplingRule(walk="device", segments="token"), params), (SamplingRule(walk="host", segments="traversal"), params), (rule, SamplingParams())):
        fresh, _ = tree_with_distributions("branching", 2, 1)
        other.prepare(fresh, p)
        assert fresh.verify_plan is None


def test_device_traversal_of_a_batch_equals_each_row_alone():
    """Rows of different shapes in one batch (a branching tree and a chain padded with invalid
    nodes): the rounds' padding slots (rows with fewer children in a round than the widest)
    change no real node, so each row's weights and final distributions are the ones it gets alone."""
    (wide, wide_logits), (chain, chain_logits) = tree_with_distributions("branching", 1, 4), tree_with_distributions("chain", 1, 5)
    pad = wide.tokens.shape[1] - chain.tokens.shape[1]

    def padded(t: torch.Tensor, value: float | int | bool) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, pad), value=value) if t.dim() == 2 else torch.nn.functional.pad(t, (0, 0, 0, pad), value=value)

    fields = {f.name: getattr(chain, f.name) for f in dataclasses.fields(TokenTree) if isinstance(getattr(chain, f.name), torch.Tensor)}
    fill = {"parents": 0, "valid": False, "sampled": False, "logq": float("-inf"), "cum_logq": float("-inf"), "draft_logprobs": 0.0}
    chain_padded = dataclasses.replace(chain, **{k: padded(v, fill.get(k, 0)) for k, v in fields.items()})
    batch = dataclasses.replace(
        wide, **{k: torch.cat([getattr(wide, k), getattr(chain_padded, k)]) for k in fields}, ancestors=None
    )
    rule = TraversalTreeTests()
    logits = torch.cat([wide_logits, padded(chain_logits, 0.0)])
    probs = logits.softmax(dim=-1)
    draft = batch.draft_logprobs.exp()
    plan = Wavefront.of(batch)
    weight = rule.states(batch, plan, probs, draft)
    assert max(plan.widths()) > 1  # the branching row handles two children in a round where the chain's handles one: a padding slot
    for row, (tree, lg) in enumerate(((wide, wide_logits), (chain, chain_logits))):
        alone_probs = lg.softmax(dim=-1).clone()
        alone = rule.states(tree, Wavefront.of(tree), alone_probs, tree.draft_logprobs.exp())
        m = tree.tokens.shape[1]
        torch.testing.assert_close(weight[row, :m], alone[0])
        torch.testing.assert_close(probs[row, :m], alone_probs[0])


def test_device_traversal_of_a_root_only_tree_tests_nothing():
    """A tree with no children has no rounds: weight 1 at the root, its P unchanged."""
    tree, logits = tree_with_distributions("chain", 2, 0)
    root = dataclasses.replace(tree, **{k: getattr(tree, k)[:, :1] for k in ("tokens", "parents", "depths", "logq", "cum_logq", "valid", "sampled")}, draft_logprobs=tree.draft_logprobs[:, :1], ancestors=None)
    probs = logits[:, :1].softmax(dim=-1)
    before = probs.clone()
    plan = Wavefront.of(root)
    assert plan.widths() == []
    weight = TraversalTreeTests().states(root, plan, probs, root.draft_logprobs.exp())
    assert torch.equal(weight, torch.ones(2, 1)) and torch.equal(probs, before)
