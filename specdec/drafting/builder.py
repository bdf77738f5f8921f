"""TreeBuilder: grows a batch of draft trees level by level, then emits a TokenTree.

Node fields live in preallocated [B, capacity] buffers written in place, and every node's
ancestor row is built when the node is added (its parent's row plus itself), so adding a
level, expanding it and emitting the tree are a fixed, small number of tensor ops whatever
the number of nodes, with no host reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.errors import SpecDecError
from specdec.sampling import SamplingParams
from specdec.sources.base import DraftSource, NodeBatch
from specdec.tree import TokenTree

TREE_SAMPLING = ("sampled", "topk")
"""how a tree policy picks children when sampling (temperature > 0): `sampled` draws them
without replacement from the draft distribution (`TreeBuilder.sample_children`; the default),
`topk` takes the draft's most likely tokens, verified as point-mass proposals (the older rule,
kept for comparison). Greedy decoding always takes the top-k, whatever the option."""


def check_tree_sampling(value: object) -> None:
    """SpecDecError unless `value` is one of TREE_SAMPLING."""
    if value not in TREE_SAMPLING:
        raise SpecDecError(
            f"tree_sampling={value!r} must be 'sampled' (children drawn from the draft distribution, the default) "
            "or 'topk' (the draft's top tokens, the older rule); fix --tree-sampling"
        )


@dataclass
class DraftContext:
    """What a tree policy knows when it drafts a step."""

    params: SamplingParams
    generator: torch.Generator | None
    max_depth: int
    """deepest node worth drafting this step (tokens left to generate - 1)"""
    active: torch.Tensor
    """[B] bool: rows still generating (finished rows get a root-only tree)"""
    context_len: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    """[B] committed tokens per row (cost-aware policies bucket on it)"""
    host_active: list[bool] | None = None
    """`active` on the host, when the caller knows it (policies then need no device read for it)"""
    host_context_len: list[int] | None = None
    """`context_len` on the host, when the caller knows it"""

    def samples_children(self, tree_sampling: str) -> bool:
        """Whether a tree policy with option `tree_sampling` draws this step's children at random
        (sampling params and tree_sampling 'sampled'); greedy steps never do."""
        return tree_sampling == "sampled" and not self.params.greedy


@dataclass
class Draft:
    """A policy's draft for one step."""

    tree: TokenTree
    """the trees to verify"""
    builder: TreeBuilder | None
    """the builder that grew them (None for AR, which drafts nothing)"""
    origin: torch.Tensor
    """[B, N] int64: the builder node of each tree node (tree node i came from builder node origin[b, i])"""


class TreeBuilder:
    """Candidate nodes in creation order (level by level, so parents precede children).

    Node indices are columns shared by all rows; a row that has fewer nodes at some
    level marks the extra columns invalid. `finish` selects the nodes to verify.
    """

    def __init__(self, source: DraftSource, roots: torch.Tensor, ctx: DraftContext, keep_draft_probs: bool, capacity: int = 64) -> None:
        self.source = source
        self.ctx = ctx
        self.device = dev = roots.device
        b = roots.shape[0]
        cap = max(2, capacity)
        self._n = 1  # nodes so far (the root)
        self._tokens = torch.zeros(b, cap, dtype=torch.long, device=dev)
        self._tokens[:, 0] = roots
        self._parents = torch.full((b, cap), -1, dtype=torch.long, device=dev)
        self._depths = torch.zeros(b, cap, dtype=torch.long, device=dev)
        self._logq = torch.zeros(b, cap, device=dev)
        self._cum_logq = torch.zeros(b, cap, device=dev)
        self._valid = torch.zeros(b, cap, dtype=torch.bool, device=dev)
        self._valid[:, 0] = True
        self._sampled = torch.zeros(b, cap, dtype=torch.bool, device=dev)
        self._ancestors = torch.zeros(b, cap, cap, dtype=torch.bool, device=dev)  # [B, N, N] node i descends from (or is) node j
        self._ancestors[:, 0, 0] = True
        self.levels = 0
        """nodes added by `add` calls so far bound every node's depth (each add is one level deeper at most)"""
        self.keep_draft_probs = keep_draft_probs
        self.root_logprobs = source.begin_step(roots, ctx.params)  # [B, V]
        # kept draft distributions, stored compactly: only expanded nodes have one. Chunk i is
        # the [B, m_i, V] output of the i-th draft forward (chunk 0: the root's); _dist_slot[b, j]
        # is node j's row in the chunks concatenated along dim 1 (0 for nodes never expanded)
        self._dist_chunks: list[torch.Tensor] = []
        self._dist_slot: torch.Tensor | None = None  # [B, cap] int64 when kept
        self._dist_rows = 0
        if keep_draft_probs:
            self._dist_chunks.append(self.root_logprobs[:, None, :])
            self._dist_slot = torch.zeros(b, cap, dtype=torch.long, device=dev)
            self._dist_rows = 1
        self._score: torch.Tensor | None = None  # [B, cap] ranking score, allocated by the first `add` that gives one
        self.draft_forwards = 1
        self._eyes: dict[int, torch.Tensor] = {}
        self._cols = torch.arange(cap, device=dev)

    # ----- views of the nodes so far ([B, N]) ------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self._n

    @property
    def batch_size(self) -> int:
        return self._tokens.shape[0]

    @property
    def tokens(self) -> torch.Tensor:
        return self._tokens[:, : self._n]

    @property
    def parents(self) -> torch.Tensor:
        return self._parents[:, : self._n]

    @property
    def depths(self) -> torch.Tensor:
        return self._depths[:, : self._n]

    @property
    def logq(self) -> torch.Tensor:
        """[B, N] draft log-prob of each node's token under its parent (-inf for invalid nodes)"""
        return self._logq[:, : self._n]

    @property
    def cum_logq(self) -> torch.Tensor:
        """[B, N] path draft log-prob (-inf for invalid nodes)"""
        return self._cum_logq[:, : self._n]

    @property
    def valid(self) -> torch.Tensor:
        return self._valid[:, : self._n]

    @property
    def score(self) -> torch.Tensor:
        """[B, N] the score tree policies rank nodes by: `cum_logq` for deterministic (top-k)
        nodes, the Gumbel key (see `sample_children`) for sampled ones; -inf for invalid nodes.
        Never larger for a child than for its parent, nor for a later-drawn sampled sibling
        than for an earlier one, so keeping the best n nodes keeps a subtree."""
        if self._score is None:
            return self.cum_logq
        return self._score[:, : self._n]

    @property
    def ancestors(self) -> torch.Tensor:
        """[B, N, N] bool: [b, i, j] when node j is node i or one of its ancestors (invalid nodes: only themselves)"""
        return self._ancestors[:, : self._n, : self._n]

    # ----- growing -----------------------------------------------------------------------
    def _reserve(self, total: int) -> None:
        cap = self._tokens.shape[1]
        if total <= cap:
            return
        new = max(total, 2 * cap)
        grow = new - cap

        def pad(t: torch.Tensor, value: float | bool | int, dims: int = 1) -> torch.Tensor:
            shape = list(t.shape)
            shape[1] = grow
            t = torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=1)
            if dims == 2:
                shape = list(t.shape)
                shape[2] = grow
                t = torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=2)
            return t

        self._tokens = pad(self._tokens, 0)
        self._parents = pad(self._parents, -1)
        self._depths = pad(self._depths, 0)
        self._logq = pad(self._logq, 0.0)
        self._cum_logq = pad(self._cum_logq, 0.0)
        self._valid = pad(self._valid, False)
        self._sampled = pad(self._sampled, False)
        self._ancestors = pad(self._ancestors, False, dims=2)
        self._cols = torch.arange(new, device=self.device)
        if self._dist_slot is not None:
            self._dist_slot = pad(self._dist_slot, 0)
        if self._score is not None:
            self._score = pad(self._score, float("-inf"))

    def add(
        self,
        parents: torch.Tensor,
        tokens: torch.Tensor,
        logq: torch.Tensor,
        valid: torch.Tensor,
        sampled: bool | torch.Tensor = False,
        score: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append k candidate nodes per row; returns their indices [B, k].

        parents: [B, k] int64 node indices; tokens: [B, k]; logq: [B, k] draft log-prob
        of each token under its parent's distribution; valid: [B, k] bool. A node is valid
        only if its parent is, its row is active and its logq is finite.
        sampled: the nodes were drawn from their parent's draft distribution (bool or [B, k]).
        score: [B, k] their ranking score (`score`; the Gumbel keys of `sample_children`);
        None = their cum_logq.
        """
        b, k = tokens.shape
        start, end = self._n, self._n + k
        self._reserve(end)
        safe = parents.clamp(min=0)
        valid = valid & self.ctx.active[:, None] & self._valid.gather(1, safe) & (logq > float("-inf"))
        invalid = ~valid
        self._tokens[:, start:end] = tokens
        self._parents[:, start:end] = parents.masked_fill(invalid, -1)
        self._depths[:, start:end] = self._depths.gather(1, safe) + 1
        self._logq[:, start:end] = logq.masked_fill(invalid, float("-inf"))
        torch.add(self._cum_logq.gather(1, safe), logq, out=self._cum_logq[:, start:end]).masked_fill_(invalid, float("-inf"))
        self._valid[:, start:end] = valid
        if isinstance(sampled, torch.Tensor):
            torch.logical_and(sampled, valid, out=self._sampled[:, start:end])
        elif sampled:
            self._sampled[:, start:end] = valid
        if score is not None and self._score is None:  # the nodes so far rank by cum_logq
            self._score = self._cum_logq.clone()
        if self._score is not None:
            self._score[:, start:end] = self._cum_logq[:, start:end] if score is None else score.masked_fill(invalid, float("-inf"))
        # ancestor rows: the parent's row (valid nodes only) plus the node itself
        cap = self._ancestors.shape[2]
        rows = self._ancestors[:, start:end]  # [B, k, cap] written in place
        torch.logical_and(self._ancestors.gather(1, safe[:, :, None].expand(b, k, cap)), valid[:, :, None], out=rows)
        rows[:, :, start:end] |= self._eye(k)
        self._n = end
        self.levels += 1
        return self._cols[start:end].expand(b, k)

    def _eye(self, k: int) -> torch.Tensor:
        eye = self._eyes.get(k)
        if eye is None:
            eye = self._eyes[k] = torch.eye(k, dtype=torch.bool, device=self.device)
        return eye

    def expand(self, nodes: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """One draft forward over `nodes` [B, k] (valid [B, k]); returns their children's
        draft log-distributions [B, k, V]."""
        valid = valid & self._valid.gather(1, nodes)
        batch = NodeBatch(nodes=nodes, valid=valid, tokens=self.tokens, depths=self.depths, ancestors=self.ancestors)
        logprobs = self.source.expand(batch, self.ctx.params)
        self.draft_forwards += 1
        if self._dist_slot is not None:
            k = nodes.shape[1]
            rows = torch.arange(self._dist_rows, self._dist_rows + k, device=self.device).expand_as(nodes)
            self._dist_slot.scatter_(1, nodes, torch.where(valid, rows, self._dist_slot.gather(1, nodes)))
            self._dist_chunks.append(logprobs)
            self._dist_rows += k
        return logprobs

    def top_children(self, nodes: torch.Tensor, logprobs: torch.Tensor, k: int, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The k most likely children of each node, flattened node-major.

        nodes: [B, m]; logprobs: [B, m, V]; valid: [B, m].
        Returns (parents [B, m*k], tokens [B, m*k], logq [B, m*k], valid [B, m*k]).
        """
        b, m, _ = logprobs.shape
        top = torch.topk(logprobs, k, dim=-1)
        parents = nodes[:, :, None].expand(b, m, k).reshape(b, m * k)
        child_valid = valid[:, :, None].expand(b, m, k).reshape(b, m * k)
        return parents, top.indices.reshape(b, m * k), top.values.reshape(b, m * k), child_valid

    def sample_children(
        self, nodes: torch.Tensor, logprobs: torch.Tensor, k: int, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """k children of each node drawn at random without replacement from its draft
        distribution, in draw order, flattened node-major, with their Gumbel keys.

        Gumbel-top-k: with i.i.d. standard Gumbel noise g_v, the k largest logprobs_v + g_v are
        k draws without replacement from exp(logprobs) in draw order: the i-th is distributed
        as the draft distribution with the first i - 1 removed and renormalised.
        The key of a child x of node u is stochastic beam search's perturbed path log-probability
        (Kool, van Hoof and Welling 2019): cum_logq(x) plus Gumbel noise, conditioned on the
        largest key among u's children being u's own key (the root's is 0). So a first draw keeps
        its parent's key, keys never increase from a node to its children nor from a sibling to
        the next one drawn, and, given the earlier draws, a child's key is independent of which
        token it is (the Gumbel-max property). A policy that ranks and prunes sampled children
        by keys therefore never looks at a child's own token when deciding to keep it, which
        the exactness of sampling verification needs (docs/ARCHITECTURE.md).

        nodes: [B, m]; logprobs: [B, m, V] the nodes' children distributions (after the
        sampling params); valid: [B, m]. Draws from `ctx.generator`. Tokens outside the
        distribution's support (fewer than k) come back with logq -inf: `add` drops them.
        Returns (parents, tokens, logq, valid, keys), each [B, m*k]; pass keys to `add(score=...)`.
        """
        b, m, _ = logprobs.shape
        # -Gumbel noise as log(-log u) (torch's exponential_ is several times slower than rand on CPU)
        noise = torch.rand(logprobs.shape, generator=self.ctx.generator, device=logprobs.device).log_().neg_().log_()
        top = torch.topk(torch.sub(logprobs, noise, out=noise), k, dim=-1)  # [B, m, k] logq + Gumbel, in draw order
        tokens, perturbed = top.indices, top.values
        logq = logprobs.gather(-1, tokens)  # [B, m, k]
        safe = nodes.clamp(min=0)
        parent_key = self.score.gather(1, safe)[:, :, None]  # [B, m, 1]
        parent_cum = self.cum_logq.gather(1, safe)[:, :, None]  # [B, m, 1]
        # key = -log(exp(-T) - exp(-Z) + exp(-G)) with T the parent's key, G = parent_cum + perturbed
        # the child's perturbed path log-prob and Z the largest G (the first draw); in the stable
        # form of Kool et al. (Appendix B): w = T - G + log(1 - exp(G - Z)), key = T - relu(w) - log1p(exp(-|w|))
        w = parent_key - parent_cum - perturbed + _log1mexp(perturbed - perturbed[..., :1])  # -inf for the first draw
        key = parent_key - w.clamp(min=0) - torch.log1p(torch.exp(-w.abs()))
        ok = valid[:, :, None] & torch.isfinite(logq) & torch.isfinite(key)
        key = key.masked_fill(~ok, float("-inf")).cummin(dim=-1).values  # monotone in draw order despite rounding
        parents = nodes[:, :, None].expand(b, m, k).reshape(b, m * k)
        child_valid = valid[:, :, None].expand(b, m, k).reshape(b, m * k)
        return parents, tokens.reshape(b, m * k), logq.reshape(b, m * k), child_valid, key.reshape(b, m * k)

    # ----- emitting ------------------------------------------------------------------------
    def finish(self, keep: torch.Tensor | None = None, width: int | None = None) -> tuple[TokenTree, torch.Tensor]:
        """The TokenTree of the kept nodes and, for each of its nodes, the builder index it
        came from ([B, N'] int64).

        keep: [B, N] bool, closed under parents (the root is always kept); None keeps every
        node as it is (no selection at all). width: N' when keep is given (at least the
        largest kept count; the policy's node budget + 1 reads nothing from the device);
        None = the largest kept count (a host read).
        """
        n = self._n
        full = TokenTree(
            tokens=self.tokens,
            parents=self.parents,
            depths=self.depths,
            logq=self.logq.masked_fill(~self.valid, 0.0),
            cum_logq=self.cum_logq,
            valid=self.valid,
            sampled=self._sampled[:, :n],
            ancestors=self.ancestors,
            depth_bound=self.levels,
        )
        if keep is None:
            tree, origin = full, torch.arange(n, device=self.device).expand(self.batch_size, n)
        else:
            keep = keep.clone()
            keep[:, 0] = True
            tree, origin = full.select_with_origin(keep, width=width)
        if self._dist_slot is not None:  # only the kept nodes' draft distributions are gathered
            dists = torch.cat(self._dist_chunks, dim=1) if len(self._dist_chunks) > 1 else self._dist_chunks[0]  # [B, S, V]
            slot = self._dist_slot[:, :n].gather(1, origin)  # [B, N']
            tree.draft_logprobs = dists.gather(1, slot[:, :, None].expand(-1, -1, dists.shape[-1]))
        return tree, origin

    def top_by_score(self, score: torch.Tensor, n: int) -> torch.Tensor:
        """Keep mask [B, N] of the root and the n best valid non-root nodes by `score` [B, N].

        With a score that never increases from parent to child (cum_logq, or `score`), ties
        broken towards the earlier node, the kept set is a valid subtree; with `score` it also
        keeps each node's sampled children as a prefix of their draw order.
        """
        b, total = score.shape
        order_key = score.masked_fill(~self.valid, float("-inf"))
        order_key[:, 0] = float("inf")
        # stable sort on descending score: equal scores keep creation order (parents first)
        idx = torch.sort(order_key, dim=1, descending=True, stable=True).indices[:, : n + 1]
        keep = torch.zeros(b, total, dtype=torch.bool, device=score.device).scatter_(1, idx, True)
        return keep & self.valid


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, accurate at both ends (-inf at x = 0)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
