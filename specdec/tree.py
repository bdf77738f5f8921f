"""TokenTree: a batch of draft trees as tensors, in BFS order.

Node 0 of every row is the root: the last committed token, which neither model has
cached yet. Every other node is a draft token; its parent precedes it (BFS order), so
`parents[b, i] < i` for every valid non-root node. A chain is a tree whose nodes have
at most one child. Rows of a batch may hold different numbers of nodes: the missing
ones are padding (`valid == False`), never attended to and never accepted.

Example (one row, root r with children a, b; a has child c):

    index   0  1  2  3
    tokens  r  a  b  c
    parents -1 0  0  1
    depths  0  1  1  2

    ancestor_mask (row attends to column):   paths (root-to-leaf): [0, 1, 3], [0, 2]
      r: r
      a: r a
      b: r . b
      c: r a . c
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdec import constants


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices from the root to `node` inclusive, following `parents` (-1 ends the walk)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@dataclass
class TokenTree:
    """A batch of draft trees. All tensors share the leading shape [B, N]."""

    tokens: torch.Tensor
    """[B, N] int64 token ids; node 0 is the root"""
    parents: torch.Tensor
    """[B, N] int64 parent node index; -1 for the root and for padding"""
    depths: torch.Tensor
    """[B, N] int64 depth; the root is 0"""
    logq: torch.Tensor
    """[B, N] float32 draft log-prob of the node's token given its parent's path (0 for the root)"""
    cum_logq: torch.Tensor
    """[B, N] float32 sum of logq along the root-to-node path (the path's draft log-probability)"""
    valid: torch.Tensor
    """[B, N] bool; False for padding nodes"""
    sampled: torch.Tensor
    """[B, N] bool; True when the node's token was drawn at random from its parent's draft
    distribution (without replacement among sampled siblings); False when it was chosen
    deterministically (top-k). Sampling verification uses the draft distribution as the
    proposal of a sampled node and a point mass for a deterministic one; both are lossless."""
    draft_logprobs: torch.Tensor | None = None
    """[B, N, V] float32 draft log-distribution over the children of each node, kept only when
    some node is `sampled` (rows of nodes without sampled children are unspecified)"""
    ancestors: torch.Tensor | None = None
    """[B, N, N] bool ancestor mask (see `ancestor_mask`) when the builder kept it; computed on demand otherwise"""
    depth_bound: int | None = None
    """an upper bound on the depth of any valid node known without reading the device (the
    levels the builder drafted); None = read it from `depths`"""
    max_children: int | None = None
    """an upper bound on any node's valid children known without reading the device (the most
    children the builder proposed per parent); None = read it when needed (`children_bound`)"""
    chain: bool = False
    """known on the host: node i > 0 of every row is the only child of node i - 1 (a chain;
    rows may end early with invalid nodes). Lets rules take tensor-only fast paths."""
    verify_plan: Any = None
    """what the accept rule prepared from the tree before the verify forward was launched
    (`SamplingRule.prepare`: traversal's round count on its way to the host), or None"""

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        """N: nodes per row including padding."""
        return self.tokens.shape[1]

    def nodes_per_row(self) -> torch.Tensor:
        """[B] number of valid nodes (root included)."""
        return self.valid.sum(dim=1)

    def drafted_per_row(self) -> torch.Tensor:
        """[B] number of draft tokens sent to verification (valid nodes minus the root)."""
        return self.nodes_per_row() - 1

    @classmethod
    def root_only(cls, roots: torch.Tensor) -> TokenTree:
        """A tree holding only the root of each row. roots: [B] int64."""
        b, dev = roots.shape[0], roots.device
        zero_f = constants.full((b, 1), 0.0, torch.float32, dev)
        fields = {  # shared read-only constants, like every TokenTree's fields
            "parents": constants.full((b, 1), -1, torch.long, dev),
            "depths": constants.full((b, 1), 0, torch.long, dev),
            "logq": zero_f,
            "cum_logq": zero_f,
            "valid": constants.full((b, 1), True, torch.bool, dev),
            "sampled": constants.full((b, 1), False, torch.bool, dev),
            "ancestors": constants.full((b, 1, 1), True, torch.bool, dev),
        }
        return cls(tokens=roots[:, None], depth_bound=0, max_children=0, **fields)

    def max_depth(self) -> int:
        """Depth of the deepest valid node (a host read)."""
        return int(self.depths.masked_fill(~self.valid, 0).max().item())

    def depth_limit(self) -> int:
        """`depth_bound` when known (no device read), else `max_depth()`."""
        return self.depth_bound if self.depth_bound is not None else self.max_depth()

    def sibling_ranks(self) -> torch.Tensor:
        """[B, N] int64: each valid non-root node's position among its parent's valid children in
        tree order (0 for the first child), -1 at the root and padding. No host read (the host,
        1-based counterpart over recorded parents is `specdec.drafting.ranks.sibling_ranks`).
        Example: parents [-1, 0, 0, 1, 0] -> ranks [-1, 0, 1, 0, 2]."""
        n = self.parents.shape[1]
        cols = constants.arange(n, self.parents.device)
        is_child = self.valid & (self.parents >= 0)  # [B, N]
        earlier = cols[None, :, None] > cols[None, None, :]  # [1, N, N]: column j comes before row i
        siblings = (self.parents[:, :, None] == self.parents[:, None, :]) & is_child[:, None, :] & earlier  # [B, N, N]
        return siblings.sum(dim=2).masked_fill_(~is_child, -1)

    def children_bound(self, ranks: torch.Tensor | None = None) -> int:
        """`max_children` when known (no device read), else the most valid children of any node
        (a host read of `sibling_ranks`, or of `ranks` when given)."""
        if self.max_children is not None:
            return self.max_children
        ranks = self.sibling_ranks() if ranks is None else ranks
        return int(ranks.max().item()) + 1

    def ancestor_mask(self) -> torch.Tensor:
        """[B, N, N] bool: [b, i, j] is True when node j is node i itself or one of its ancestors.

        Padding nodes see only themselves (so attention over them stays finite) and are
        seen by nobody else. Computed once per tree (the verify forward and the accept rule
        both need it); a TokenTree is not modified after it is built.
        """
        if self.ancestors is None:
            self.ancestors = self._build_ancestor_mask()
        return self.ancestors

    def _build_ancestor_mask(self) -> torch.Tensor:
        b, n = self.tokens.shape
        eye = torch.eye(n, dtype=torch.bool, device=self.tokens.device).expand(b, n, n)
        mask = eye.clone()
        cursor = self.parents.masked_fill(~self.valid, -1)  # [B, N] current ancestor of each node
        rows = torch.arange(b, device=self.tokens.device)[:, None]
        cols = torch.arange(n, device=self.tokens.device)[None, :]
        for _ in range(self.max_depth()):
            has = cursor >= 0
            if not has.any():
                break
            safe = cursor.clamp(min=0)
            mask[rows.expand(b, n)[has], cols.expand(b, n)[has], safe[has]] = True
            cursor = torch.where(has, self.parents.gather(1, safe), cursor)
        return mask

    def children(self, row: int, node: int) -> list[int]:
        """Indices of the valid children of `node` in `row`, in tree order."""
        hits = ((self.parents[row] == node) & self.valid[row]).nonzero().flatten()
        return hits.tolist()

    def path_to(self, row: int, node: int) -> list[int]:
        """Node indices from the root to `node` inclusive, e.g. [0, 1, 3] for node 3 above."""
        return path_to(self.parents[row].tolist(), node)

    def leaf_paths(self, row: int) -> list[list[int]]:
        """Every root-to-leaf path of `row`."""
        valid = self.valid[row].tolist()
        parents = self.parents[row].tolist()
        has_child = {p for p, v in zip(parents, valid, strict=True) if v and p >= 0}
        return [self.path_to(row, i) for i in range(len(valid)) if valid[i] and i not in has_child]

    def select(self, keep: torch.Tensor) -> TokenTree:
        """The subtree of nodes with keep[b, i] True, re-indexed and padded to a common size.

        keep: [B, N] bool; must contain the root and be closed under taking parents
        (a valid subtree; checked, a ValueError otherwise). BFS order is preserved because
        node order is preserved.
        """
        tree = self.select_with_origin(keep)[0]
        tree.check_closed()
        return tree

    def select_with_origin(self, keep: torch.Tensor, width: int | None = None) -> tuple[TokenTree, torch.Tensor]:
        """`select`, plus each new node's index in this tree ([B, M] int64; padding columns
        point at some dropped node).

        width: M, the number of node columns of the result (at least the largest kept count;
        extra columns are padding). None = the largest kept count (a host read); a policy
        that knows its budget passes it, so selecting reads nothing from the device.
        Example: keep [[T, T, F, T]] -> nodes [0, 1, 3] of this tree, origin [[0, 1, 3]].
        """
        keep = keep & self.valid
        b, n = keep.shape
        dev = keep.device
        counts = keep.sum(dim=1)  # [B]
        m = int(counts.max().item()) if width is None else min(width, n)
        cols = torch.arange(n, device=dev)
        # order[b, :counts[b]] are the kept indices in increasing order, then the dropped ones
        order = torch.argsort(torch.where(keep, cols, cols + n), dim=1)[:, :m]  # [B, M]
        new_valid = keep.gather(1, order)  # [B, M] (kept nodes come first)
        # old index -> new index (-1 for dropped nodes)
        remap = torch.full((b, n), -1, dtype=torch.long, device=dev).scatter_(1, order, torch.arange(m, device=dev).expand(b, m))
        remap = remap.masked_fill(~keep, -1)
        old_parents = self.parents.gather(1, order)
        new_parents = remap.gather(1, old_parents.clamp(min=0)).masked_fill((old_parents < 0) | ~new_valid, -1)

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.gather(1, order)

        draft_logprobs = None
        if self.draft_logprobs is not None:
            draft_logprobs = self.draft_logprobs.gather(1, order[:, :, None].expand(b, m, self.draft_logprobs.shape[-1]))
        ancestors = None
        if self.ancestors is not None:
            rows = self.ancestors.gather(1, order[:, :, None].expand(b, m, n))  # [B, M, N]
            ancestors = rows.gather(2, order[:, None, :].expand(b, m, m)) & (new_valid[:, None, :] & new_valid[:, :, None])  # [B, M, M]
            ancestors |= torch.eye(m, dtype=torch.bool, device=dev)
        tree = TokenTree(
            tokens=take(self.tokens),
            parents=new_parents,
            depths=take(self.depths),
            logq=take(self.logq),
            cum_logq=take(self.cum_logq),
            valid=new_valid,
            sampled=take(self.sampled) & new_valid,
            draft_logprobs=draft_logprobs,
            ancestors=ancestors,
            depth_bound=self.depth_bound,
            max_children=self.max_children,
        )
        return tree, order

    def check_closed(self) -> None:
        """ValueError unless every valid non-root node's parent is a valid earlier node (a host read; tests and debugging)."""
        b, n = self.parents.shape
        cols = torch.arange(n, device=self.parents.device)
        bad = self.valid & (cols > 0) & ((self.parents < 0) | (self.parents >= cols) | ~self.valid.gather(1, self.parents.clamp(min=0)))
        if bool(bad.any()):
            raise ValueError("TokenTree: a kept node lost its parent (the keep mask is not closed under parents)")
