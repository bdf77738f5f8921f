"""TreeBuilder: grows a batch of draft trees level by level, then emits a TokenTree.

Node fields live in preallocated [B, capacity] buffers written in place, and every node's
ancestor row is built when the node is added (its parent's row plus itself), so adding a
level, expanding it and emitting the tree are a fixed, small number of tensor ops whatever
the number of nodes, with no host reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec import constants
from specdec.errors import SpecDecError
from specdec.sampling import SamplingParams
from specdec.sources.base import AcceptedPaths, DraftSource, NodeBatch, TargetPath
from specdec.tree import TokenTree

TREE_SAMPLING = ("sampled", "topk")
"""how a tree policy picks children when sampling (temperature > 0): `sampled` draws them
without replacement from the draft distribution (`TreeBuilder.sample_children`; the default),
`topk` takes the draft's most likely tokens, verified as point-mass proposals (the older rule,
kept for comparison). Greedy decoding always takes the top-k, whatever the option."""


MAX_TREE_NODES = 16384
"""the most candidate nodes one step's draft tree may be sized for: the builder keeps a
[B, N, N] ancestor matrix, 256 MiB per row at this size (the defaults need a few hundred)"""


def check_tree_nodes(nodes: int, options: str, fix: str) -> None:
    """SpecDecError when a policy's options size a draft tree beyond MAX_TREE_NODES nodes.
    options: the settings that give `nodes`, e.g. "eagle2 depth=6, top_k=8"; fix: the flags to lower."""
    if nodes > MAX_TREE_NODES:
        raise SpecDecError(
            f"{options}: a step's draft tree would hold {nodes:,} candidate nodes, more than the {MAX_TREE_NODES:,} "
            f"a step can hold (the tree's buffers grow with the square of that); lower {fix}"
        )


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
    """A policy's draft for one step: the trees to verify and where their nodes came from.

    Two numberings of the step's nodes meet here. The draft source numbers nodes as the
    builder created them (`NodeBatch.nodes`, its cache's step slots); the verified tree holds
    only the nodes the policy kept, compacted (`TreeBuilder.finish`), and the accept rule's
    path indexes that tree. `accepted_paths` turns the verdict into the source's numbering,
    so the engine never handles builder indices.
    """

    tree: TokenTree
    """the trees to verify"""
    builder: TreeBuilder | None
    """the builder that grew them (None for AR, which drafts nothing)"""
    builder_nodes: torch.Tensor
    """[B, N] int64: the builder node of each tree node (tree node i of row b is builder node
    builder_nodes[b, i]; identity for a root-only tree)"""

    def accepted_paths(
        self, path: torch.Tensor, length: torch.Tensor, host_tokens: list[list[int]], host_active: list[bool], target: TargetPath
    ) -> AcceptedPaths:
        """The accept rule's verdict in the builder's node indices, for `DraftSource.end_step`:
        one gather on the device, no host read.

        path: [B, D] int64 the accepted tree nodes, root excluded (`Verdict.path`); length: [B]
        accepted draft tokens per row; host_tokens, host_active, target: as in `AcceptedPaths`."""
        chain = self.builder is not None and self.builder.chain  # every node kept, in builder order
        return AcceptedPaths(
            nodes=path if chain else self.builder_nodes.gather(1, path),  # [B, D]
            length=length,
            tokens=self.tree.tokens if self.builder is None else self.builder.tokens,  # [B, N_builder]
            host_tokens=host_tokens,
            host_active=host_active,
            target=target,
            chain=chain,
        )


def root_only_draft(roots: torch.Tensor) -> Draft:
    """A step that drafts nothing: each row's tree is its root [B] alone (plain decoding; the
    caller has not called the source's `begin_step`: AR has no source, a policy that skips
    drafting has called `defer`)."""
    tree = TokenTree.root_only(roots)
    return Draft(tree, None, tree.depths)  # builder_nodes: node 0 (the root-only tree's depths are that [B, 1] zero column)


class TreeBuilder:
    """Candidate nodes in creation order (level by level, so parents precede children).

    Node indices are columns shared by all rows; a row that has fewer nodes at some
    level marks the extra columns invalid. `finish` selects the nodes to verify.

    Storage: node fields packed by dtype into three preallocated buffers, so adding a
    level writes each buffer once (`torch.stack(..., out=...)`) and selecting nodes
    gathers each once:

    - `_ints`   [B, 3, capacity] int64: token, parent (-1 for the root), depth
    - `_floats` [B, 3, capacity] float32: logq, cum_logq, score (-inf for invalid nodes)
    - `_flags`  [B, 2, capacity] bool: valid, sampled
    - `_anc`    [B, capacity, capacity] bool: [b, i, j] node j is node i or an ancestor of it
      (the diagonal is set for every column up front, so adding a node ORs in its parent's row)

    Invalid nodes keep the parent and ancestors they were proposed under (they are never
    anyone's parent or ancestor: their children are invalid too); `finish` gives the
    TokenTree's padding nodes parent -1 and only themselves as ancestors.

    A row that is not active gets a root with cum_logq -inf: every node added under it is invalid.
    """

    def __init__(
        self,
        source: DraftSource,
        roots: torch.Tensor,
        ctx: DraftContext,
        keep_draft_probs: bool,
        capacity: int = 64,
        chain: bool = False,
        workspace: dict[tuple[object, ...], torch.Tensor] | None = None,
    ) -> None:
        """capacity: nodes the buffers hold before they grow. chain: the tree will be a chain
        grown by `add_chain_child` alone (node i the only child of node i - 1), at most
        `capacity` nodes: every node's parent, depth and ancestor row are laid out up front.
        workspace: where the node buffers live across steps (`specdec.drafting.levels`: a
        captured level reads and writes them at the same addresses every step), keyed by
        layout; None: fresh buffers each step. With a workspace, the last step's tree (its
        tokens, the draft source's views of them) is overwritten once this builder has made
        the root's forward: nothing may read it later."""
        self.source = source
        self.ctx = ctx
        self.device = dev = roots.device
        b = roots.shape[0]
        cap = max(2, capacity)
        self.chain = chain
        self._n = 1  # nodes so far (the root), columns skipped over included (`skip_to`)
        self._added = 1  # nodes added so far (the root): `_n` less the skipped columns
        self._last = (0, 1)  # columns of the nodes the last `add` appended
        # each buffer is one copy of a shared initial layout (`_initial_buffers`), then the roots
        # the root's forward first: with a workspace, what the source still holds of the last
        # step's tree (a chain's pending leaf is a view of its tokens) is read before it is overwritten
        self.root_logprobs = source.begin_step(roots, ctx.params)  # [B, V]
        layout = _initial_buffers(b, cap, chain, dev)
        if workspace is None:
            self._ints, self._floats, self._flags, self._anc = (t.clone() for t in layout)
        else:  # the same addresses every step: copy the layout in
            self._ints, self._floats, self._flags, self._anc = (_workspace_buffer(workspace, ("tree_builder", i, b, cap, chain), t) for i, t in enumerate(layout))
        self._ints[:, _TOKEN, 0] = roots
        if ctx.host_active is None or not all(ctx.host_active):  # finished rows: nothing grows under their roots
            self._floats[:, _CUM:, 0].masked_fill_(~ctx.active[:, None], float("-inf"))
        self.levels = 0
        """nodes added by `add` calls so far bound every node's depth (each add is one level deeper at most)"""
        self.max_children = 0
        """the most children any `add` may have given one parent (`TokenTree.max_children`)"""
        self._any_sampled = False
        """a node drawn from its parent's draft distribution was added (else the sampled flags are all False)"""
        self.keep_draft_probs = keep_draft_probs
        # kept draft distributions, stored compactly: only expanded nodes have one. Chunk i is
        # the [B, m_i, V] output of the i-th draft forward (chunk 0: the root's); _dist_slot[b, j]
        # is node j's row in the chunks concatenated along dim 1 (0 for nodes never expanded)
        self._dist_chunks: list[torch.Tensor] = []
        self._dist_slot: torch.Tensor | None = None  # [B, cap] int64 when kept
        self._dist_rows = 0
        if keep_draft_probs:
            self._dist_chunks.append(self.root_logprobs[:, None, :])
            if not chain:  # a chain's chunk i is node i's (every node but the last is expanded, in order)
                self._dist_slot = _zeros(workspace, ("dist_slot", b, cap), (b, cap), dev)
            self._dist_rows = 1
        self.draft_forwards = 1

    # ----- views of the nodes so far ([B, N]) ------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self._n

    @property
    def nodes_added(self) -> int:
        """nodes added so far, the root's and invalid ones included: `num_nodes` less the columns
        `skip_to` passed over (the most nodes a selection can keep)"""
        return self._added

    @property
    def capacity(self) -> int:
        """nodes the buffers hold before they grow"""
        return self._ints.shape[2]

    @property
    def batch_size(self) -> int:
        return self._ints.shape[0]

    @property
    def tokens(self) -> torch.Tensor:
        return self._ints[:, _TOKEN, : self._n]

    @property
    def parents(self) -> torch.Tensor:
        """[B, N] parent of each node (-1 for the root; invalid nodes: the node they were proposed under)"""
        return self._ints[:, _PARENT, : self._n]

    @property
    def depths(self) -> torch.Tensor:
        return self._ints[:, _DEPTH, : self._n]

    @property
    def logq(self) -> torch.Tensor:
        """[B, N] draft log-prob of each node's token under its parent (-inf for invalid nodes)"""
        return self._floats[:, _LOGQ, : self._n]

    @property
    def cum_logq(self) -> torch.Tensor:
        """[B, N] path draft log-prob (-inf for invalid nodes and for the roots of finished rows)"""
        return self._floats[:, _CUM, : self._n]

    @property
    def valid(self) -> torch.Tensor:
        return self._flags[:, _VALID, : self._n]

    @property
    def root(self) -> torch.Tensor:
        """[B, 1] int64 the root's index (0), read-only: the frontier of the first level"""
        return constants.full((self.batch_size, 1), 0, torch.long, self.device)

    @property
    def root_valid(self) -> torch.Tensor:
        """[B, 1] bool True, read-only (a finished row's root has cum_logq -inf: nothing grows under it)"""
        return constants.full((self.batch_size, 1), True, torch.bool, self.device)

    @property
    def last_valid(self) -> torch.Tensor:
        """[B, k] validity of the k nodes the last `add` appended (a view: no op)"""
        start, end = self._last
        return self._flags[:, _VALID, start:end]

    @property
    def score(self) -> torch.Tensor:
        """[B, N] the score tree policies rank nodes by: `cum_logq` for deterministic (top-k)
        nodes, the Gumbel key (see `sample_children`) for sampled ones; -inf for invalid nodes.
        Never larger for a child than for its parent, nor for a later-drawn sampled sibling
        than for an earlier one, so keeping the best n nodes keeps a subtree."""
        return self._floats[:, _SCORE, : self._n]

    @property
    def ancestors(self) -> torch.Tensor:
        """[B, N, N] bool: [b, i, j] when node j is node i or one of its ancestors (an invalid node:
        those of the node it was proposed under, and itself; no valid node descends from it)"""
        return self._anc[:, : self._n, : self._n]

    # ----- growing -----------------------------------------------------------------------
    def _reserve(self, total: int) -> None:
        cap = self._ints.shape[2]
        if total <= cap:
            return
        new = max(total, 2 * cap)
        grow = new - cap

        def pad(t: torch.Tensor, dims: tuple[int, ...], value: float = 0) -> torch.Tensor:
            for dim in dims:
                shape = list(t.shape)
                shape[dim] = grow
                t = torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=dim)
            return t

        self._ints = pad(self._ints, (2,))
        self._floats = pad(self._floats, (2,), float("-inf"))
        self._flags = pad(self._flags, (2,))
        self._anc = pad(self._anc, (1, 2))
        torch.diagonal(self._anc, dim1=1, dim2=2)[:, cap:].fill_(True)
        if self._dist_slot is not None:
            self._dist_slot = pad(self._dist_slot, (1,))

    def skip_to(self, column: int) -> None:
        """Let the next `add` start at builder column `column` (>= `num_nodes`, within the
        capacity): the columns passed over stay invalid nodes (score and log-probs -inf, their
        own ancestors only), which every selection and count already ignores (`nodes_added` does
        not count them). No tensor op. A
        captured level placed at a column fixed by its level alone, whatever the widths of the
        levels before it, keeps one graph key per level shape (`CapturedLevels.place`). The
        last add's columns are forgotten (`last_valid` is empty until the next add)."""
        if column < self._n or column > self.capacity:
            raise ValueError(f"skip_to({column}) needs num_nodes {self._n} <= column <= capacity {self.capacity}")
        self._n = column
        self._last = (column, column)

    def add(
        self,
        parents: torch.Tensor,
        tokens: torch.Tensor,
        logq: torch.Tensor,
        valid: torch.Tensor | None,
        sampled: bool | torch.Tensor = False,
        score: torch.Tensor | None = None,
        depth: int | None = None,
        children_per_parent: int | None = None,
    ) -> torch.Tensor:
        """Append k candidate nodes per row; returns their indices [B, k] (`last_valid` is their validity).

        parents: [B, k] int64 indices of existing nodes (>= 0; entries of invalid nodes may be
        any existing node); tokens: [B, k]; logq: [B, k] draft log-prob of each token under its
        parent's distribution; valid: [B, k] bool, or None (no entry is padding). A node is
        valid only if its parent is, its row is active and its logq is finite.
        sampled: the nodes were drawn from their parent's draft distribution (bool or [B, k]).
        score: [B, k] their ranking score (`score`; the Gumbel keys of `sample_children`);
        None = their cum_logq. depth: as in `add_children`. children_per_parent: the most entries
        that share one parent (the k of `draw_children`), known to the caller; None: any number,
        up to k (`TokenTree.max_children` bounds what a device-side verifier loops over).
        `add_children` with one child per entry: 8 to 12 tensor ops whatever k, no host reads.
        """
        self.max_children = max(self.max_children, tokens.shape[1] if children_per_parent is None else children_per_parent)
        # each node is the one child (k = 1) of its own parent entry: [B, k] -> [B, k, 1] views
        return self.add_children(
            parents,
            None if valid is None else valid[:, :, None],
            tokens[:, :, None],
            logq[:, :, None],
            sampled=sampled[:, :, None] if isinstance(sampled, torch.Tensor) else sampled,
            score=None if score is None else score[:, :, None],
            depth=depth,
        )

    def add_children(
        self,
        nodes: torch.Tensor,
        valid: torch.Tensor,
        tokens: torch.Tensor,
        logq: torch.Tensor,
        sampled: bool | torch.Tensor = False,
        score: torch.Tensor | None = None,
        min_cum_logq: float = float("-inf"),
        depth: int | None = None,
    ) -> torch.Tensor:
        """Append k children under each of m nodes per row, node-major (the children of
        nodes[:, 0] first); returns their indices [B, m*k]. The same nodes as
        `add(parents=nodes repeated k times, ...)` with the parents' fields gathered once per
        parent and broadcast, not copied k times (8 tensor ops whatever m and k with `valid`
        None and `depth` given, 11 with both, one more for drawn children; the validity is
        computed straight into the flags buffer).

        nodes: [B, m] int64 existing nodes; valid: [B, m] bool (False: no children under that
        entry), [B, m, k] (per child), or None: every entry may have children (an invalid
        node has cum_logq -inf, so its children are invalid anyway: pass None when `nodes` are
        builder nodes and no entry is padding); tokens, logq: [B, m, k]; sampled: bool or
        [B, m, k] (as in `add`); score: [B, m, k] or None (= their cum_logq). min_cum_logq:
        children whose path log-prob is below it are invalid (probability-threshold pruning at
        no extra op). depth: the children's depth when every entry of `nodes` is at depth - 1
        (a level-by-level policy knows it), else None (read from the parents).
        """
        if self.chain:
            raise RuntimeError("a builder made with chain=True grows by add_chain_child only (its ancestor rows are laid out up front)")
        b, m, k = tokens.shape
        start, end = self._n, self._n + m * k
        self.max_children = max(self.max_children, k)
        self._reserve(end)
        cum = self._floats[:, _CUM].gather(1, nodes)[:, :, None] + logq  # [B, m, k]
        flags = self._flags[:, :, start:end].view(b, 2, m, k)
        child_valid = flags[:, _VALID]  # [B, m, k], written in place
        if min_cum_logq > float("-inf"):
            torch.ge(cum, min_cum_logq, out=child_valid)
        else:
            torch.gt(cum, float("-inf"), out=child_valid)
        if valid is not None:
            child_valid.logical_and_(valid if valid.dim() == 3 else valid[:, :, None])
        floats = self._floats[:, :, start:end].view(b, 3, m, k)  # written in place, -inf at invalid children
        neg_inf = constants.full((), float("-inf"), floats.dtype, self.device)
        torch.where(child_valid[:, None], torch.stack([logq, cum, cum if score is None else score], dim=1), neg_inf, out=floats)
        if depth is None:
            depths = self._ints[:, _DEPTH].gather(1, nodes).add_(1)[:, :, None].expand(b, m, k)
        else:
            depths = constants.full((1, 1, 1), depth, torch.long, self.device).expand(b, m, k)
        torch.stack([tokens, nodes[:, :, None].expand(b, m, k), depths], dim=1, out=self._ints[:, :, start:end].view(b, 3, m, k))
        if isinstance(sampled, torch.Tensor):
            torch.logical_and(sampled, child_valid, out=flags[:, _SAMPLED])
            self._any_sampled = True
        elif sampled:
            flags[:, _SAMPLED] = child_valid
            self._any_sampled = True
        cap = self._anc.shape[2]
        parent_rows = self._anc.gather(1, nodes[:, :, None].expand(b, m, cap))  # [B, m, cap]
        self._anc[:, start:end].view(b, m, k, cap).logical_or_(parent_rows[:, :, None, :])
        self._n = end
        self._added += m * k
        self._last = (start, end)
        self.levels += 1
        return constants.arange(end, self.device)[start:end].expand(b, m * k)

    def add_chain_child(self, tokens: torch.Tensor, logq: torch.Tensor, sampled: bool = False) -> torch.Tensor:
        """Append one node per row, the only child of the newest node, in a builder made with
        `chain=True` (its parent, depth and ancestors are laid out already): 5 tensor ops,
        against `add`'s 10. tokens, logq: [B, 1] (logq the token's draft log-prob under its
        parent's distribution); sampled: as in `add`. A node is valid when its parent is and
        its logq is finite. Returns its index [B, 1] (`last_valid` is its validity)."""
        if not self.chain:
            raise RuntimeError("add_chain_child needs a builder made with chain=True")
        parent, node = self._n - 1, self._n
        if node >= self._ints.shape[2]:
            raise RuntimeError(f"a chain builder of capacity {self._ints.shape[2]} is full")
        b = tokens.shape[0]
        cum = self._floats[:, _CUM, parent : parent + 1] + logq  # [B, 1]
        if sampled:  # the valid and sampled flags at once: [B, 2, 1]
            torch.gt(cum[:, None].expand(b, 2, 1), float("-inf"), out=self._flags[:, :, node : node + 1])
            self._any_sampled = True
        else:
            torch.gt(cum, float("-inf"), out=self._flags[:, _VALID, node : node + 1])
        valid = self._flags[:, _VALID, node : node + 1]  # [B, 1]
        neg_inf = constants.full((), float("-inf"), cum.dtype, self.device)
        torch.where(valid[:, None], torch.stack([logq, cum, cum], dim=1), neg_inf, out=self._floats[:, :, node : node + 1])
        self._ints[:, _TOKEN, node : node + 1] = tokens
        self.max_children = 1
        self._n = node + 1
        self._added += 1
        self._last = (node, node + 1)
        self.levels += 1
        return constants.arange(node + 1, self.device)[node:].expand(tokens.shape[0], 1)

    def add_top_children(self, nodes: torch.Tensor, logprobs: torch.Tensor, k: int, valid: torch.Tensor | None, depth: int | None = None) -> torch.Tensor:
        """Append the k most likely children of each node [B, m] (distributions logprobs
        [B, m, V], valid [B, m] or None, depth as in `add_children`) with `add_children`;
        returns their indices [B, m*k]."""
        top = torch.topk(logprobs, k, dim=-1)  # [B, m, k]
        return self.add_children(nodes, valid, top.indices, top.values, depth=depth)

    def expand(self, nodes: torch.Tensor, valid: torch.Tensor, depth: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """One draft forward over `nodes` [B, k]; returns their children's draft
        log-distributions [B, k, V].

        valid: [B, k] bool, False for padding entries and for every invalid node (callers pass
        `last_valid` or `valid.gather(1, nodes)`); the outputs of invalid entries are ignored.
        depth: the nodes' depth when they all share one (a level-by-level policy), else None.
        out: [B, k, V] where to write them (a captured level's output buffer, which is then
        also what the builder keeps of them), or None."""
        batch = NodeBatch(nodes=nodes, valid=valid, tokens=self.tokens, depths=self.depths, ancestors=self.ancestors, depth=depth, chain=self.chain)
        logprobs = self.source.expand(batch, self.ctx.params)
        if out is not None:
            logprobs = out.copy_(logprobs)
        self.draft_forwards += 1
        if self.chain and self.keep_draft_probs:
            self._dist_chunks.append(logprobs)
        elif self._dist_slot is not None:
            k = nodes.shape[1]
            rows = constants.arange(self._dist_rows + k, self.device)[self._dist_rows :].expand_as(nodes)
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
        if m == 1:  # a single parent: its columns broadcast (no copy)
            return nodes.expand(b, k), top.indices.reshape(b, k), top.values.reshape(b, k), valid.expand(b, k)
        return nodes.repeat_interleave(k, dim=1), top.indices.reshape(b, m * k), top.values.reshape(b, m * k), valid.repeat_interleave(k, dim=1)

    def draw_children(
        self, nodes: torch.Tensor, logprobs: torch.Tensor, k: int, valid: torch.Tensor, uniforms: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`sample_children` without the Gumbel keys, for policies that value drawn children by
        their own token-free rule (EAGLE-2's positional rates, CAST's values): (parents, tokens,
        logq, valid), each [B, m*k]."""
        parents, tokens, logq, child_valid, _ = self._draw(nodes, logprobs, k, valid, uniforms)
        return parents, tokens.reshape(parents.shape), logq.reshape(parents.shape), child_valid

    def sample_children(
        self, nodes: torch.Tensor, logprobs: torch.Tensor, k: int, valid: torch.Tensor, uniforms: torch.Tensor | None = None
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
        sampling params); valid: [B, m]. Draws from `ctx.generator`, or reads the draw's U(0, 1)
        numbers from `uniforms` [B, m, V] (left as they are; a captured level's buffer, filled
        before each replay). Tokens outside the
        distribution's support (fewer than k) come back with logq -inf: `add` drops them.
        Returns (parents, tokens, logq, valid, keys), each [B, m*k]; pass keys to `add(score=...)`.
        """
        b, m, _ = logprobs.shape
        parents, tokens, logq, child_valid, perturbed = self._draw(nodes, logprobs, k, valid, uniforms)
        safe = nodes.clamp(min=0)
        parent_key = self.score.gather(1, safe)[:, :, None]  # [B, m, 1]
        parent_cum = self.cum_logq.gather(1, safe)[:, :, None]  # [B, m, 1]
        # key = -log(exp(-T) - exp(-Z) + exp(-G)) with T the parent's key, G = parent_cum + perturbed
        # the child's perturbed path log-prob and Z the largest G (the first draw); in the stable
        # form of Kool et al. (Appendix B): w = T - G + log(1 - exp(G - Z)), key = T - relu(w) - log1p(exp(-|w|))
        w = parent_key - parent_cum - perturbed + _log1mexp(perturbed - perturbed[..., :1])  # -inf for the first draw
        key = parent_key - torch.nn.functional.softplus(w)  # T - log(1 + exp(w)), = T at the first draw
        # a child outside the support (logq -inf: w = +inf) or of an invalid parent (T -inf) has a
        # non-finite key: one test covers both
        ok = valid[:, :, None] & torch.isfinite(key)
        key = torch.where(ok, key, float("-inf")).cummin(dim=-1).values  # monotone in draw order despite rounding
        return parents, tokens.reshape(b, m * k), logq.reshape(b, m * k), child_valid, key.reshape(b, m * k)

    def _draw(
        self, nodes: torch.Tensor, logprobs: torch.Tensor, k: int, valid: torch.Tensor, uniforms: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Gumbel-top-k draw of `sample_children`: parents and valid [B, m*k]; tokens, logq
        and the perturbed log-probs (logq + Gumbel noise) [B, m, k], in draw order."""
        b, m, _ = logprobs.shape
        # -Gumbel noise as log(-log u) (torch's exponential_ is several times slower than rand on CPU)
        if uniforms is None:
            noise = torch.rand(logprobs.shape, generator=self.ctx.generator, device=logprobs.device).log_()
        else:  # read, not overwritten: a captured level runs twice on one fill (warm-up, capture)
            noise = uniforms.log()
        noise = noise.neg_().log_()
        top = torch.topk(torch.sub(logprobs, noise, out=noise), k, dim=-1)  # [B, m, k] logq + Gumbel, in draw order
        logq = logprobs.gather(-1, top.indices)  # [B, m, k]
        parents = nodes[:, :, None].expand(b, m, k).reshape(b, m * k)
        child_valid = valid[:, :, None].expand(b, m, k).reshape(b, m * k)
        return parents, top.indices, logq, child_valid, top.values

    # ----- emitting ------------------------------------------------------------------------
    def finish(self, keep: torch.Tensor | None = None, width: int | None = None, all_valid: bool = False) -> Draft:
        """The step's `Draft`: the TokenTree of the kept nodes and, for each of its nodes, the
        builder index it came from (`Draft.builder_nodes`, [B, N'] int64).

        keep: [B, N] bool, closed under parents, with the root (as `top_by_score` gives);
        None keeps every node as it is (no selection at all). width: N' when keep is given
        (at least the largest kept count; the policy's node budget + 1 reads nothing from
        the device); None = the largest kept count (a host read). all_valid (keep None only):
        the caller knows every node is valid (every row active, every logq finite), so the
        tree is the builder's buffers as they are, with no padding to mask (no op).
        """
        n, b = self._n, self.batch_size
        if keep is not None and self.chain:
            raise RuntimeError("a chain builder's tree is verified whole (finish with keep=None)")
        if keep is None:
            builder_nodes = constants.arange(n, self.device).expand(b, n)
            valid = self.valid
            if all_valid:
                parents, ancestors, logq = self.parents, self.ancestors, self.logq
            else:  # padding nodes: parent -1, only themselves as ancestors, logq 0 (TokenTree's contract)
                invalid = ~valid
                ancestors = self.ancestors.masked_fill(invalid[:, :, None], False)
                torch.diagonal(ancestors, dim1=1, dim2=2).fill_(True)
                parents, logq = self.parents.masked_fill(invalid, -1), self.logq.masked_fill(invalid, 0.0)
            tree = TokenTree(
                tokens=self.tokens,
                parents=parents,
                depths=self.depths,
                logq=logq,
                cum_logq=self.cum_logq,
                valid=valid,
                sampled=self._flags[:, _SAMPLED, :n],
                ancestors=ancestors,
                depth_bound=self.levels,
                max_children=self.max_children,
            )
        else:
            tree, builder_nodes = self._select(keep & self.valid, width)
        if self.chain and self.keep_draft_probs:  # node i's distribution is chunk i; the last node's (never expanded) is the root's, unread
            chunks = self._dist_chunks + self._dist_chunks[:1] * (n - len(self._dist_chunks))
            tree.draft_logprobs = torch.cat(chunks, dim=1) if len(chunks) > 1 else chunks[0]  # [B, N, V]
        elif self._dist_slot is not None:  # only the kept nodes' draft distributions are gathered
            dists = torch.cat(self._dist_chunks, dim=1) if len(self._dist_chunks) > 1 else self._dist_chunks[0]  # [B, S, V]
            slot = self._dist_slot[:, :n].gather(1, builder_nodes)  # [B, N']
            tree.draft_logprobs = dists.gather(1, slot[:, :, None].expand(-1, -1, dists.shape[-1]))
        return Draft(tree, self, builder_nodes)

    def _select(self, keep: torch.Tensor, width: int | None) -> tuple[TokenTree, torch.Tensor]:
        """The TokenTree of the nodes in `keep` [B, N] (closed under parents, root included),
        in creation order, and their builder indices [B, M]; M = width (or the largest kept
        count, a host read). Each packed buffer is gathered once."""
        n, b = self._n, self.batch_size
        m = int(keep.sum(dim=1).max().item()) if width is None else min(width, n)
        cols = constants.arange(2 * n, self.device)
        # kept indices in increasing order first (creation order keeps parents before children), then the dropped ones
        order = torch.argsort(torch.where(keep, cols[:n], cols[n:]), dim=1)[:, :m]  # [B, M]
        ints = self._ints[:, :, :n].gather(2, order[:, None, :].expand(b, 3, m))  # [B, 3, M] token, old parent, depth
        floats = self._floats[:, :, :n].gather(2, order[:, None, :].expand(b, 3, m))  # [B, 3, M] logq, cum_logq, score
        # a kept node's parent is kept: its new index is the number of kept nodes before it;
        # the root's parent (-1) reads the leading 0 of the padded count (0 - 1 = -1)
        before = torch.nn.functional.pad(keep.cumsum(dim=1), (1, 0))  # [B, 1 + N] int64: kept nodes among the first j
        new_valid = cols[:m][None, :] < before[:, n:]  # [B, M]: the kept nodes come first
        dropped = ~new_valid
        new_parents = before.gather(1, ints[:, _PARENT] + 1).sub_(1).masked_fill_(dropped, -1)
        # ancestor rows of kept nodes only name kept nodes (closed under parents), all among the first M columns
        anc = self._anc[:, :n, :n].gather(1, order[:, :, None].expand(b, m, n)).gather(2, order[:, None, :].expand(b, m, m))  # [B, M, M]
        anc.masked_fill_(dropped[:, :, None], False)
        torch.diagonal(anc, dim1=1, dim2=2).fill_(True)  # padding nodes see only themselves
        tree = TokenTree(
            tokens=ints[:, _TOKEN],
            parents=new_parents,
            depths=ints[:, _DEPTH],
            logq=floats[:, _LOGQ].masked_fill(dropped, 0.0),
            cum_logq=floats[:, _CUM],
            valid=new_valid,
            sampled=self._flags[:, _SAMPLED, :n].gather(1, order) & new_valid if self._any_sampled else constants.full((b, m), False, torch.bool, self.device),
            ancestors=anc,
            depth_bound=self.levels,
            max_children=self.max_children,
        )
        return tree, order

    def top_by_score(self, score: torch.Tensor | None, n: int) -> torch.Tensor:
        """Keep mask [B, N] of the root and the n best valid non-root nodes by `score` [B, N]
        (None: the builder's own `score`, already -inf at invalid nodes and largest at the root,
        so it needs no masking: 4 tensor ops).

        With a score that never increases from parent to child (cum_logq, or `score`), ties
        broken towards the earlier node, the kept set is a valid subtree; with `score` it also
        keeps each node's sampled children as a prefix of their draw order.
        """
        if score is None:
            order_key = self.score  # the root's 0 (-inf in a finished row) is the largest: the stable sort puts it first
        else:
            order_key = score.masked_fill(~self.valid, float("-inf"))
            order_key[:, 0] = float("inf")
        b, total = order_key.shape
        # stable sort on descending score: equal scores keep creation order (parents first)
        idx = torch.sort(order_key, dim=1, descending=True, stable=True).indices[:, : n + 1]
        keep = torch.zeros(b, total, dtype=torch.bool, device=self.device).scatter_(1, idx, True)
        return keep & self.valid


_TOKEN, _PARENT, _DEPTH = 0, 1, 2
"""rows of `TreeBuilder._ints`"""
_LOGQ, _CUM, _SCORE = 0, 1, 2
"""rows of `TreeBuilder._floats`"""
_VALID, _SAMPLED = 0, 1
"""rows of `TreeBuilder._flags`"""

def _initial_buffers(b: int, cap: int, chain: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A builder's buffers before its roots are written (`TreeBuilder`'s layout), made once per
    (B, capacity, chain, device) and shared read-only: each step copies them (one op each)
    instead of zero-filling and writing the fixed entries. The root's parent is -1, every
    node its own ancestor and the root valid; the columns after the root are invalid with
    log-probs and score -inf until a node is added there (so a column `skip_to` passes over
    is an invalid node); in a chain, node i's parent is i - 1, its depth i and its ancestors
    the nodes 0..i."""
    key = ("tree_builder", b, cap, chain, device)
    cached = _BUFFERS.get(key)
    if cached is not None:
        return cached
    ints = torch.zeros(b, 3, cap, dtype=torch.long, device=device)
    ints[:, _PARENT, 0] = -1
    anc = torch.eye(cap, dtype=torch.bool, device=device)
    if chain:
        cols = torch.arange(cap, device=device)
        ints[:, _PARENT] = cols - 1
        ints[:, _DEPTH] = cols
        anc = torch.tril(torch.ones(cap, cap, dtype=torch.bool, device=device))
    flags = torch.zeros(b, 2, cap, dtype=torch.bool, device=device)
    flags[:, _VALID, 0] = True
    floats = torch.full((b, 3, cap), float("-inf"), device=device)  # nodes not added yet: -inf, as invalid ones (a skipped column, `skip_to`, stays so)
    floats[:, :, 0] = 0.0  # the root: logq, cum_logq and score 0
    cached = (ints, floats, flags, anc.expand(b, cap, cap))
    if cap * cap > _MAX_CACHED_ANCESTORS:  # a huge tree: its [capacity, capacity] layout is not kept between steps
        return cached
    held = sum(layout[3].shape[-1] ** 2 for layout in _BUFFERS.values())  # bytes of the cached ancestor layouts (bool [cap, cap] each)
    if len(_BUFFERS) >= _MAX_BUFFER_LAYOUTS or held + cap * cap > _MAX_CACHED_ANCESTOR_BYTES:  # batch sizes and capacities vary: keep the cache small
        _BUFFERS.clear()
    _BUFFERS[key] = cached
    return cached


def _zeros(workspace: dict[tuple[object, ...], torch.Tensor] | None, key: tuple[object, ...], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int64 zeros of `shape`: the workspace's buffer for `key` zeroed (made on first use), or a new tensor without a workspace."""
    if workspace is None:
        return torch.zeros(shape, dtype=torch.long, device=device)
    buf = workspace.get(key)
    if buf is None or buf.device != device:
        buf = workspace[key] = torch.empty(shape, dtype=torch.long, device=device)
    return buf.zero_()


def _workspace_buffer(workspace: dict[tuple[object, ...], torch.Tensor], key: tuple[object, ...], layout: torch.Tensor) -> torch.Tensor:
    """The workspace's buffer for `key`, shaped as `layout` (made on first use), with `layout` copied in."""
    buf = workspace.get(key)
    if buf is None or buf.shape != layout.shape or buf.device != layout.device:
        buf = workspace[key] = torch.empty(layout.shape, dtype=layout.dtype, device=layout.device)
    return buf.copy_(layout)


_BUFFERS: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_MAX_BUFFER_LAYOUTS = 64
_MAX_CACHED_ANCESTORS = 1 << 24
"""layouts whose ancestor matrix has more entries (16 MiB of bool; capacity above 4096) are made afresh each step.
CAST's builders reach capacities above 1024 with GPU-like costs (1352 on the bundled pair with an
H200's table, wide layers of top-k children), where a 1 MiB limit remade the layout every step"""

_MAX_CACHED_ANCESTOR_BYTES = 1 << 26
"""all cached layouts' ancestor matrices together (64 MiB): past it the cache starts over"""


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0 (-inf at x = 0, 0 at -inf). One branch, three ops: for x far below
    0 it loses relative accuracy on a result that is itself tiny (absolute error ~1e-7 in float32),
    which no key comparison can see."""
    return torch.log(torch.expm1(x).neg_())
