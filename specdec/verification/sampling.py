"""Lossless rejection sampling for chains and trees (recursive rejection sampling).

At a node with target distribution `target_probs` (after temperature/top-p/top-k), the
children are tried in tree order. Child k has a proposal distribution `proposal_k`:

- a **sampled** child (drawn from the node's draft distribution `draft_probs`, without
  replacement among its sampled siblings, in tree order): `draft_probs` with the earlier
  sampled siblings removed, renormalised, the distribution it was actually drawn from;
- a **deterministic** child (top-k): a point mass on its token.

Child k is accepted with probability min(1, target_probs(x_k) / proposal_k(x_k)); on
rejection the target distribution becomes the residual norm(max(0, target_probs - proposal_k))
and the next child is tried. If all children are rejected (or the node is a leaf) the bonus
token is drawn from the current residual. With one sampled child this is Leviathan et al.'s
rule; with several children drawn without replacement it is Recursive Speculative Decoding's
recursive rejection sampling (Jeon et al. 2024); with point masses it is "accept x with
probability target_probs(x), else remove x".

Why it is exact: one test with a proposal the candidate really follows commits x_k with
probability min(target_probs, proposal_k)(x) and, on rejection (probability
sum max(0, target_probs - proposal_k)), whatever the residual's own sampler gives; if that
gives the residual exactly, the sum is target_probs. The next child is the residual's
sampler: given the earlier draws (and rejections, whose coins are independent of later
draws) it follows `proposal_{k+1}`, so by induction from the last child (whose sampler is the
bonus draw) every node commits a token distributed as its target distribution, whatever the
tree's shape. It needs each tested child to follow its proposal *given that it was kept*:
a policy may prune sampled children by their position, their Gumbel keys or anything drawn
before them, never by their own tokens (docs/ARCHITECTURE.md).

The walk runs per row on the host: each row's tree fields, target and draft distributions and
pre-drawn uniforms (one per test and one for the bonus, `[B, N]` in one draw) are read once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specdec.sampling import SamplingParams, logits_to_logprobs
from specdec.tree import TokenTree
from specdec.verification.base import Verdict

_EPS = 1e-12


@dataclass
class RowTree:
    """One row of a TokenTree on the host (lists per node)."""

    tokens: list[int]
    sampled: list[bool]
    children: list[list[int]]
    """valid children of each node, in tree order"""

    @classmethod
    def read(cls, tree: TokenTree) -> list[RowTree]:
        """Every row of `tree`, from one host read of its tokens, parents, valid and sampled."""
        b, n = tree.tokens.shape
        packed = torch.cat([tree.tokens, tree.parents.masked_fill(~tree.valid, -1), tree.sampled.long()], dim=1).tolist()  # [B, 3N]
        rows = []
        for values in packed:
            children: list[list[int]] = [[] for _ in range(n)]
            for node, parent in enumerate(values[n : 2 * n]):
                if parent >= 0:
                    children[parent].append(node)  # BFS order: nodes in increasing index = tree order
            rows.append(cls(tokens=values[:n], sampled=[bool(s) for s in values[2 * n :]], children=children))
        return rows


class Uniforms:
    """A row's pre-drawn uniforms in [0, 1), handed out in order."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values
        self.used = 0

    def next(self) -> float:
        if self.used >= len(self.values):  # cannot happen: a walk makes at most N - 1 tests and one bonus draw
            raise RuntimeError(f"rejection walk used more than {len(self.values)} uniforms")
        u = float(self.values[self.used])
        self.used += 1
        return u


def sample_index(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from `probs` [V] (need not be normalised) with the uniform u; a
    zero-probability entry is never returned."""
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(probs) - 1)


class SiblingTests:
    """The exact tests of one node's children, in tree order (see the module docstring).

    `proposal` and `residual` are the two places the maths lives; the distribution tests
    subclass them with deliberately wrong versions to show the tests can tell.
    """

    def proposal(self, draft_probs: np.ndarray, removed: list[int]) -> np.ndarray:
        """[V] the distribution a sampled child was drawn from: draft_probs without the tokens
        of its earlier sampled siblings (`removed`), renormalised."""
        out = draft_probs.copy()
        if removed:
            out[removed] = 0.0
        return out / max(out.sum(), _EPS)

    def residual(self, target_probs: np.ndarray, proposal: np.ndarray) -> np.ndarray:
        """[V] norm(max(0, target_probs - proposal)); target_probs if nothing is left (then the
        test could not have rejected)."""
        res = np.maximum(target_probs - proposal, 0.0)
        total = res.sum()
        return res / total if total > _EPS else target_probs

    def point_residual(self, target_probs: np.ndarray, token: int) -> np.ndarray:
        """`residual` for a point-mass proposal on `token`: target_probs without it, renormalised."""
        res = target_probs.copy()
        res[token] = 0.0
        total = res.sum()
        return res / total if total > _EPS else target_probs

    def run(
        self, kids: list[int], row: RowTree, target_probs: np.ndarray, draft_probs: np.ndarray | None, uniforms: Uniforms
    ) -> tuple[int | None, np.ndarray]:
        """kids: the node's children; target_probs: [V] float64 target distribution at the node;
        draft_probs: [V] float64 draft distribution over its children (needed when a child is
        sampled). Returns (the accepted child or None, the distribution left after the rejected
        children: the residual the bonus token is drawn from on rejection)."""
        removed: list[int] = []  # tokens of earlier sampled siblings (drawn without replacement)
        for kid in kids:
            tok = row.tokens[kid]
            if row.sampled[kid]:
                if draft_probs is None:
                    raise ValueError("a sampled tree node needs its parent's draft distribution (TokenTree.draft_logprobs)")
                proposal = self.proposal(draft_probs, removed)
                removed.append(tok)
                ratio = target_probs[tok] / max(proposal[tok], _EPS)
                if uniforms.next() < ratio:
                    return kid, target_probs
                target_probs = self.residual(target_probs, proposal)
            else:
                if uniforms.next() < target_probs[tok]:
                    return kid, target_probs
                target_probs = self.point_residual(target_probs, tok)
        return None, target_probs


EXACT = SiblingTests()
"""the lossless tests"""

RelaxHook = Callable[[int, list[int]], tuple[int | None, bool]]
"""relax(node, children) -> (child accepted outright or None, fell_back)"""


@dataclass
class RowWalk:
    """One row's outcome of the rejection walk."""

    path: list[int]
    """accepted nodes, root excluded"""
    bonus: int
    relaxed: int = 0
    fallbacks: int = 0


def rejection_walk(
    row: RowTree,
    target_probs: np.ndarray,
    draft_probs: np.ndarray | None,
    uniforms: Uniforms,
    relax: RelaxHook | None = None,
    tests: SiblingTests = EXACT,
) -> RowWalk:
    """Walk one row's tree with recursive rejection sampling.

    target_probs: [N, V] float32 target distribution at each node of this row (host).
    draft_probs:  [N, V] float32 draft distribution over each node's children (rows of nodes
                  with sampled children are read) or None.
    relax: optional hook (node, children) -> (child | None, fell_back) that may accept a child
           outright before the exact tests (MARS). When it does, the exact tests are still run
           once at that node, only to count the token as *relaxed* when they would not have
           accepted that same child (the strict rule's counterfactual); their outcome never
           changes the path.
    """
    node, walk = 0, RowWalk(path=[], bonus=-1)
    while True:
        kids = row.children[node]
        probs = target_probs[node].astype(np.float64)
        node_draft = None if draft_probs is None or not kids else draft_probs[node].astype(np.float64)
        if relax is not None and kids:
            chosen, fell_back = relax(node, kids)
            walk.fallbacks += int(fell_back)
            if chosen is not None:
                strict_choice, _ = tests.run(kids, row, probs, node_draft, uniforms)
                walk.relaxed += int(strict_choice != chosen)
                walk.path.append(chosen)
                node = chosen
                continue
        accepted_child, probs = tests.run(kids, row, probs, node_draft, uniforms)
        if accepted_child is None:
            walk.bonus = sample_index(probs, uniforms.next())
            return walk
        walk.path.append(accepted_child)
        node = accepted_child


@dataclass
class HostBatch:
    """What the walk reads of a batch, one host read each."""

    rows: list[RowTree]
    target_probs: np.ndarray
    """[B, N, V] float32"""
    draft_probs: np.ndarray | None
    """[B, N, V] float32, or None when no node is sampled"""
    uniforms: np.ndarray
    """[B, N] float32 in [0, 1): N - 1 tests at most and one bonus draw per row"""

    @classmethod
    def read(cls, tree: TokenTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> HostBatch:
        target_probs = logits_to_logprobs(target_logits, params).exp()  # [B, N, V]
        b, n = tree.tokens.shape
        uniforms = torch.rand(b, n, generator=generator, device=target_logits.device)
        draft = None if tree.draft_logprobs is None else tree.draft_logprobs.exp().cpu().numpy()
        return cls(rows=RowTree.read(tree), target_probs=target_probs.cpu().numpy(), draft_probs=draft, uniforms=uniforms.cpu().numpy())

    def walk(self, row: int, relax: RelaxHook | None = None, tests: SiblingTests = EXACT) -> RowWalk:
        draft = None if self.draft_probs is None else self.draft_probs[row]
        return rejection_walk(self.rows[row], self.target_probs[row], draft, Uniforms(self.uniforms[row]), relax, tests)


def verdict_of(walks: list[RowWalk], device: torch.device) -> Verdict:
    return Verdict.from_lists([w.path for w in walks], [w.bonus for w in walks], [w.relaxed for w in walks], [w.fallbacks for w in walks], device)


class SamplingRule:
    """Lossless speculative sampling (see the module docstring).

    tests: the per-node tests (`EXACT`; the distribution tests pass deliberately wrong ones).
    """

    name = "sampling"

    def __init__(self, tests: SiblingTests = EXACT) -> None:
        self.tests = tests

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Verdict:
        if params.greedy:
            from specdec.verification.greedy import GreedyRule

            return GreedyRule().verify(tree, target_logits, params, generator)
        host = HostBatch.read(tree, target_logits, params, generator)
        return verdict_of([host.walk(row, tests=self.tests) for row in range(tree.batch_size)], target_logits.device)
