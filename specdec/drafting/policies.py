"""Baseline tree policies: AR (no draft), chain, static tree, EAGLE-2 dynamic tree."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch

from specdec import constants
from specdec.drafting.builder import Draft, DraftContext, TreeBuilder, check_tree_nodes, check_tree_sampling, root_only_draft
from specdec.drafting.levels import CapturedLevels
from specdec.drafting.ranks import RankAcceptance
from specdec.errors import SpecDecError
from specdec.models.static import node_bucket
from specdec.sampling import sample_from_probs

if TYPE_CHECKING:
    from specdec.sources.base import DraftSource
    from specdec.stats import StepRecord


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # True is an int to Python, not a size
        raise SpecDecError(f"{name}={value!r} must be a positive integer")


class _Stateless:
    def feedback(self, record: StepRecord) -> None:
        return None


class ARPolicy(_Stateless):
    """Plain autoregressive decoding: every step verifies only the root (one target token)."""

    name = "ar"
    uses_draft = False

    def draft(self, source: DraftSource | None, roots: torch.Tensor, ctx: DraftContext) -> Draft:
        return root_only_draft(roots)


@dataclass
class ChainPolicy(_Stateless):
    """Classic speculative decoding: a chain of K draft tokens.

    Greedy: each token is the draft's argmax. Sampling: each token is sampled from the
    draft distribution, which the lossless rule then uses as its proposal.
    """

    k: int = 5
    """draft tokens per step"""
    name: str = "chain"
    uses_draft: bool = True

    def __post_init__(self) -> None:
        _positive("k", self.k)
        check_tree_nodes(1 + self.k, f"chain k={self.k}", "--k")

    def draft(self, source: DraftSource, roots: torch.Tensor, ctx: DraftContext) -> Draft:
        sampling = not ctx.params.greedy
        may_be_empty = sampling and not getattr(source, "always_proposes", False)  # rows of all -inf: nothing to draft there
        depth = min(self.k, ctx.max_depth)
        levels = CapturedLevels.for_step(source, ("chain", may_be_empty), sampled=sampling)
        # capacity for k levels even where a row's last tokens cap the depth: one size of node buffers, so
        # captured levels keep their addresses (and graphs) to the end
        builder = TreeBuilder(source, roots, ctx, keep_draft_probs=sampling, capacity=1 + self.k, chain=True, workspace=levels and levels.workspace)
        logprobs = builder.root_logprobs  # [B, V]
        if levels is not None and depth > 1:
            levels.begin(builder, step_slots=(depth - 1) * node_bucket(1))
            logprobs = levels.buffer(("logprobs", 0), logprobs)
        for level in range(1, depth + 1):
            if levels is not None and level < depth:  # the level's child and its forward, replayed
                out = levels.output(("logprobs", level), (logprobs.shape[0], 1, logprobs.shape[-1]), logprobs.dtype)  # [B, 1, V]
                uniforms = levels.uniforms(("uniforms",), tuple(logprobs.shape)) if sampling else None
                body = partial(self._level, builder, logprobs, out, level, uniforms, may_be_empty)
                levels.run(("level", level), body, reads=(logprobs, out) if uniforms is None else (logprobs, out, uniforms))
                logprobs = out[:, 0]
                continue
            if levels is not None and depth > 1:  # the last level: its child alone (no forward), replayed
                uniforms = levels.uniforms(("uniforms",), tuple(logprobs.shape)) if sampling else None
                body = partial(self._add_child, builder, logprobs, sampling, uniforms, may_be_empty)
                levels.run(("last", level), body, reads=(logprobs,) if uniforms is None else (logprobs, uniforms))
                break
            node = self._add_child(builder, logprobs, sampling, None, may_be_empty)
            if level < depth:
                logprobs = builder.expand(node, builder.last_valid, depth=level)[:, 0]
        # a source that always proposes gives every token a finite logq (a greedy maximum or a
        # sampled token with mass), so with every row active no node is padding
        all_active = ctx.host_active is not None and all(ctx.host_active)
        drafted = builder.finish(all_valid=all_active and bool(getattr(source, "always_proposes", False)))
        drafted.tree.chain = True  # node i's parent is node i - 1
        return drafted

    @classmethod
    def _level(
        cls, builder: TreeBuilder, logprobs: torch.Tensor, out: torch.Tensor, level: int, uniforms: torch.Tensor | None, may_be_empty: bool
    ) -> torch.Tensor:
        """One chain level that is not the last (a captured level's body): the child of the
        newest node (logprobs [B, V]), then its forward, whose distribution is written to `out`
        [B, 1, V]. uniforms: [B, V], the draw's random numbers when sampling; None: greedy."""
        node = cls._add_child(builder, logprobs, uniforms is not None, uniforms, may_be_empty)
        return builder.expand(node, builder.last_valid, depth=level, out=out)

    @staticmethod
    def _add_child(builder: TreeBuilder, logprobs: torch.Tensor, sampling: bool, uniforms: torch.Tensor | None, may_be_empty: bool) -> torch.Tensor:
        """Add the newest node's child from its distribution logprobs [B, V]: the draft's argmax,
        or when sampling a draw (from `uniforms` [B, V] when given); returns it [B, 1]."""
        if sampling:
            probs = logprobs.exp()  # [B, V]
            if may_be_empty:  # an empty row draws token 0, whose logq -inf makes the node invalid
                probs[:, 0] += probs.sum(dim=1) == 0
            tok = sample_from_probs(probs, builder.ctx.generator, uniforms)[:, None]  # [B, 1]
            logq = logprobs.gather(1, tok)
        else:
            logq, tok = logprobs.max(dim=-1, keepdim=True)  # [B, 1] each
        return builder.add_chain_child(tok, logq, sampled=sampling)  # a finished row's root has cum_logq -inf: its nodes are invalid


@dataclass
class StaticTreePolicy(_Stateless):
    """A fixed tree: every node up to `depth` gets its `branching` most likely children,
    in BFS order until `max_nodes` draft tokens."""

    depth: int = 4
    """levels below the root"""
    branching: int = 2
    """children per node"""
    max_nodes: int = 64
    """node budget (draft tokens per step)"""
    tree_sampling: str = "sampled"
    """when sampling: 'sampled' children drawn from the draft distribution, or 'topk' (`TREE_SAMPLING`)"""
    name: str = "static"
    uses_draft: bool = True

    def __post_init__(self) -> None:
        for name in ("depth", "branching", "max_nodes"):
            _positive(name, getattr(self, name))
        check_tree_nodes(1 + self.max_nodes, f"static max_nodes={self.max_nodes}", "--max-nodes")
        check_tree_sampling(self.tree_sampling)

    def draft(self, source: DraftSource, roots: torch.Tensor, ctx: DraftContext) -> Draft:
        sampled = ctx.samples_children(self.tree_sampling)
        levels = CapturedLevels.for_step(source, ("static", self.branching, self.max_nodes, sampled), sampled=sampled)
        builder = TreeBuilder(source, roots, ctx, keep_draft_probs=sampled, capacity=1 + self.max_nodes, workspace=levels and levels.workspace)
        frontier, frontier_valid = builder.root, builder.root_valid  # [B, 1] each
        logprobs = builder.root_logprobs[:, None, :]  # [B, m, V] children distributions of the frontier
        budget = self.max_nodes
        depth = min(self.depth, ctx.max_depth)
        if levels is not None and depth > 1:  # room for every level's forward (each at most the budget wide)
            levels.begin(builder, step_slots=(depth - 1) * node_bucket(self.max_nodes))
            logprobs = levels.buffer(("logprobs", 0), logprobs)
        for level in range(1, depth + 1):
            k = min(self.branching, logprobs.shape[-1])
            take = min(frontier.shape[1] * k, budget)  # a partial last level: the first children in BFS order
            budget -= take
            last = level == depth or budget == 0
            if levels is not None and not last:  # the level's children and their forward, replayed
                out = levels.output(("logprobs", level), (roots.shape[0], take, logprobs.shape[-1]), logprobs.dtype)
                uniforms = levels.uniforms(("uniforms", level), tuple(logprobs.shape)) if sampled else None
                body = partial(self._level, builder, frontier, frontier_valid, logprobs, out, k, take, level, uniforms)
                levels.run(("level", level), body, reads=(logprobs, out) if uniforms is None else (logprobs, out, uniforms))
                start, end = builder._last  # the level's nodes: columns start..end - 1 (builder state, set after a replay too)
                frontier, frontier_valid, logprobs = constants.arange(end, roots.device)[start:end].expand(roots.shape[0], end - start), builder.last_valid, out
                continue
            if levels is not None and level > 1:  # the last level below captured ones: its children alone (no forward), replayed
                uniforms = levels.uniforms(("uniforms", level), tuple(logprobs.shape)) if sampled else None
                body = partial(self._add_level, builder, frontier, frontier_valid, logprobs, k, take, level, sampled, uniforms)
                levels.run(("last", level), body, reads=(logprobs,) if uniforms is None else (logprobs, uniforms))
                break
            nodes = self._add_level(builder, frontier, frontier_valid, logprobs, k, take, level, sampled)
            if last:
                break
            frontier, frontier_valid = nodes, builder.last_valid
            logprobs = builder.expand(frontier, frontier_valid, depth=level)
        return builder.finish()

    @classmethod
    def _level(
        cls,
        builder: TreeBuilder,
        frontier: torch.Tensor,
        frontier_valid: torch.Tensor,
        logprobs: torch.Tensor,
        out: torch.Tensor,
        k: int,
        take: int,
        level: int,
        uniforms: torch.Tensor | None,
    ) -> torch.Tensor:
        """A level that is not the last (a captured level's body): the frontier's children (its
        top-k, or k draws each from `uniforms` [B, m, V] when given), then their forward, whose
        distributions are written to `out` [B, take, V]."""
        nodes = cls._add_level(builder, frontier, frontier_valid, logprobs, k, take, level, uniforms is not None, uniforms)
        return builder.expand(nodes, builder.last_valid, depth=level, out=out)

    @staticmethod
    def _add_level(
        builder: TreeBuilder,
        frontier: torch.Tensor,
        frontier_valid: torch.Tensor,
        logprobs: torch.Tensor,
        k: int,
        take: int,
        level: int,
        sampled: bool,
        uniforms: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Add the frontier's [B, m] children at depth `level`: k each (their top-k, or k draws,
        from `uniforms` [B, m, V] when given), the first `take` in BFS order; returns them [B, take]."""
        keys = None
        if sampled:
            parents, tokens, logq, valid, keys = builder.sample_children(frontier, logprobs, k, frontier_valid, uniforms)  # [B, m*k]
        if sampled or take < frontier.shape[1] * k:
            if not sampled:
                parents, tokens, logq, valid = builder.top_children(frontier, logprobs, k, frontier_valid)  # [B, m*k]
            return builder.add(
                parents[:, :take],
                tokens[:, :take],
                logq[:, :take],
                valid[:, :take],
                sampled=sampled,
                score=None if keys is None else keys[:, :take],
                depth=level,
                children_per_parent=k,
            )
        return builder.add_top_children(frontier, logprobs, k, None, depth=level)  # [B, m*k]; invalid frontier nodes have cum_logq -inf


@dataclass
class Eagle2Policy:
    """EAGLE-2's dynamic tree: expand the `top_k` frontier nodes with the highest value for
    `depth` levels (each gets `top_k` children as candidates), then rerank all candidates and
    keep the best `total_tokens` (a valid subtree).

    A node's value estimates how likely the target is to accept its path. For the draft's top-k
    children (greedy decoding, or `tree_sampling="topk"`) it is EAGLE-2's cum_logq. For children
    drawn from the draft distribution it may not look at their tokens (docs/ARCHITECTURE.md), and
    a drawn token's draft probability says little about its acceptance anyway: the value is
    the sum of log positional acceptance rates along the path (`RankAcceptance`: P(the r-th
    draw is accepted | its parent was reached), learned from the verdicts, Sequoia-style).
    """

    depth: int = 6
    top_k: int = 8
    total_tokens: int = 32
    """draft tokens kept for verification"""
    tree_sampling: str = "sampled"
    """when sampling: 'sampled' children drawn from the draft distribution, valued by learned
    positional acceptance, or 'topk' (`TREE_SAMPLING`)"""
    name: str = "eagle2"
    uses_draft: bool = True
    ranks: RankAcceptance = field(default_factory=RankAcceptance, init=False, repr=False)
    """positional acceptance of sampled children, learned across steps and calls"""
    _drew_tree: bool = field(default=False, init=False, repr=False)
    """the last step drew its children: its verdicts (`feedback`) are observations of the positional rates"""

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "total_tokens"):
            _positive(name, getattr(self, name))
        check_tree_nodes(self.capacity, f"eagle2 depth={self.depth}, top_k={self.top_k} (1 + top_k + (depth - 1) x top_k^2 nodes)", "--depth or --expand-top-k")
        check_tree_sampling(self.tree_sampling)

    @property
    def capacity(self) -> int:
        """candidate nodes of a step's tree: top_k at the first level, top_k^2 at each further one, and the root"""
        return 1 + self.top_k + (self.depth - 1) * self.top_k * self.top_k

    def feedback(self, record: StepRecord) -> None:
        """Sampled trees: every verified node whose parent was reached is one observation of
        (sibling rank, accepted) for the positional rates."""
        if self._drew_tree and record.accepted_nodes and record.tree_parents:
            self.ranks.observe(record.tree_parents, record.accepted_nodes, record.active)
        self._drew_tree = False

    def draft(self, source: DraftSource, roots: torch.Tensor, ctx: DraftContext) -> Draft:
        k = self.top_k
        sampled = ctx.samples_children(self.tree_sampling)
        self._drew_tree = False
        levels = CapturedLevels.for_step(source, ("eagle2", self.top_k, sampled), sampled=sampled)
        builder = TreeBuilder(source, roots, ctx, keep_draft_probs=sampled, capacity=self.capacity, workspace=levels and levels.workspace)
        dev = roots.device
        depth = min(self.depth, ctx.max_depth)
        if depth == 0:
            return builder.finish()
        k = min(self.top_k, builder.root_logprobs.shape[-1])
        log_rates = None  # [k] the log rates of draw ranks 1..k (sampled children)
        if sampled:  # at a fixed address when levels are captured (one copy from the host either way)
            log_rates = self.ranks.log_rates(k, dev) if levels is None else levels.output(("log_rates",), (k,), torch.float32).copy_(self.ranks.log_rates(k))
        if levels is not None and depth > 1:  # the root's children replay too, from its distribution copied to a level buffer
            levels.begin(builder, step_slots=(depth - 1) * node_bucket(k))
            root = levels.buffer(("dist", 0), builder.root_logprobs[:, None, :])  # [B, 1, V]
            if sampled:  # the kept root distribution: the buffer (`CapturedLevels.finish` reads it there)
                builder._dist_chunks[0] = root
            frontier = levels.output(("frontier", 1), (builder.batch_size, k), torch.long)
            root_uniforms = levels.uniforms(("uniforms", 1), tuple(root.shape)) if sampled else None
            first = partial(self._first_level, builder, root, frontier, k, log_rates, root_uniforms)
            levels.run(("level", 1), first, reads=(root, frontier, *(() if log_rates is None or root_uniforms is None else (log_rates, root_uniforms))))
        else:
            frontier = self._children(builder, builder.root, builder.root_logprobs[:, None, :], k, builder.root_valid, log_rates, 1)  # [B, k]
        for level in range(2, depth + 1):
            if levels is None:
                frontier = self._level(builder, frontier, None, k, log_rates, level)
            else:  # replayed: the level's frontier buffer in, the next one out
                out = levels.output(("frontier", level), tuple(frontier.shape), frontier.dtype)
                reads: tuple[torch.Tensor, ...] = (frontier, out)
                uniforms = dists = None
                if sampled:  # the draws' random numbers in, the frontier's distributions (kept for verification) out
                    assert log_rates is not None
                    shape = (*frontier.shape, builder.root_logprobs.shape[-1])  # [B, k, V]
                    uniforms, dists = levels.uniforms(("uniforms",), shape), levels.output(("dist", level), shape, builder.root_logprobs.dtype)
                    reads = (*reads, log_rates, uniforms, dists)
                levels.run(("level", level), partial(self._level, builder, frontier, out, k, log_rates, level, uniforms, dists), reads=reads)
                frontier = out
        def select() -> Draft:  # the best total_tokens nodes by builder.score
            return builder.finish(builder.top_by_score(None, self.total_tokens), width=1 + self.total_tokens)

        drafted = select() if levels is None or depth <= 1 else levels.finish(select, width=1 + self.total_tokens)
        if sampled:
            self._drew_tree = True
        return drafted

    @classmethod
    def _first_level(
        cls, builder: TreeBuilder, root: torch.Tensor, out: torch.Tensor, k: int, log_rates: torch.Tensor | None, uniforms: torch.Tensor | None
    ) -> torch.Tensor:
        """A captured first level: the root's k children from its distribution `root` [B, 1, V]
        (drawn from `uniforms` [B, 1, V] when sampling), written to `out` [B, k]."""
        return out.copy_(cls._children(builder, builder.root, root, k, builder.root_valid, log_rates, 1, uniforms))

    @classmethod
    def _level(
        cls,
        builder: TreeBuilder,
        frontier: torch.Tensor,
        out: torch.Tensor | None,
        k: int,
        log_rates: torch.Tensor | None,
        level: int,
        uniforms: torch.Tensor | None = None,
        dists: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Expand the frontier [B, k] (nodes at depth level - 1), add k children under each, and
        return the next frontier [B, k], the k best of them (written to `out` when given).
        A captured level passes the draws' random numbers (`uniforms` [B, k, V]) and where the
        frontier's distributions go (`dists` [B, k, V]) when it draws children."""
        frontier_valid = builder.valid.gather(1, frontier)
        logprobs = builder.expand(frontier, frontier_valid, depth=level - 1, out=dists)  # [B, k, V]
        start = builder.num_nodes
        cls._children(builder, frontier, logprobs, k, frontier_valid, log_rates, level, uniforms)  # [B, k*k] nodes: columns start..start + k*k - 1
        # builder.score: cum_logq, or the positional value of sampled children (never their own
        # tokens' logq); -inf at invalid nodes
        best = torch.topk(builder.score[:, start:], k, dim=1).indices  # [B, k]
        return best.add_(start) if out is None else torch.add(best, start, out=out)

    @staticmethod
    def _children(
        builder: TreeBuilder,
        nodes: torch.Tensor,
        logprobs: torch.Tensor,
        k: int,
        valid: torch.Tensor,
        log_rates: torch.Tensor | None,
        depth: int,
        uniforms: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Add k children of each node [B, m] (all at depth - 1): its top-k, or k draws (from
        `uniforms` [B, m, V] when given) valued by the parent's value plus the log positional
        rate of their draw rank (log_rates [k]); returns them [B, m*k]."""
        if log_rates is None:
            return builder.add_top_children(nodes, logprobs, k, None, depth=depth)  # invalid nodes have cum_logq -inf
        parents, tokens, logq, child_valid = builder.draw_children(nodes, logprobs, k, valid, uniforms)  # valued by rank, not by Gumbel keys
        score = builder.score.gather(1, parents) + log_rates.repeat(nodes.shape[1])  # [B, m*k]: token-free, non-increasing in the rank
        return builder.add(parents, tokens, logq, child_valid, sampled=True, score=score, depth=depth, children_per_parent=k)
