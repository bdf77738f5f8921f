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

Where the tests run (`SamplingRule(walk=...)`):

- **on the device** (the default on accelerators): for all nodes and rows at once, tensor ops
  only, nothing copied to the host. Child by child (`TreeTests`, `segments="token"`): every
  node's tests are prepared one sibling rank at a time (a child's test only depends on its
  earlier siblings having been rejected, never on the outcome elsewhere), and the accepted path
  is the deepest one of first accepted children, with no host read. The default is traversal
  (`TraversalTreeTests`, below), which reads the widths of its rounds on the host (a copy started
  before the verify forward, `hostwork.HostCopy`: waiting for it waits for the drafting work only);
- **on the host** (`rejection_walk`; the default on the CPU, where the walk only touches the
  nodes it visits while the device version works on every node): each row's tree fields, target
  and draft distributions and pre-drawn uniforms (one per test and one for the bonus, `[B, N]`
  in one draw) are read once. On an accelerator that read is the whole `[B, N, V]` target and
  draft distributions, 2 x 4 x B x N x V bytes a step (34 MB at B = 1 for a 33-node tree and a
  128k vocabulary).

Both can run the same tests with different uniforms, so a seed gives different (equally
distributed) outputs on the two. The host walk's default tests are not these child-by-child ones
but traversal verification (`TraversalTests`, `SamplingRule(segments=...)`): the whole tree from
the leaves up, each node against its path's joint mass, which accepts more on the same trees;
the device's default is its tensor form (`TraversalTreeTests`), and `segments="token"` keeps
these child-by-child tests there. A chain (`TokenTree.chain`: one child per node) needs no walk:
it is verified for every position and row at once on the device, with no host read, by block
verification (`BlockChainTests`, Sun et al. 2025: the default), which keeps a longer prefix
whenever the chain's joint mass allows, or token by token (`ChainTests`, Leviathan et al.'s rule,
the same tests as above with one child per node; `SamplingRule(chains="token")`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdec import constants
from specdec.errors import SpecDecError
from specdec.hostwork import HostCopy, read_together
from specdec.sampling import SamplingParams, logits_to_logprobs, sample_from_probs
from specdec.tree import TokenTree
from specdec.verification.base import Verdict, deepest_path

if TYPE_CHECKING:
    from specdec.verification.captured import CapturedWalks

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
"""the lossless tests, child by child"""


@dataclass
class WalkStep:
    """What `BlockSiblingTests.run_segments` decided at one node."""

    accepted: list[int]
    """nodes accepted below the node, in path order (empty: every child rejected)"""
    probs: np.ndarray | None
    """[V] the bonus token's distribution when the walk stops here; None when it goes on"""


class BlockSiblingTests(SiblingTests):
    """The host walk's tests with chain segments verified as a block (`SamplingRule(segments="block")`).

    At a node, children are tried in tree order as in `SiblingTests`. A child that starts a
    *chain segment* (the child, its only child, that one's only child, ..., down to a leaf or a
    node with several children) is tested together with its segment by block verification
    (`BlockChainTests`' maths, Sun et al. 2025): the node's current target distribution (its
    residual after earlier siblings) and the child's proposal take the place of the chain's first
    position. The accepted prefix ends at the last segment node whose threshold test passes:

    - the whole segment: the walk goes on at its last node (its children, or the bonus there);
    - part of it: the bonus is drawn from the weighted residual at the prefix's end;
    - none: the child is rejected and the node's target becomes the residual max(0, P - Q)
      normalised, exactly as child by child; the next sibling is tried.

    Why it stays exact: block verification outputs the segment's first-position target followed
    by the target's own continuation, given only that the segment's tokens follow their
    proposals; "goes on at the last node" and "next sibling" replace a bonus draw from that
    node's target or residual by an exact sampler of it (the walk below, or the remaining
    siblings' tests, which depend on the rejected child only through its removed token). A
    one-node segment is the child-by-child test. `weighted_residual` is where the maths lives.
    """

    def weighted_residual(self, target_probs: np.ndarray, weight: float, proposal: np.ndarray | None, token: int) -> np.ndarray:
        """[V] max(0, weight x target_probs - proposal), unnormalised; proposal None: a point mass
        on `token` (max(0, w P(x) - 1) = 0 there)."""
        if proposal is None:
            res = weight * target_probs
            res[token] = 0.0
            return res
        return np.maximum(weight * target_probs - proposal, 0.0)

    def segment(self, row: RowTree, kid: int) -> list[int]:
        """The chain segment that starts at `kid`: it, then each node's only child while there is one."""
        seg = [kid]
        while len(row.children[seg[-1]]) == 1:
            seg.append(row.children[seg[-1]][0])
        return seg

    def run_segments(
        self,
        kids: list[int],
        row: RowTree,
        target_probs: np.ndarray,
        draft_probs: np.ndarray | None,
        uniforms: Uniforms,
        all_target: np.ndarray,
        all_draft: np.ndarray | None,
    ) -> WalkStep:
        """kids, target_probs, draft_probs: as `run`; all_target, all_draft: [N, V] the row's
        target and draft distributions at every node (the segments' inner nodes)."""
        removed: list[int] = []
        for kid in kids:
            tok = row.tokens[kid]
            proposal = None
            if row.sampled[kid]:
                if draft_probs is None:
                    raise ValueError("a sampled tree node needs its parent's draft distribution (TokenTree.draft_logprobs)")
                proposal = self.proposal(draft_probs, removed)
                removed.append(tok)
            seg = self.segment(row, kid)
            tau, left = self._block(seg, row, target_probs, proposal, all_target, all_draft, uniforms)
            if left is None:  # the whole segment
                return WalkStep(seg, None)
            if tau > 0:
                return WalkStep(seg[:tau], left)
            target_probs = left
        return WalkStep([], target_probs)

    def _block(
        self,
        seg: list[int],
        row: RowTree,
        first_target: np.ndarray,
        first_proposal: np.ndarray | None,
        all_target: np.ndarray,
        all_draft: np.ndarray | None,
        uniforms: Uniforms,
    ) -> tuple[int, np.ndarray | None]:
        """Block verification of `seg` under a node with target first_target and proposal
        first_proposal for seg[0] (None: a point mass). Returns tau (segment nodes accepted) and,
        when tau < len(seg), the normalised residual at the prefix's end (the node's target where
        nothing is left); None when the whole segment is accepted (the walk goes on there).

        R_0, the residual at the segment's parent, enters no threshold: it is computed only when
        the segment is rejected whole, so a one-node segment costs what the child-by-child test
        costs (a residual on rejection only)."""
        g = len(seg)
        target, proposal, weight = first_target, first_proposal, 1.0
        residuals: list[np.ndarray | None] = [None]  # R_0 .. R_{g-1}: at the parent of seg[i], weight w_i (R_0 on demand)
        targets: list[np.ndarray] = []
        thresholds: list[float] = []  # h_1 .. h_g
        for i, node in enumerate(seg):
            tok = row.tokens[node]
            targets.append(target)
            if i > 0:  # h_i = r_i / (r_i + 1 - w_i) at seg[i - 1]
                res = self.weighted_residual(target, weight, proposal, tok)
                residuals.append(res)
                mass = float(res.sum())
                denominator = mass + 1.0 - weight
                thresholds.append(mass / denominator if denominator > _EPS else 1.0)
            q = 1.0 if proposal is None else float(proposal[tok])
            weight = min(1.0, weight * float(target[tok]) / max(q, _EPS))
            if i + 1 < g:
                child = seg[i + 1]
                target = all_target[node].astype(np.float64)
                proposal = None
                if row.sampled[child]:
                    if all_draft is None:
                        raise ValueError("a sampled tree node needs its parent's draft distribution (TokenTree.draft_logprobs)")
                    proposal = all_draft[node].astype(np.float64)
                    proposal = proposal / max(proposal.sum(), _EPS)
        thresholds.append(weight)  # h_g = w_g
        tau = 0
        for i, h in enumerate(thresholds, start=1):
            if uniforms.next() < h:
                tau = i
        if tau == g:
            return tau, None
        res = residuals[tau]
        if res is None:  # R_0 (weight w_0 = 1)
            res = self.weighted_residual(first_target, 1.0, first_proposal, row.tokens[seg[0]])
        total = res.sum()
        return tau, res / total if total > _EPS else targets[tau]


EXACT_BLOCKS = BlockSiblingTests()
"""the lossless host-walk tests with chain segments verified as blocks (`segments="block"`)"""


class TraversalTests(BlockSiblingTests):
    """Traversal verification (Weng et al., "Traversal Verification for Speculative Tree
    Decoding", NeurIPS 2025) on the host walk (`SamplingRule(segments="traversal")`): the whole
    tree is tested from the leaves up, each node against the joint mass of its path.

    Every node carries a weight w (block verification's, `BlockChainTests`): the root 1, a child
    min(1, w P(x) / Q(x)) from its parent's current state (w, P, Q): P the parent's target (its
    residual after earlier children), Q the child's proposal (the draft without earlier drawn
    siblings, or a point mass). Nodes are visited in post-order, children in tree order: a node
    is tested only after all its children's subtrees were rejected. Each rejected child updates
    its parent's state as block verification does at a rejected position:

        R = max(0, w P - Q),  w <- sum R / (sum R + 1 - w),  P <- R / sum R

    (and Q loses the drawn token), so the next sibling's weight and the parent's own test read
    the updated state. A node is then accepted with probability w (the root always: its w stays
    1); the path to it is accepted and the bonus is drawn from its P (a leaf's own target, else
    the residual its children left). The first acceptance in post-order ends the walk.

    On a chain it is block verification (Sun et al. 2025: optimal for one chain); with weights 1
    at every branching node and no chain segments it is recursive rejection sampling. It differs
    from `BlockSiblingTests` in carrying a node's weight into its children below a branching
    node (where blocks restart at 1) and in testing a node whose children were all rejected
    against its own path mass instead of stopping there. Exact by the same argument as block
    verification's, node by node: checked by enumerating every drawn tree of small vocabularies
    (`tests/test_block_verification.py`). At most one uniform per non-root node and one for
    the bonus (N per row).
    """

    def walk(self, row: RowTree, all_target: np.ndarray, all_draft: np.ndarray | None, uniforms: Uniforms) -> RowWalk:
        """all_target, all_draft: [N, V] the row's target and draft distributions at every node."""
        found = self._visit(0, 1.0, row, all_target, all_draft, uniforms)
        assert found is not None  # the root's weight stays 1: it is always accepted
        path, probs = found
        return RowWalk(path=path, bonus=sample_index(probs, uniforms.next()))

    def _visit(
        self, node: int, weight: float, row: RowTree, all_target: np.ndarray, all_draft: np.ndarray | None, uniforms: Uniforms
    ) -> tuple[list[int], np.ndarray] | None:
        """Test `node`'s subtree (its children's subtrees in order, then the node itself) with the
        node's weight. Returns (the accepted nodes below `node`, the bonus distribution) when the
        node is accepted, None when its whole subtree is rejected."""
        target = all_target[node]  # [V] the node's target, float32 until a rejection leaves a float64 residual
        left, left_mass = None, 1.0  # [V] the draft without earlier drawn children (unnormalised), its mass
        for kid in row.children[node]:
            tok, sampled = row.tokens[kid], row.sampled[kid]
            q = 1.0  # the child's proposal probability: a point mass, or the draft without earlier draws
            if sampled:
                if left is None:
                    if all_draft is None:
                        raise ValueError("a sampled tree node needs its parent's draft distribution (TokenTree.draft_logprobs)")
                    left = all_draft[node].astype(np.float64)
                    left_mass = float(left.sum())
                q = float(left[tok]) / max(left_mass, _EPS)
            found = self._visit(kid, min(1.0, weight * float(target[tok]) / max(q, _EPS)), row, all_target, all_draft, uniforms)
            if found is not None:
                return [kid, *found[0]], found[1]
            # [V] vectors only on a rejection: a leaf's own visit reads two scalars
            proposal = None if left is None or not sampled else left / max(left_mass, _EPS)
            res = self.weighted_residual(np.asarray(target, dtype=np.float64), weight, proposal, tok)
            mass = float(res.sum())
            denominator = mass + 1.0 - weight
            weight = mass / denominator if denominator > _EPS else 1.0
            if mass > _EPS:
                target = res / mass
            if sampled and left is not None:
                left[tok] = 0.0
                left_mass = float(left.sum())
        if node == 0 or self.accepts(weight, uniforms):
            return [], np.asarray(target, dtype=np.float64)
        return None

    def accepts(self, weight: float, uniforms: Uniforms) -> bool:
        """One test that passes with probability `weight` (the exact-enumeration test scripts it)."""
        return uniforms.next() < weight


TRAVERSAL = TraversalTests()
"""the lossless host-walk tests of a whole tree from the leaves up (`segments="traversal"`)"""

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
    """Walk one row's tree with recursive rejection sampling (with `BlockSiblingTests`, the
    default, each child's chain segment is tested as one block).

    target_probs: [N, V] float32 target distribution at each node of this row (host).
    draft_probs:  [N, V] float32 draft distribution over each node's children (rows of nodes
                  with sampled children are read) or None.
    relax: optional hook (node, children) -> (child | None, fell_back) that may accept a child
           outright before the exact tests (MARS). When it does, the exact tests are still run
           once at that node, only to count the token as *relaxed* when they would not have
           accepted that same child (the strict rule's counterfactual); their outcome never
           changes the path.
    """
    if isinstance(tests, TraversalTests) and relax is None:
        return tests.walk(row, target_probs, draft_probs, uniforms)
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
        if isinstance(tests, BlockSiblingTests) and kids:
            step = tests.run_segments(kids, row, probs, node_draft, uniforms, target_probs, draft_probs)
            walk.path.extend(step.accepted)
            if step.probs is not None or not step.accepted:
                walk.bonus = sample_index(step.probs if step.probs is not None else probs, uniforms.next())
                return walk
            node = step.accepted[-1]
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


def weighted_residual(target_probs: torch.Tensor, weight: torch.Tensor, draft_probs: torch.Tensor | None, token: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """[B, M, V] max(0, weight P - Q), unnormalised: block verification's residual at a node whose
    prefix has weight [B, M]. target_probs P [B, M, V]; Q the proposal of each node's child (token
    [B, M]): draft_probs [B, M, V] where `sampled` [B, M], else a point mass on the token (whose
    entry is then max(0, w P(x) - 1) = 0)."""
    weighted = target_probs * weight[:, :, None]
    point = weighted.scatter(2, token[:, :, None], 0.0)
    if draft_probs is None:
        return point
    return torch.where(sampled[:, :, None], (weighted - draft_probs).clamp_(min=0.0), point)


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
        bonus = sample_from_probs(probs, generator)  # a draw from probs (exponential race)
        zeros = constants.full((b,), 0, torch.long, p.device)
        return Verdict(path=path, accepted_len=accepted_len, bonus_tokens=bonus, relaxed_count=zeros, fallback_count=zeros)


TOKEN_CHAIN = ChainTests()
"""the lossless chain tests, token by token (Leviathan et al.)"""


class BlockChainTests(ChainTests):
    """Block verification of a chain (Sun et al., "Block Verification Accelerates Speculative
    Decoding", ICLR 2025, Algorithm 2), every position and row at once, on the device (no host
    read). Lossless like the token-by-token tests, never accepting fewer tokens in expectation
    and optimal among verifiers that see only the chain's conditionals.

    With p_i, q_i the target's and the proposal's probabilities of node i's token at node i - 1
    (q_i = 1 for a deterministic node), P_i, Q_i the target's and the proposal's distributions
    at node i over its child (the proposal: the draft's distribution for a sampled child, a point
    mass on the token for a deterministic one), and gamma the row's drafted nodes:

    - weights w_0 = 1, w_i = min(1, w_{i-1} p_i / q_i): the share of the path's target mass the
      draft has not yet over-proposed;
    - R_i = max(0, w_i P_i - Q_i) (unnormalised), r_i = sum(R_i);
    - h_i = r_i / (r_i + 1 - w_i) for i < gamma, h_gamma = w_gamma;
    - tau = the largest i in 1..gamma with eta_i <= h_i (eta_i independent uniforms), else 0:
      nodes 1..tau are accepted;
    - the bonus is drawn from P_tau when tau = gamma, else from R_tau normalised.

    Where token-by-token tests stop at the first rejection, this keeps a longer prefix whenever
    its joint mass allows, and the residual at tau accounts for what the accepted prefix already
    took. With gamma = 1 it is exactly the token-by-token rule. The weights come from one cumsum
    and one cummax: log w_i = s_i - max(0, max_{j <= i} s_j), s_i = sum_{l <= i} log(p_l / q_l).
    `weighted_residual` is where the maths lives (the distribution tests break it).
    """

    def weighted_residual(self, target_probs: torch.Tensor, weight: torch.Tensor, draft_probs: torch.Tensor | None, token: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """`weighted_residual` (the distribution tests override this method to break it)."""
        return weighted_residual(target_probs, weight, draft_probs, token, sampled)

    def thresholds(self, tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's tests, before any draw. target_probs, draft_probs: [B, N, V] each node's
        target and draft distribution over its child (draft_probs None: no node is sampled).

        Returns h [B, K] (node i is the accepted prefix's end when eta_i <= h_i and no later node's
        test passes; 0 past the row's last drafted node), gamma [B] (drafted nodes per row) and
        the unnormalised residuals R [B, K, V] at nodes 0..K-1 (the bonus's distribution when the
        prefix ends there before gamma)."""
        b, n = tree.tokens.shape
        k = n - 1
        child = tree.tokens[:, 1:]  # [B, K] node i's token, child of node i - 1
        sampled = tree.sampled[:, 1:] if draft_probs is not None else torch.zeros_like(child, dtype=torch.bool)  # [B, K]
        drafted = tree.valid[:, 1:]  # [B, K], leading: a chain's invalid nodes end it
        gamma = drafted.sum(dim=1)  # [B]
        log_ratio = target_probs[:, :k].gather(2, child[:, :, None]).squeeze(2).log()  # [B, K]: log p_i (-inf where p_i = 0)
        if draft_probs is not None:
            q = draft_probs[:, :k].gather(2, child[:, :, None]).squeeze(2).clamp_(min=_EPS)
            log_ratio = log_ratio - torch.where(sampled, q.log(), 0.0)  # log(p_i / q_i)
        cum = log_ratio.masked_fill_(~drafted, 0.0).cumsum(dim=1)  # [B, K] s_i
        weight = (cum - cum.cummax(dim=1).values.clamp_(min=0.0)).exp()  # [B, K] w_1..w_K
        weights = torch.nn.functional.pad(weight, (1, 0), value=1.0)  # [B, N] w_0 = 1 .. w_K
        # R_i at nodes 0..K-1 (each has a child that may be rejected); node K never needs one
        residual = self.weighted_residual(target_probs[:, :k], weights[:, :k], None if draft_probs is None else draft_probs[:, :k], child, sampled)  # [B, K, V]
        mass = residual.sum(dim=2)  # [B, K] r_0..r_{K-1}
        denominator = mass[:, 1:] + 1.0 - weight[:, : k - 1]  # [B, K - 1] for nodes 1..K-1
        h_inner = torch.where(denominator > _EPS, mass[:, 1:] / denominator.clamp(min=_EPS), 1.0)  # r = 0 and w = 1: P equals Q there
        h = torch.cat([h_inner, weight[:, k - 1 :]], dim=1)  # [B, K] (node K: w_K; each row's last node: below)
        cols = constants.arange(n, target_probs.device)[1:]  # [K] node indices 1..K
        h = torch.where(cols[None, :] == gamma[:, None], weight, h).masked_fill_(cols[None, :] > gamma[:, None], 0.0)
        return h, gamma, residual

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Verdict:
        b, n = tree.tokens.shape
        k = n - 1
        dev = target_logits.device
        target_probs = logits_to_logprobs(target_logits, params).exp()  # [B, N, V]
        draft_probs = None if tree.draft_logprobs is None else tree.draft_logprobs.exp()  # [B, N, V]
        h, gamma, residual = self.thresholds(tree, target_probs, draft_probs)
        cols = constants.arange(n, dev)[1:]  # [K] node indices 1..K
        eta = torch.rand(b, k, generator=generator, device=dev)
        accepted_len = ((eta < h) * cols[None, :]).amax(dim=1)  # [B] tau: the last node whose test passes (h = 0 past gamma)
        path = torch.where(cols[None, :] <= accepted_len[:, None], cols[None, :], 0)  # [B, K], padding 0
        at = accepted_len[:, None]  # [B, 1]
        probs = target_probs.gather(1, at[:, :, None].expand(b, 1, target_probs.shape[2])).squeeze(1)  # [B, V] P_tau
        res = residual.gather(1, at.clamp(max=k - 1)[:, :, None].expand(b, 1, residual.shape[2])).squeeze(1)  # [B, V] R_tau
        use_residual = (accepted_len < gamma).logical_and_(res.sum(dim=1) > _EPS)  # [B]
        probs = torch.where(use_residual[:, None], res, probs)
        bonus = sample_from_probs(probs, generator)  # a draw from probs (exponential race)
        zeros = constants.full((b,), 0, torch.long, dev)
        return Verdict(path=path, accepted_len=accepted_len, bonus_tokens=bonus, relaxed_count=zeros, fallback_count=zeros)


BLOCK_CHAIN = BlockChainTests()
"""the lossless chain tests, the block at once (Sun et al.): the default"""

CHAIN_RULES = ("block", "token")
"""how `SamplingRule` verifies chains: 'block' (`BlockChainTests`) or 'token' (`ChainTests`)"""

SEGMENT_RULES = ("auto", "block", "token", "traversal")
"""how `SamplingRule` verifies branching trees: 'traversal' the whole tree from the leaves up
(`TraversalTests` on the host walk, `TraversalTreeTests` on the device), 'block' chain segments as
blocks (`BlockSiblingTests`, `BlockTreeTests`), 'token' child by child (`SiblingTests`, `TreeTests`),
or 'auto' (the default): traversal on both walks (it accepted 14-17% more than child by child on
EAGLE-2's and DynaTree's trees in paired runs, CPU; on the device it costs EAGLE-2 at T = 1 about
90 more ops a step and one wait on a copy started before the verify forward (counted on the CPU as a
host read until 2026-11-26, when it became a `HostCopy`), GPU time not measured)"""


@dataclass
class ChildTable:
    """Each node's children by sibling rank: [B, N, K] each, K = `TokenTree.children_bound`."""

    nodes: torch.Tensor
    """the child's node index (N where the node has no child of that rank)"""
    tokens: torch.Tensor
    drawn: torch.Tensor
    """bool: drawn from the draft distribution (else a point-mass proposal)"""
    has: torch.Tensor
    """bool: the child exists"""
    ranks: torch.Tensor
    """[B, N] each node's own sibling rank (`TokenTree.sibling_ranks`: -1 at the root and padding)"""

    @property
    def k(self) -> int:
        return self.nodes.shape[2]

    @classmethod
    def of(cls, tree: TokenTree) -> ChildTable:
        b, n = tree.tokens.shape
        dev = tree.tokens.device
        ranks = tree.sibling_ranks()  # [B, N]
        k = tree.children_bound(ranks)
        slot = torch.where(ranks >= 0, tree.parents.clamp(min=0) * k + ranks.clamp(max=max(k - 1, 0)), n * k)  # [B, N]
        kids = torch.full((b, n * k + 1), n, dtype=torch.long, device=dev).scatter_(1, slot, constants.arange(n, dev).expand(b, n))[:, : n * k]
        fields = torch.stack([tree.tokens, tree.sampled & tree.valid], dim=1)  # [B, 2, N] int64
        fields = torch.nn.functional.pad(fields, (0, 1)).gather(2, kids[:, None, :].expand(b, 2, n * k)).view(b, 2, n, k)
        nodes = kids.view(b, n, k)
        return cls(nodes=nodes, tokens=fields[:, 0], drawn=fields[:, 1].bool(), has=nodes < n, ranks=ranks)


class TreeTests:
    """The exact tests of whole trees, every node and row at once, on the device (no host read).

    The same maths as `SiblingTests`, arranged for tensors: a node's children are tested in tree
    order, and child i is only tested if children 0..i-1 were rejected, so the state it is tested
    against (the node's target residual after those rejections, the draft distribution without
    the earlier sampled siblings) does not depend on any random outcome. Loop over sibling ranks
    i = 0..K-1 (K = `TokenTree.children_bound`), for every node at once: test its i-th child
    (uniform: one per child node), then update the node's residual as if that child was
    rejected. A child is *chosen* when it passes and no earlier sibling did; the accepted path is
    the deepest node whose every ancestor was chosen (`deepest_path`), and the bonus token is
    drawn from that node's residual after all its children (all rejected, or none: a leaf).

    Cost: K rounds (EAGLE-2's default top-k of 8: 8; DynaTree's b_max of 3: 3) of about 30 ops,
    seven of them over [B, N, V]. `residual` and `remove_drawn` are where the maths lives (the
    distribution tests replace them with wrong versions).
    """

    def proposal_mass(self, draft_left: torch.Tensor) -> torch.Tensor:
        """[B, N] the mass left in each node's draft distribution `draft_left` [B, N, V] after its
        earlier sampled children were removed: what a sampled child's proposal is normalised by."""
        return draft_left.sum(dim=2).clamp_(min=_EPS)

    def residual(self, target: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
        """[B, N, V] max(0, target - proposal), unnormalised (`_advance` normalises it and keeps
        `target` where nothing is left)."""
        return (target - proposal).clamp_(min=0.0)

    def verify(
        self,
        tree: TokenTree,
        target_logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        outright: torch.Tensor | None = None,
        fallback: torch.Tensor | None = None,
    ) -> Verdict:
        """outright: [B, N] int64, a child each node accepts without a test (a relaxed rule: MARS),
        n where none; the exact tests still run at such a node, only to count the child in
        `relaxed_count` when they would not have accepted it (the strict rule's counterfactual).
        fallback: [B, N] bool, nodes a relaxed rule verified strictly: counted in `fallback_count`
        where they are on the walk (the accepted path and its last node) and have children."""
        table = ChildTable.of(tree)
        uniform, race = self.draws(tree, table.k, target_logits.shape[-1], generator)
        return Verdict(*self.tests(tree, table, target_logits, params, uniform, race, outright, fallback))

    @staticmethod
    def draws(
        tree: TokenTree, k: int, vocab: int, generator: torch.Generator | None, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tests' random numbers, drawn from `generator` before them (so a captured run reads them
        from buffers): one U(0, 1) per test [B, N * k] (k: `ChildTable.k` child by child, 1 for
        traversal, whose tests are the nodes' own), then the bonus draw's [B, V] (its exponential
        race, `sample_from_probs`). out: buffers to draw into."""
        b, n = tree.tokens.shape
        dev = tree.tokens.device
        if out is None:
            return torch.rand(b, n * k, generator=generator, device=dev), torch.rand(b, vocab, generator=generator, device=dev)
        return torch.rand(b, n * k, generator=generator, device=dev, out=out[0]), torch.rand(b, vocab, generator=generator, device=dev, out=out[1])

    def tests(
        self,
        tree: TokenTree,
        table: ChildTable,
        target_logits: torch.Tensor,
        params: SamplingParams,
        uniform: torch.Tensor,
        race: torch.Tensor,
        outright: torch.Tensor | None = None,
        fallback: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tensor work of `verify`, no host read and no random draw (a graph captures it):
        (path, accepted_len, bonus, relaxed_count, fallback_count), `Verdict`'s fields. uniform
        [B, N * K], race [B, V]: `draws`."""
        b, n = tree.tokens.shape
        dev = target_logits.device
        target = logits_to_logprobs(target_logits, params).exp()  # [B, N, V]: each node's target, then its residual
        draft_left = None if tree.draft_logprobs is None else tree.draft_logprobs.exp()  # [B, N, V] q, earlier sampled children removed
        k, kid_nodes, tokens, drawn, has = table.k, table.nodes, table.tokens, table.drawn, table.has
        point = ~drawn  # [B, N, K]: a point-mass proposal (a deterministic child)
        one, zero = constants.full((), 1.0, target.dtype, dev), constants.full((), 0.0, target.dtype, dev)
        uniform = uniform.view(b, n, k)  # one per test
        chosen = torch.zeros(b, n + 1, dtype=torch.bool, device=dev)  # [B, N + 1] by node (column n: none): its parent's first accepted child
        undecided = torch.ones(b, n, dtype=torch.bool, device=dev)  # [B, N]: no child of this node accepted yet
        for i in range(k):
            x, s, u = tokens[:, :, i], drawn[:, :, i], uniform[:, :, i]  # [B, N] each
            p_x = target.gather(2, x[:, :, None]).squeeze(2)  # [B, N]
            mass = None
            if draft_left is not None:
                mass = self.proposal_mass(draft_left)  # [B, N]
                q_x = torch.where(s, draft_left.gather(2, x[:, :, None]).squeeze(2).div_(mass), one)  # [B, N]: 1 for a point mass
                passes = u * q_x < p_x  # u < p / q without dividing by a tiny q
            else:
                passes = u < p_x  # point masses only
            tested = has[:, :, i] & undecided  # [B, N]: the i-th child exists and no earlier sibling was accepted
            ok = passes.logical_and_(tested)
            chosen.scatter_(1, kid_nodes[:, :, i], ok)  # each child appears once; nodes without an i-th child write column n
            undecided.logical_xor_(ok)  # (ok implies undecided)
            if i < k - 1:  # (the residuals after the last children are only needed at the path's end, below)
                self._advance(target, draft_left, mass, x, s, point[:, :, i], tested.logical_xor_(ok), zero)  # rejected: tested, not ok
        strict = chosen[:, :n]  # [B, N]: the child the exact tests accept at its parent
        ok_nodes = strict.clone()
        relaxed = None
        if outright is not None:  # a parent with an outright choice takes it, whatever the tests said
            forced = torch.zeros(b, n + 1, dtype=torch.bool, device=dev).scatter_(1, outright, True)[:, :n]  # [B, N]
            parent_forces = (outright < n).gather(1, tree.parents.clamp(min=0))  # [B, N]: the node's parent accepts outright
            ok_nodes = torch.where(parent_forces, forced, strict)
            relaxed = forced & ~strict
        ok_nodes[:, 0] = True
        deepest, on_path, path, accepted_len = deepest_path(tree, ok_nodes)
        probs = self.final_residual(target, draft_left, table, deepest, zero)  # [B, V]
        bonus = sample_from_probs(probs, None, uniforms=race)  # a draw from probs (exponential race)
        zeros = constants.full((b,), 0, torch.long, dev)
        relaxed_count = zeros if relaxed is None else (relaxed & on_path).sum(dim=1)
        fallback_count = zeros if fallback is None or k == 0 else (fallback & has[:, :, 0] & on_path).sum(dim=1)
        return path, accepted_len, bonus, relaxed_count, fallback_count

    def final_residual(self, target: torch.Tensor, draft_left: torch.Tensor | None, table: ChildTable, at: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """[B, V] the bonus's distribution at node `at` [B] when every child of it was rejected (or
        it has none): its residual after its last child. target, draft_left: [B, N, V] after the
        sibling rounds, which advance every node's state up to (not past) its child of rank K - 2."""
        b = target.shape[0]
        col = at[:, None]  # [B, 1]
        probs = target.gather(1, col[:, :, None].expand(b, 1, target.shape[2]))  # [B, 1, V]
        if table.k > 0:
            last = table.k - 1
            left = None if draft_left is None else draft_left.gather(1, col[:, :, None].expand_as(probs))
            mass = None if left is None else self.proposal_mass(left)
            x, s = table.tokens[:, :, last].gather(1, col), table.drawn[:, :, last].gather(1, col)
            self._advance(probs, left, mass, x, s, ~s, table.has[:, :, last].gather(1, col), zero)
        return probs[:, 0]

    def _advance(
        self,
        target: torch.Tensor,
        draft_left: torch.Tensor | None,
        mass: torch.Tensor | None,
        x: torch.Tensor,
        drawn: torch.Tensor,
        point: torch.Tensor,
        rejected: torch.Tensor,
        zero: torch.Tensor,
    ) -> None:
        """In place, where `rejected` [B, M]: the node's child with token x [B, M] (drawn from the
        draft where `drawn` [B, M], a point mass where `point`, its negation) was rejected: target
        [B, M, V] becomes the residual (normalised; unchanged where nothing is left) and a drawn
        token leaves draft_left [B, M, V] (whose `proposal_mass` is mass [B, M]). zero: a 0-d
        tensor of target's dtype."""
        x3 = x[:, :, None]
        if draft_left is not None and mass is not None:
            proposal = torch.where(point[:, :, None], zero, draft_left / mass[:, :, None])  # [B, M, V]; a point mass: below
            res = self.residual(target, proposal)
        else:
            res = target.clone()
        # a point-mass proposal: its token removed (the residual is the target without it)
        res.scatter_(2, x3, res.gather(2, x3).masked_fill_(point[:, :, None], 0.0))
        total = res.sum(dim=2, keepdim=True)  # [B, M, 1]
        update = (total > _EPS).logical_and_(rejected[:, :, None])
        torch.where(update, res.div_(total.clamp_(min=_EPS)), target, out=target)
        if draft_left is not None:
            self.remove_drawn(draft_left, x, rejected & drawn)

    def remove_drawn(self, draft_left: torch.Tensor, x: torch.Tensor, drawn: torch.Tensor) -> None:
        """In place: the rejected drawn token x [B, M] leaves its node's draft distribution
        draft_left [B, M, V] where `drawn` [B, M] (siblings are drawn without replacement)."""
        draft_left.scatter_(2, x[:, :, None], draft_left.gather(2, x[:, :, None]).masked_fill_(drawn[:, :, None], 0.0))


EXACT_TREE = TreeTests()
"""the lossless tree tests on the device"""

class BlockTreeTests(TreeTests):
    """The device tests with a tree's chain segments verified as blocks (`SamplingRule(segments="block")`).

    The device counterpart of `BlockSiblingTests`, with the same outcomes in distribution. A
    *tester* is the root or a node with two or more children; each child of a tester starts a
    chain segment (the child, its only child, ..., down to a leaf or the next tester), and every
    non-root node lies on exactly one segment. A segment under tester u, started by u's child of
    rank i, is one block (`BlockChainTests`' maths): its first position's target and proposal are
    u's residual and the child's proposal after u's children of ranks < i were rejected, its
    later positions the segment nodes' own target and draft distributions (a node with one child
    never has a sibling rejected, so those are fixed). Outcomes, as on the host:

    - the whole segment accepted: the path goes on at its last node (a tester or a leaf);
    - a prefix of it: the path stops at the prefix's last node, the bonus drawn from the weighted
      residual max(0, w P - Q) there;
    - none: the child is rejected, u's state becomes the ordinary residual, the next sibling's
      segment is tried; after the last, the bonus comes from u's residual.

    Arranged for tensors, no host read: the sibling rounds advance every tester's state as if
    each child were rejected (a later sibling is only tested after that) and record each segment's
    first log ratio log(p_1 / q_1); then every segment's weights come from path sums and maxima
    over its nodes (the ancestor mask restricted to the segment), its thresholds from one
    `[B, N, V]` residual pass, and its accepted prefix from independent uniforms, one per node.
    A tester accepts its first child (by rank) whose segment keeps a prefix. Relaxed rules (MARS's
    outright choices) test child by child (`TreeTests`). `weighted_residual` is where the maths
    lives (the distribution tests break it).
    """

    def weighted_residual(self, target_probs: torch.Tensor, weight: torch.Tensor, draft_probs: torch.Tensor | None, token: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """`weighted_residual` (the distribution tests override this method to break it)."""
        return weighted_residual(target_probs, weight, draft_probs, token, sampled)

    def verify(
        self,
        tree: TokenTree,
        target_logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        outright: torch.Tensor | None = None,
        fallback: torch.Tensor | None = None,
    ) -> Verdict:
        if outright is not None:  # a relaxed rule's outright choices: child by child
            return super().verify(tree, target_logits, params, generator, outright, fallback)
        table = ChildTable.of(tree)
        k = table.k
        if k == 0:  # a root-only tree: the bonus alone
            return super().verify(tree, target_logits, params, generator)
        b, n = tree.tokens.shape
        dev = target_logits.device
        target = logits_to_logprobs(target_logits, params).exp()  # [B, N, V]: each node's target, testers' then their residual
        vocab = target.shape[2]
        draft_left = None if tree.draft_logprobs is None else tree.draft_logprobs.exp()  # [B, N, V] q, testers' earlier drawn children removed
        one, zero = constants.full((), 1.0, target.dtype, dev), constants.full((), 0.0, target.dtype, dev)
        cols = constants.arange(n, dev)  # [N]
        children = table.has.sum(dim=2)  # [B, N]
        tester = (children >= 2) | (cols[None, :] == 0)  # [B, N]: the root, and nodes whose children start segments
        parent = tree.parents.clamp(min=0)  # [B, N]
        non_root = tree.valid & (cols[None, :] > 0)  # [B, N]
        head = non_root & tester.gather(1, parent)  # [B, N]: the first node of a segment
        inner = non_root & (children == 1)  # [B, N]: a segment node whose only child is the segment's next node
        # the sibling rounds: each head's first log ratio against its tester's state after the earlier siblings' rejection
        first_ratio = torch.zeros(b, n + 1, dtype=target.dtype, device=dev)  # [B, N + 1] by node (column n: none)
        for i in range(k):
            x, s = table.tokens[:, :, i], table.drawn[:, :, i]  # [B, N] each
            log_ratio = target.gather(2, x[:, :, None]).squeeze(2).log()  # [B, N] log p (-inf where p = 0)
            mass = None
            if draft_left is not None:
                mass = self.proposal_mass(draft_left)  # [B, N]
                q_x = torch.where(s, draft_left.gather(2, x[:, :, None]).squeeze(2).div_(mass), one)  # [B, N]: 1 for a point mass
                log_ratio = log_ratio - q_x.clamp_(min=_EPS).log()
            first_ratio.scatter_(1, table.nodes[:, :, i], log_ratio)  # nodes without an i-th child write column n
            if i < k - 1:  # as if the child were rejected: the next sibling is only tested then (the last residual: at the path's end)
                self._advance(target, draft_left, mass, x, s, ~s, table.has[:, :, i] & tester, zero)
        # later positions: log(p / q) of each node's token at its parent, whose distributions no round touched (not a tester)
        at_parent = parent * vocab + tree.tokens  # [B, N] flat index of (parent, token)
        log_ratio = target.reshape(b, n * vocab).gather(1, at_parent).log()  # [B, N]
        proposal = None
        if draft_left is not None:
            proposal = draft_left / self.proposal_mass(draft_left)[:, :, None]  # [B, N, V] the draft at inner nodes (untouched), normalised
            q = proposal.reshape(b, n * vocab).gather(1, at_parent)
            log_ratio = log_ratio - torch.where(tree.sampled, q.clamp_(min=_EPS).log(), zero)
        log_ratio = torch.where(head, first_ratio[:, :n], log_ratio)  # [B, N] log(p_j / q_j) at each segment position
        # segments: [b, v, a] a lies on v's segment at or above v (a is v or an ancestor no shallower than v's head)
        anc = tree.ancestor_mask()  # [B, N, N]
        depths = tree.depths
        head_depth = torch.where(anc & head[:, None, :], depths[:, None, :], -1).amax(dim=2)  # [B, N] (-1: the root, padding)
        on_segment = anc & (depths[:, None, :] >= head_depth[:, :, None]) & (head_depth >= 1)[:, :, None]  # [B, N, N]
        # weights w = min(1, w_prev p / q) along each segment: log w_v = s_v - max(0, max over the segment down to v of s), s the path sums
        path_sum = torch.where(on_segment, log_ratio[:, None, :], zero).sum(dim=2)  # [B, N] s_v
        path_max = torch.where(on_segment, path_sum[:, None, :], float("-inf")).amax(dim=2)  # [B, N]
        weight = (path_sum - path_max.clamp(min=0.0)).exp()  # [B, N] w_v
        # thresholds: h = r / (r + 1 - w) at a node whose segment goes on (r: the weighted residual's mass), w at a segment's end
        residual = self.weighted_residual(target, weight, proposal, table.tokens[:, :, 0], table.drawn[:, :, 0])  # [B, N, V] (used at inner nodes)
        r = residual.sum(dim=2)  # [B, N]
        denominator = r + 1.0 - weight
        h = torch.where(inner, torch.where(denominator > _EPS, r / denominator.clamp(min=_EPS), one), weight)  # [B, N]
        eta = torch.rand(b, n, generator=generator, device=dev)  # [B, N] one per segment position
        passes = (eta < h).logical_and_(non_root)  # [B, N]
        # a segment node is accepted when some node of its segment at or below it passes (the prefix ends at the last such node)
        kept = (on_segment & passes[:, :, None]).any(dim=1)  # [B, N]
        # a tester accepts its first child by rank whose segment keeps a prefix
        head_kept = torch.nn.functional.pad(kept & head, (0, 1)).gather(1, table.nodes.view(b, n * k)).view(b, n, k) & tester[:, :, None]  # [B, N, K]
        first = head_kept & (head_kept.cumsum(dim=2) == 1)
        chosen = torch.zeros(b, n + 1, dtype=torch.bool, device=dev).scatter_(1, table.nodes.view(b, n * k), first.view(b, n * k))[:, :n]
        ok_nodes = torch.where(head, chosen, kept)
        ok_nodes[:, 0] = True
        deepest, _, path, accepted_len = deepest_path(tree, ok_nodes)
        # the bonus: at a prefix's end inside a segment, the weighted residual there; else the node's residual after all its children
        probs = self.final_residual(target, draft_left, table, deepest, zero)  # [B, V]
        at = deepest[:, None, None].expand(b, 1, vocab)
        stop = residual.gather(1, at).squeeze(1)  # [B, V] unnormalised (the draw below needs no normalising)
        mid = inner.gather(1, deepest[:, None]).squeeze(1) & (stop.sum(dim=1) > _EPS)  # [B]; nothing left: the node's target
        probs = torch.where(mid[:, None], stop, torch.where(inner.gather(1, deepest[:, None]), target.gather(1, at).squeeze(1), probs))
        bonus = sample_from_probs(probs, generator)  # a draw from probs (exponential race)
        zeros = constants.full((b,), 0, torch.long, dev)
        return Verdict(path=path, accepted_len=accepted_len, bonus_tokens=bonus, relaxed_count=zeros, fallback_count=zeros)


BLOCK_TREE = BlockTreeTests()
"""the lossless tree tests on the device with chain segments as blocks (`segments="block"`)"""


@dataclass
class Wavefront:
    """Traversal's schedule on the device (`TraversalTreeTests.states`): node v handles its child
    of rank i in round start(v) + i, where start(v) is the sum of (rank + 1) over v's path (the
    root 0): a node's state is final one round after its parent handled it. So a child c is
    handled, by its parent, in round start(c) - 1, and each node handles at most one child a
    round. `slots` lists each round's children, row by row, so a round touches the distributions
    of the nodes it updates only (about one row of [N, V] per tree edge over all the rounds,
    against every node in every round); `widths` (the most children any row handles in each
    round) is read on the host once, and `SamplingRule.prepare` starts that copy before the
    verify forward is launched, so reading it waits for the drafting work only."""

    table: ChildTable
    """the tree's children by rank (`TraversalTreeTests.accepted_node` reads it)"""
    order: torch.Tensor
    """[B, N] int64 each row's nodes by the round they are handled in, then by index (the root and
    padding last)"""
    round_of: torch.Tensor
    """[B, N] int64 the round of each node in `order` (N: never handled)"""
    position: torch.Tensor
    """[B, N] int64 each node's place in `order` among its round's"""
    round_widths: torch.Tensor
    """[N] int64 per round t, the most children a row handles in it"""
    counts: HostCopy | None
    """`round_widths` on its way to the host (None: not copied, `of(host_counts=False)`)"""

    @classmethod
    def of(cls, tree: TokenTree, table: ChildTable | None = None, host_counts: bool = True) -> Wavefront:
        """table: `ChildTable.of(tree)` when already built. host_counts: start copying the
        round widths to the host (not inside a graph: `specdec.verification.captured`)."""
        table = ChildTable.of(tree) if table is None else table
        b, n = tree.tokens.shape
        dev = tree.tokens.device
        start = (tree.ancestor_mask() * (table.ranks + 1).clamp(min=0)[:, None, :]).sum(dim=2)  # [B, N]
        # the round each valid non-root node is handled in (its parent's test of it); n: never
        handled = start.sub_(1).masked_fill_(table.ranks < 0, n)  # [B, N] (ranks: -1 at the root and padding)
        per_round = torch.zeros(b, n + 1, dtype=torch.long, device=dev).scatter_add_(1, handled, constants.ones(1, torch.long, dev).expand(b, n))  # [B, N + 1]
        cols = constants.arange(n, dev)
        order = (handled * n + cols).argsort(dim=1)  # [B, N] children by round, then by index
        round_of = handled.gather(1, order)  # [B, N] non-decreasing
        position = cols - (per_round.cumsum(dim=1) - per_round).gather(1, round_of)  # [B, N] minus where each one's round begins in `order`
        widest = per_round[:, :n].amax(dim=0)  # [N]
        return cls(table=table, order=order, round_of=round_of, position=position, round_widths=widest, counts=HostCopy(widest) if host_counts else None)

    def slots(self, widths: list[int]) -> torch.Tensor:
        """[B, R, W] int64: [b, t, j] the j-th child row b handles in round t (N: none), R the
        rounds and W the widest (`widths`): sized by the tree's rounds, not N x N."""
        b, n = self.order.shape
        rounds, wide = len(widths), max(widths, default=0)
        slot = torch.where(self.round_of < rounds, self.round_of * wide + self.position, rounds * wide)  # [B, N] (the last: a spare slot)
        table = torch.full((b, rounds * wide + 1), n, dtype=torch.long, device=self.order.device)
        return table.scatter_(1, slot, self.order)[:, : rounds * wide].view(b, rounds, wide)

    def widths(self) -> list[int]:
        """Per round, the most children a row handles in it, up to the last round with any (waits for the copy `of` started)."""
        assert self.counts is not None, "Wavefront.of(host_counts=False) has no host copy of its widths"
        return round_widths(self.counts)

    def rounds(self) -> int:
        """The round count."""
        return len(self.widths())


def round_widths(counts: HostCopy) -> list[int]:
    """`Wavefront.round_widths` on the host (waits for the copy), up to the last round with any child."""
    values = counts.wait().tolist()
    rounds = next((t + 1 for t in range(len(values) - 1, -1, -1) if values[t] > 0), 0)
    return values[:rounds]


def spare_row(rows: torch.Tensor, exp: bool = False) -> torch.Tensor:
    """[B, N, V] -> [B, N + 1, V]: the rows (exponentiated when `exp`, written straight into the
    new tensor) and a last row of zeros, which padding slots may write to."""
    b, n, v = rows.shape
    out = torch.empty(b, n + 1, v, dtype=rows.dtype, device=rows.device)
    if exp:
        torch.exp(rows, out=out[:, :n])
    else:
        out[:, :n].copy_(rows)
    out[:, n].zero_()
    return out


class TraversalTreeTests(TreeTests):
    """Traversal verification (`TraversalTests`' rule, Weng et al. NeurIPS 2025) on the device,
    every node and row at once (`SamplingRule(segments="traversal")` on the device walk).

    The host walk visits nodes in post-order and stops at the first accepted one. Arranged for
    tensors, the states come first and the draws after: a node's state (weight w, target P, draft
    without its earlier drawn children Q) changes only when one of its children is rejected, by
    block verification's update from the child's token alone, never from what happened below that
    child. So every node's state as it would be when tested (all its children rejected) and every
    child's entry weight min(1, w P(x) / Q(x)) follow from the tree and the distributions, before
    any draw, from the root down: in each round every node whose own state is final gives its
    next child (by rank) its entry weight and then takes the update

        R = max(0, w P - Q),  w <- sum R / (sum R + 1 - w),  P <- R / sum R

    (and Q loses the drawn token). Then one uniform per node: a node passes when u < w (its final
    weight; the root always). The walk would stop at the first passing node in post-order (a node
    is tested only if every node before it failed, and whatever it tests is its final state), so
    the accepted path is the one to that node and the bonus comes from its final P. Post-order
    positions come from subtree sizes: a node's position is its subtree's other nodes plus the
    subtrees of the earlier siblings of it and of each of its ancestors.

    Same outcomes in distribution as the host walk (different uniforms: a seed gives different
    samples on the two); exact by enumeration (`tests/test_block_verification.py`). Cost: the
    tree's `Wavefront` rounds (each node handles one child per round once its state is final:
    about 7 for EAGLE-2's trees at T = 1, where child by child runs its top-k of 8) of about 30
    ops, over the rows of the nodes that handle a child in that round only ([B, W, V]: over all
    the rounds about one row per tree edge; every node in every round, the rule before, moved
    7x the memory on the bundled pair's EAGLE-2 trees), and one wait for the rounds' widths (a `HostCopy`
    started before the verify forward by `SamplingRule.prepare`). Relaxed rules (MARS's outright choices) test child by
    child. `weighted_residual` is where the maths lives (the distribution tests break it).
    """

    def weighted_residual(self, target_probs: torch.Tensor, weight: torch.Tensor, draft_probs: torch.Tensor | None, token: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """`weighted_residual` (the distribution tests override this method to break it)."""
        return weighted_residual(target_probs, weight, draft_probs, token, sampled)

    def states(self, tree: TokenTree, plan: Wavefront, target: torch.Tensor, draft_left: torch.Tensor | None, widths: list[int] | None = None) -> torch.Tensor:
        """In place: target [B, N, V] becomes each node's P after all its children were rejected
        (the bonus's distribution when the path ends there; a leaf keeps its own), draft_left
        [B, N, V] (None: no node is sampled) loses each node's drawn children. Returns the weights
        [B, N]: the probability each node passes its own test (the root 1; padding: anything).
        Either may carry a spare last row, [B, N + 1, V], for the rounds' padding slots to write
        to (`spare_row`; `verify` allocates them so); without one, one is added and the results
        copied back.

        Rounds by `Wavefront`: in each, every node whose own state is final handles one child,
        and only those nodes' rows are gathered, updated and scattered back ([B, W, V], W the
        round's `widths`). A tree needs its longest chain of (rank + 1) steps (EAGLE-2's trees at
        T = 1: about 7 rounds, against 45 for depth x top-k), one wait for their widths (a copy
        started before the forward when the plan is `SamplingRule.prepare`'s). widths: the rounds'
        widths when known (no wait); wider ones than the plan's are padding, which changes no result
        (a captured walk's are bucketed, `specdec.verification.captured`)."""
        b, n = tree.tokens.shape
        spare = [target.shape[1] == n + 1 and target.is_contiguous()]
        if draft_left is not None:
            spare.append(draft_left.shape[1] == n + 1 and draft_left.is_contiguous())
        if not all(spare):  # no spare rows: work on copies that have them
            spare_target, spare_draft = spare_row(target[:, :n]), None if draft_left is None else spare_row(draft_left[:, :n])
            weight = self.states(tree, plan, spare_target, spare_draft, widths)
            target[:, :n].copy_(spare_target[:, :n])
            if draft_left is not None and spare_draft is not None:
                draft_left[:, :n].copy_(spare_draft[:, :n])
            return weight
        dev = target.device
        widths = plan.widths() if widths is None else widths
        if not widths:  # no node has a child: every weight 1, every P its own
            return torch.ones(b, n, dtype=target.dtype, device=dev)
        vocab = target.shape[2]
        stride = n + 1
        # rows of [B * (N + 1)]: node j of row b at b * (N + 1) + j, a row's padding slots at its spare row N
        target_rows = target.view(b * stride, vocab)
        draft_rows = None if draft_left is None else draft_left.view(b * stride, vocab)
        weight = torch.ones(b * stride, dtype=target.dtype, device=dev)  # [B * (N + 1)] by node (the spare rows: the padding slots')
        one = constants.full((), 1.0, target.dtype, dev)
        offsets = constants.arange(b, dev)[:, None] * stride  # [B, 1]
        # per node (the spare rows: a padding slot's): its parent's row, its token, whether it was drawn
        fields = torch.stack([tree.parents.clamp(min=0) + offsets, tree.tokens, (tree.sampled & tree.valid).long()])  # [3, B, N]
        spare_fields = torch.stack([offsets + n, torch.zeros_like(offsets), torch.zeros_like(offsets)])  # [3, B, 1]
        fields = torch.cat([fields, spare_fields], dim=2).view(3, b * stride)  # [3, B * (N + 1)]
        slots = plan.slots(widths) + offsets[:, :, None]  # [B, R, W] rows of each round's children
        for t, width in enumerate(widths):
            child = slots[:, t, :width]  # [B, W] this round's children (the spare row: none)
            parent, x, s = fields[:, child]  # [B, W] each (padding: the spare row, 0, 0)
            s = s.bool()
            w = weight[parent]  # [B, W] the parents' weights
            p_rows = target_rows[parent]  # [B, W, V] the parents' P
            p_x = p_rows.gather(2, x[:, :, None]).squeeze(2)  # [B, W]
            proposal, q_rows, q_x = None, None, one
            if draft_rows is not None:
                q_rows = draft_rows[parent]  # [B, W, V] the parents' draft without earlier drawn children
                proposal = q_rows / self.proposal_mass(q_rows)[:, :, None]  # [B, W, V]
                q_x = torch.where(s, proposal.gather(2, x[:, :, None]).squeeze(2), one)  # [B, W]: 1 for a point mass
            weight[child] = (w * p_x / q_x.clamp(min=_EPS)).clamp_(max=1.0)  # the child's weight min(1, w p / q)
            # as if that child was rejected (the next sibling and the parent's own test only happen then)
            res = self.weighted_residual(p_rows, w, proposal, x, s)  # [B, W, V] unnormalised
            mass = res.sum(dim=2)  # [B, W]
            denominator = mass + 1.0 - w
            # (padding slots write the same values to their row's spare row: duplicates agree)
            weight[parent] = torch.where(denominator > _EPS, mass / denominator.clamp(min=_EPS), one)
            move = (mass > _EPS)[:, :, None]  # nothing left: P stays (the test could not have rejected); padding: 0 left
            target_rows[parent] = torch.where(move, res.div_(mass.clamp(min=_EPS)[:, :, None]), p_rows)
            if draft_rows is not None and q_rows is not None:
                self.remove_drawn(q_rows, x, s)
                draft_rows[parent] = q_rows
        return weight.view(b, stride)[:, :n]

    @staticmethod
    def post_order(tree: TokenTree, table: ChildTable) -> torch.Tensor:
        """[B, N] int64 each valid node's position in post-order (children in tree order before
        their parent; the root last). Example: parents [-1, 0, 0, 1] -> [3, 1, 2, 0]."""
        b, n = tree.tokens.shape
        anc = tree.ancestor_mask()  # [B, N, N]: [b, i, j] j is i or an ancestor of i
        size = (anc & tree.valid[:, :, None]).sum(dim=1)  # [B, N] each node's subtree, itself included
        k = table.k
        if k == 0:
            return size - 1
        kid_size = torch.nn.functional.pad(size, (0, 1)).gather(1, table.nodes.view(b, n * k)).view(b, n, k)  # [B, N, K]
        earlier = (kid_size.cumsum(dim=2) - kid_size).view(b, n * k)  # subtrees of a child's earlier siblings
        left = torch.zeros(b, n + 1, dtype=size.dtype, device=size.device).scatter_(1, table.nodes.view(b, n * k), earlier)[:, :n]  # [B, N]
        return size - 1 + (anc * left[:, None, :]).sum(dim=2)

    def verify(
        self,
        tree: TokenTree,
        target_logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        outright: torch.Tensor | None = None,
        fallback: torch.Tensor | None = None,
    ) -> Verdict:
        if outright is not None:  # a relaxed rule's outright choices: child by child
            return super().verify(tree, target_logits, params, generator, outright, fallback)
        plan = tree.verify_plan
        if getattr(plan, "captured", False):  # prepared for a graph replay (`specdec.verification.captured`)
            return plan.walks.verify(self, plan, target_logits, params, generator)
        if not isinstance(plan, Wavefront):  # (prepared before the forward, or now)
            plan = Wavefront.of(tree)
        uniform, race = self.draws(tree, 1, target_logits.shape[-1], generator)  # one uniform per node's own test
        path, accepted_len, bonus = self.walk(tree, plan, plan.widths(), target_logits, params, uniform, race)
        zeros = constants.full((tree.batch_size,), 0, torch.long, target_logits.device)
        return Verdict(path=path, accepted_len=accepted_len, bonus_tokens=bonus, relaxed_count=zeros, fallback_count=zeros)

    def walk(
        self, tree: TokenTree, plan: Wavefront, widths: list[int], target_logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor, race: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tensor work of `verify`, no host read and no random draw (a graph captures it):
        (path [B, D], accepted_len [B], bonus [B]). widths: the plan's round widths, or wider
        (padding); uniform [B, N], race [B, V]: `draws` with k = 1."""
        b, n = tree.tokens.shape
        target = spare_row(logits_to_logprobs(target_logits, params), exp=True)  # [B, N + 1, V] (a spare row: `states`)
        draft_left = None if tree.draft_logprobs is None else spare_row(tree.draft_logprobs, exp=True)  # [B, N + 1, V]
        weight = self.states(tree, plan, target, draft_left, widths)
        at = self.accepted_node(tree, plan.table, weight, uniform)
        on_path = tree.ancestor_mask().gather(1, at[:, None, None].expand(b, 1, n)).squeeze(1)  # [B, N] root..at
        _, _, path, accepted_len = deepest_path(tree, on_path)
        probs = target.gather(1, at[:, None, None].expand(b, 1, target.shape[2])).squeeze(1)  # [B, V] the node's final P
        bonus = sample_from_probs(probs, None, uniforms=race)  # a draw from probs (exponential race)
        return path, accepted_len, bonus

    def accepted_node(self, tree: TokenTree, table: ChildTable, weight: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """[B] the first node in post-order whose test passes (uniform < weight, both [B, N]); the
        root, last in post-order, always passes."""
        n = tree.tokens.shape[1]
        cols = constants.arange(n, weight.device)
        passes = (uniform < weight).logical_and_(tree.valid).logical_or_(cols[None, :] == 0)  # [B, N]
        return torch.where(passes, self.post_order(tree, table), n).argmin(dim=1)


TRAVERSAL_TREE = TraversalTreeTests()
"""traversal verification on the device (`segments="traversal"`)"""

WALKS = ("auto", "device", "host")
"""where `SamplingRule` tests trees: 'device' (`TreeTests`), 'host' (`rejection_walk`), 'auto' the
device on accelerators and the host on the CPU"""


def check_walk(walk: object, rule: str) -> str:
    """`walk` if it is one of `WALKS`, else a SpecDecError naming it and the choices."""
    if walk not in WALKS:
        raise SpecDecError(f"{rule} walk={walk!r} must be one of {', '.join(WALKS)} (where trees are tested: 'auto' the device on accelerators, the host on the CPU)")
    return str(walk)


def check_chains(chains: object, rule: str) -> str:
    """`chains` if it is one of `CHAIN_RULES`, else a SpecDecError naming it and the choices."""
    if chains not in CHAIN_RULES:
        raise SpecDecError(f"{rule} chains={chains!r} must be one of {', '.join(CHAIN_RULES)} (how chains are verified: 'block' the whole block at once, the default; 'token' token by token)")
    return str(chains)


def check_segments(segments: object, rule: str) -> str:
    """`segments` if it is one of `SEGMENT_RULES`, else a SpecDecError naming it and the choices."""
    if segments not in SEGMENT_RULES:
        raise SpecDecError(
            f"{rule} segments={segments!r} must be one of {', '.join(SEGMENT_RULES)} (how a branching tree is verified: "
            "'block' each chain segment as a block, 'token' child by child, 'traversal' the whole tree from the leaves up, "
            "'auto' traversal, the default)"
        )
    return str(segments)


def walks_on_device(walk: str, device: torch.device) -> bool:
    """Whether trees of a `device` are tested there under the `walk` setting."""
    return walk == "device" or (walk == "auto" and device.type != "cpu")


HOST_SEGMENT_TESTS: dict[str, SiblingTests] = {"auto": TRAVERSAL, "block": EXACT_BLOCKS, "token": EXACT, "traversal": TRAVERSAL}
"""the host walk's tests for each `segments` setting"""

DEVICE_SEGMENT_TESTS: dict[str, TreeTests] = {"auto": TRAVERSAL_TREE, "block": BLOCK_TREE, "token": EXACT_TREE, "traversal": TRAVERSAL_TREE}
"""the device walk's tests for each `segments` setting"""

_EXACT_HOST_TESTS = (SiblingTests, BlockSiblingTests, TraversalTests)


class SamplingRule:
    """Lossless speculative sampling (see the module docstring).

    chains: how chains are verified: 'block' (`BlockChainTests`, the default) or 'token'
    (`ChainTests`, token by token, kept for comparison). segments: how branching trees are
    verified (`SEGMENT_RULES`): 'traversal' (the whole tree from the leaves up: `TraversalTests` on
    the host walk, `TraversalTreeTests` on the device), 'block' (chain segments as blocks: `BlockSiblingTests` on the host walk,
    `BlockTreeTests` on the device), 'token' (child by child: `SiblingTests`, `TreeTests`), or
    'auto' (the default): traversal on both walks.
    tests, chain_tests, tree_tests: the host walk's, the chains' and the device walk's tests,
    overriding `chains` and `segments` (the distribution tests pass deliberately wrong ones).
    """

    name = "sampling"

    def __init__(
        self,
        tests: SiblingTests | None = None,
        chain_tests: ChainTests | None = None,
        tree_tests: TreeTests | None = None,
        walk: str = "auto",
        chains: str = "block",
        segments: str = "auto",
    ) -> None:
        self.walk = check_walk(walk, "sampling")
        self.chains = check_chains(chains, "sampling")
        self.segments = check_segments(segments, "sampling")
        self.tests = tests if tests is not None else HOST_SEGMENT_TESTS[segments]
        self.chain_tests = chain_tests if chain_tests is not None else (BLOCK_CHAIN if chains == "block" else TOKEN_CHAIN)
        self.tree_tests = tree_tests if tree_tests is not None else DEVICE_SEGMENT_TESTS[segments]

    def prepare(self, tree: TokenTree, params: SamplingParams, walks: CapturedWalks | None = None) -> None:
        """Before the verify forward is launched: for traversal on the device, start copying the
        tree's round widths to the host (`Wavefront`), so `verify` reads it without waiting for the
        forward. walks: the target model's `specdec.verification.captured.CapturedWalks` (CUDA
        graphs), which then plans and later walks the tree as graph replays."""
        if params.greedy or tree.chain or not isinstance(self.tree_tests, TraversalTreeTests) or not self.walks_on_device(tree.tokens.device):
            return
        tree.verify_plan = Wavefront.of(tree) if walks is None else walks.plan(tree)

    def walks_on_device(self, device: torch.device) -> bool:
        """Whether trees on `device` are tested there (`TreeTests`) rather than walked on the host."""
        if type(self.tests) not in _EXACT_HOST_TESTS:  # (deliberately wrong host tests keep the host walk)
            return False
        return walks_on_device(self.walk, device)

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Verdict:
        if params.greedy:
            from specdec.verification.greedy import GreedyRule

            return GreedyRule().verify(tree, target_logits, params, generator)
        if tree.chain and tree.num_nodes > 1 and type(self.tests) in _EXACT_HOST_TESTS:  # (a deliberately wrong walk keeps the walk)
            return self.chain_tests.verify(tree, target_logits, params, generator)
        if self.walks_on_device(target_logits.device):
            return self.tree_tests.verify(tree, target_logits, params, generator)
        host = HostBatch.read(tree, target_logits, params, generator)
        return verdict_of([host.walk(row, tests=self.tests) for row in range(tree.batch_size)], target_logits.device)
