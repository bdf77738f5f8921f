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
A chain (`TokenTree.chain`: one child per node) needs no walk: `ChainTests` runs the same
tests for every position and row at once on the device (Leviathan et al.'s rule), with no
host read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specdec import constants
from specdec.hostwork import read_together
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
    def from_host(cls, tokens: np.ndarray, parents: np.ndarray, sampled: np.ndarray) -> list[RowTree]:
        """Every row of a tree from host arrays [B, N]: tokens, parents (-1 for the root and
        padding), sampled."""
        n = tokens.shape[1]
        rows = []
        for row_tokens, row_parents, row_sampled in zip(tokens.tolist(), parents.tolist(), sampled.tolist(), strict=True):
            children: list[list[int]] = [[] for _ in range(n)]
            for node, parent in enumerate(row_parents):
                if parent >= 0:
                    children[parent].append(node)  # BFS order: nodes in increasing index = tree order
            rows.append(cls(tokens=row_tokens, sampled=[bool(s) for s in row_sampled], children=children))
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
        """Everything the walk reads, in one transfer (`read_together`)."""
        target_probs = logits_to_logprobs(target_logits, params).exp()  # [B, N, V]
        b, n = tree.tokens.shape
        uniforms = torch.rand(b, n, generator=generator, device=target_logits.device)  # [B, N]
        parents = tree.parents.masked_fill(~tree.valid, -1)  # [B, N]
        if tree.draft_logprobs is None:
            tokens, parents_h, sampled, target_h, uniforms_h = read_together(tree.tokens, parents, tree.sampled, target_probs, uniforms)
            draft_h = None
        else:
            tokens, parents_h, sampled, target_h, uniforms_h, draft_h = read_together(
                tree.tokens, parents, tree.sampled, target_probs, uniforms, tree.draft_logprobs.exp()
            )
        return cls(rows=RowTree.from_host(tokens, parents_h, sampled), target_probs=target_h, draft_probs=draft_h, uniforms=uniforms_h)

    def walk(self, row: int, relax: RelaxHook | None = None, tests: SiblingTests = EXACT) -> RowWalk:
        draft = None if self.draft_probs is None else self.draft_probs[row]
        return rejection_walk(self.rows[row], self.target_probs[row], draft, Uniforms(self.uniforms[row]), relax, tests)


def verdict_of(walks: list[RowWalk], device: torch.device) -> Verdict:
    return Verdict.from_lists([w.path for w in walks], [w.bonus for w in walks], [w.relaxed for w in walks], [w.fallbacks for w in walks], device)


class ChainTests:
    """The exact tests of a chain, every position and row at once, on the device (no host read).

    Node i (i = 1..K) is the only child of node i - 1; it is accepted with probability
    min(1, p_i / q_i), p_i the target's probability of its token at node i - 1 and q_i its
    proposal's (the draft's for a sampled node, 1 for a deterministic one). The accepted
    length a is the number of leading accepts; the bonus token is drawn at node a from the
    residual of the rejected node a + 1 (`residual`), or from the target distribution when the
    chain ended there. The same maths as `SiblingTests` with one child per node.
    """

    def residual(self, target_probs: torch.Tensor, draft_probs: torch.Tensor | None, token: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """[B, V] the distribution left at a node after its child (token [B], drawn from
        draft_probs [B, V] where `sampled` [B], else a point mass) was rejected:
        norm(max(0, target - proposal)), unnormalised; target_probs where nothing is left."""
        point = target_probs.scatter(1, token[:, None], 0.0)  # a point-mass proposal: the token removed
        res = point if draft_probs is None else torch.where(sampled[:, None], (target_probs - draft_probs).clamp_(min=0.0), point)
        return torch.where(res.sum(dim=1, keepdim=True) > _EPS, res, target_probs)

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Verdict:
        b, n = tree.tokens.shape
        k = n - 1
        target_probs = logits_to_logprobs(target_logits, params).exp()  # [B, N, V]
        draft_probs = None if tree.draft_logprobs is None else tree.draft_logprobs.exp()  # [B, N, V]
        child = tree.tokens[:, 1:]  # [B, K] node i's token, child of node i - 1
        p = target_probs[:, :k].gather(2, child[:, :, None]).squeeze(2)  # [B, K]
        q = None
        if draft_probs is not None:
            q = draft_probs[:, :k].gather(2, child[:, :, None]).squeeze(2).masked_fill_(~tree.sampled[:, 1:], 1.0)  # [B, K]
        u = torch.rand(b, k, generator=generator, device=p.device)
        accept = (u * q < p) if q is not None else (u < p)  # u < p / q without dividing by a tiny q
        accepted_len = accept.logical_and_(tree.valid[:, 1:]).cumprod(dim=1).sum(dim=1)  # [B] leading accepts
        cols = constants.arange(n, p.device)[1:]  # [K] node indices 1..K
        path = torch.where(cols[None, :] <= accepted_len[:, None], cols[None, :], 0)  # [B, K], padding 0
        at = accepted_len[:, None]  # [B, 1] the node the bonus is drawn at
        probs = target_probs.gather(1, at[:, :, None].expand(b, 1, target_probs.shape[2])).squeeze(1)  # [B, V]
        nxt = (at + 1).clamp_(max=k)  # [B, 1] its child (when the chain goes on)
        rejected = (accepted_len < k) & tree.valid.gather(1, nxt).squeeze(1)  # [B] a child was tested and rejected
        drafts = None if draft_probs is None else draft_probs.gather(1, at[:, :, None].expand_as(probs[:, None, :])).squeeze(1)
        residual = self.residual(probs, drafts, tree.tokens.gather(1, nxt).squeeze(1), tree.sampled.gather(1, nxt).squeeze(1))
        probs = torch.where(rejected[:, None], residual, probs)
        bonus = (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=1)  # a draw from probs (exponential race)
        zeros = constants.full((b,), 0, torch.long, p.device)
        return Verdict(path=path, accepted_len=accepted_len, bonus_tokens=bonus, relaxed_count=zeros, fallback_count=zeros)


EXACT_CHAIN = ChainTests()
"""the lossless chain tests"""


class SamplingRule:
    """Lossless speculative sampling (see the module docstring).

    tests: the per-node tests of the host walk (`EXACT`); chain_tests: those of chains on the
    device (`EXACT_CHAIN`). The distribution tests pass deliberately wrong ones.
    """

    name = "sampling"

    def __init__(self, tests: SiblingTests = EXACT, chain_tests: ChainTests = EXACT_CHAIN) -> None:
        self.tests = tests
        self.chain_tests = chain_tests

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Verdict:
        if params.greedy:
            from specdec.verification.greedy import GreedyRule

            return GreedyRule().verify(tree, target_logits, params, generator)
        if tree.chain and tree.num_nodes > 1 and type(self.tests) is SiblingTests:  # (a deliberately wrong walk keeps the walk)
            return self.chain_tests.verify(tree, target_logits, params, generator)
        host = HostBatch.read(tree, target_logits, params, generator)
        return verdict_of([host.walk(row, tests=self.tests) for row in range(tree.batch_size)], target_logits.device)
