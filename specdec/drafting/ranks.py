"""Positional acceptance of sampled children, learned from verdicts.

When a node's children are drawn from the draft distribution (`TreeBuilder.sample_children`),
whether the target accepts the r-th draw depends mostly on r: the first draw is accepted
with probability sum_v min(target_probs, draft_probs)(v) (about 0.65 at T = 1 on the bundled
pair), a second draw only when the first was rejected and then against the residual (about
0.12 unconditionally), and so on. Sequoia (Chen et al. 2024) builds its trees from this
*positional acceptance vector*; `RankAcceptance` estimates it online:

    rate[r] = P(the r-th drawn child of a node is accepted | the node was reached)

Each verified node whose parent was reached (the root, or a node on the accepted path) is
one observation of its sibling rank r (1-based, tree order: for sampled trees the draw
order) and whether it was accepted. Counts decay exponentially and start from a prior of
`prior_weight` pseudo-observations per rank; the rates are made non-increasing in r.

A node's value is then the sum of log rates along its path: the estimated probability that
the node is reached and accepted. It depends on ranks only, never on a drawn token, which is
what keeps ranking and pruning sampled children exact (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

DEFAULT_PRIOR = (0.6, 0.12, 0.05, 0.02)
"""prior rates per rank (the last one repeats): roughly the bundled pair's at T = 1"""


def sibling_ranks(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, N] int64 1-based rank of each node among its valid siblings, in tree order (0 for the
    root and padding). parents, valid: [B, N] (a TokenTree's).
    Example: parents [-1, 0, 0, 1, 0] -> ranks [0, 1, 2, 1, 3]."""
    n = parents.shape[1]
    real = valid & (parents >= 0)  # [B, N]
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)  # [i, j]: j < i
    same = (parents[:, :, None] == parents[:, None, :]) & real[:, None, :] & earlier  # [B, N, N] j is an earlier sibling of i
    return torch.where(real, same.sum(dim=2) + 1, 0)


class RankAcceptance:
    """Learned positional acceptance rates of sampled children (see the module docstring)."""

    def __init__(self, ranks: int = 8, prior: Sequence[float] = DEFAULT_PRIOR, prior_weight: float = 20.0, decay: float = 0.998) -> None:
        if ranks < 1 or not prior or prior_weight <= 0 or not 0 < decay <= 1:
            raise ValueError(f"RankAcceptance needs ranks >= 1, a prior, prior_weight > 0 and 0 < decay <= 1 (got {ranks}, {prior}, {prior_weight}, {decay})")
        self.ranks, self.prior_weight, self.decay = ranks, prior_weight, decay
        self.prior = np.array([prior[min(r, len(prior) - 1)] for r in range(ranks)], dtype=np.float64)
        self.seen = np.zeros(ranks)
        self.hits = np.zeros(ranks)
        self.observations = 0

    def rates(self) -> np.ndarray:
        """[ranks] rate per rank (1-based rank r at index r - 1), non-increasing, in [1e-4, 1 - 1e-6]."""
        raw = (self.hits + self.prior_weight * self.prior) / (self.seen + self.prior_weight)
        return np.clip(np.minimum.accumulate(raw), 1e-4, 1 - 1e-6)

    def log_rates(self, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[k] float32 log rate of ranks 1..k (ranks past `ranks` take the last rate)."""
        rates = self.rates()
        return torch.tensor(np.log(rates[np.minimum(np.arange(k), self.ranks - 1)]), dtype=torch.float32, device=device)

    def observe(self, tree_parents: Sequence[Sequence[int]], accepted_nodes: Sequence[Sequence[int]], active: Sequence[bool]) -> None:
        """One step's verdict on a tree, all on the host (no device read): tree_parents: per row,
        each verified node's parent, -1 for the root and padding (`StepRecord.tree_parents`, read
        with the verdict); accepted_nodes: per row, the accepted path's node indices; active: per row."""
        parents = np.array([list(p) for p in tree_parents], dtype=np.int64).reshape(len(tree_parents), -1)  # [B, N] host (numpy: no device op)
        b, n = parents.shape
        valid = parents >= 0  # the root has no parent and is never an observation
        on_path = np.zeros((b, n), dtype=np.bool_)
        for row, path in enumerate(accepted_nodes):
            if active[row] and path:
                on_path[row, list(path)] = True
        reached = on_path.copy()
        reached[:, 0] = True
        parent_reached = np.take_along_axis(reached, np.maximum(parents, 0), axis=1) & valid
        observed = parent_reached & np.asarray(active, dtype=np.bool_)[:, None]  # [B, N]
        earlier = np.tril(np.ones((n, n), dtype=np.bool_), -1)  # [i, j]: j < i
        siblings = (parents[:, :, None] == parents[:, None, :]) & valid[:, None, :] & earlier  # [B, N, N] j is an earlier sibling of i
        rank = np.minimum(siblings.sum(axis=2)[observed], self.ranks - 1)  # 0-based sibling rank (`sibling_ranks` - 1)
        if rank.size == 0:
            return
        hit = on_path[observed].astype(float)
        factor = self.decay**rank.size
        self.seen = self.seen * factor + np.bincount(rank, minlength=self.ranks)
        self.hits = self.hits * factor + np.bincount(rank, weights=hit, minlength=self.ranks)
        self.observations += int(rank.size)
