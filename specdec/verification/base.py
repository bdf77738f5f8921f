"""The accept-rule protocol and its result.

Terms, defined once and used in every name, metric and report:

- **drafted tokens**: the draft tokens of a tree sent to verification (valid nodes except the root).
- **accepted tokens**: drafted tokens on the path the accept rule keeps; `accepted_len` per row.
- **bonus token**: the one token the target adds after the accepted path in every step: the
  target's own choice at the last accepted node (a "correction" when a draft token there was
  rejected, a free extra token when the path ended at a leaf).
- **committed tokens** of a step: accepted tokens + the bonus token (`accepted_len + 1`).
- **relaxed tokens**: accepted tokens that a strict rule would have rejected (MARS only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec import constants
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree


@dataclass
class Verdict:
    """What the accept rule decided for each row of a batch of trees. All tensors, on the
    trees' device: the engine reads them back once per step (`StepResult`)."""

    path: torch.Tensor
    """[B, D] int64 node indices of the accepted path, root excluded, root-to-leaf order;
    entries at and past `accepted_len` are padding (0)"""
    accepted_len: torch.Tensor
    """[B] int64 accepted draft tokens per row"""
    bonus_tokens: torch.Tensor
    """[B] int64: the bonus token of each row"""
    relaxed_count: torch.Tensor
    """[B] int64: accepted tokens accepted only by a relaxed rule (MARS)"""
    fallback_count: torch.Tensor
    """[B] int64: positions where a relaxed rule fell back to strict verification (MARS, z1 <= 0)"""

    @classmethod
    def from_lists(cls, paths: list[list[int]], bonus: list[int], relaxed: list[int], fallbacks: list[int], device: torch.device) -> Verdict:
        """A verdict from per-row host lists (rules that decide on the host)."""
        d = max(1, max((len(p) for p in paths), default=0))
        padded = [p + [0] * (d - len(p)) for p in paths]
        return cls(
            path=torch.tensor(padded, dtype=torch.long, device=device).reshape(len(paths), d),
            accepted_len=torch.tensor([len(p) for p in paths], dtype=torch.long, device=device),
            bonus_tokens=torch.tensor(bonus, dtype=torch.long, device=device),
            relaxed_count=torch.tensor(relaxed, dtype=torch.long, device=device),
            fallback_count=torch.tensor(fallbacks, dtype=torch.long, device=device),
        )

    # host views (each a device read: for tests and tools; the engine reads the step at once)
    @property
    def accepted_nodes(self) -> list[list[int]]:
        """per row: node indices of the accepted path, root excluded"""
        return [p[:n] for p, n in zip(self.path.tolist(), self.accepted_len.tolist(), strict=True)]

    @property
    def relaxed(self) -> list[int]:
        return self.relaxed_count.tolist()

    @property
    def strict_fallbacks(self) -> list[int]:
        return self.fallback_count.tolist()


def deepest_path(tree: TokenTree, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accepted path of a greedy-style rule: the deepest node whose path is all `ok`.

    ok: [B, N] bool, a node is the child its parent's rule would accept (root True). At most
    one child per node may be ok, so the deepest all-ok path is unique.
    Returns (deepest [B] node index, on_path [B, N] bool (root..deepest), path [B, D] node
    indices root excluded padded with 0, accepted_len [B]), D = max(1, `tree.depth_limit()`).
    Example: parents [-1, 0, 0, 1], ok [T, T, F, T] -> deepest 3, path [1, 3], accepted_len 2.
    """
    b, n = tree.tokens.shape
    if tree.chain and n > 1:  # node i is the only child of node i - 1: the accepted path is the leading run of ok nodes
        run = (ok[:, 1:] & tree.valid[:, 1:]).cumprod(dim=1)  # [B, N - 1] int64: 1 while every node so far is ok
        accepted_len = run.sum(dim=1)  # [B], = the deepest node's index
        cols = constants.arange(n, ok.device)
        on_path = cols[None, :] <= accepted_len[:, None]  # [B, N]
        path = torch.where(on_path[:, 1:], cols[1:], 0)  # [B, N - 1], padded with 0
        return accepted_len, on_path, path, accepted_len
    anc = tree.ancestor_mask()  # [B, N, N]
    # a node is on an all-ok path when no non-root node on its way is bad (invalid nodes are
    # bad: their ancestor row holds only themselves); the root is always ok
    bad = ~(ok & tree.valid)  # [B, N]
    path_bad = (anc[:, :, 1:] & bad[:, None, 1:]).any(dim=2)  # [B, N]
    accepted_len, deepest = tree.depths.masked_fill(path_bad, -1).max(dim=1)  # [B] each: the deepest all-ok node
    on_path = anc.gather(1, deepest[:, None, None].expand(b, 1, n)).squeeze(1)  # [B, N] root..deepest
    d = min(tree.depth_limit(), n - 1)
    if d == 0:  # a root-only tree: one padding column, so every path tensor has a column to gather from
        return deepest, on_path, torch.zeros(b, 1, dtype=torch.long, device=ok.device), accepted_len
    # the path's node at depth j goes to column j (the root to column 0); other nodes to a spare column d + 1
    column = tree.depths.masked_fill(~on_path, d + 1)  # [B, N]
    path = torch.zeros(b, d + 2, dtype=torch.long, device=ok.device).scatter_(1, column, constants.arange(n, ok.device).expand(b, n))[:, 1 : d + 1]  # [B, D]
    return deepest, on_path, path, accepted_len


class AcceptRule(Protocol):
    """Given target logits at every tree node, choose the accepted path and the bonus token."""

    name: str

    def verify(
        self,
        tree: TokenTree,
        target_logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Verdict:
        """tree: B rows of N nodes; target_logits: [B, N, V] float32, the target's logits at each
        node (its distribution over that node's children)."""
        ...
