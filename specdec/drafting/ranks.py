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


def sibling_ranks(tree_parents: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per row, the 1-based rank of each node among its valid siblings, in tree order (0 for the
    root and padding). tree_parents: per row, each node's parent, -1 for the root and padding
    (`StepRecord.tree_parents`; host lists, no device op).
    Example: parents [-1, 0, 0, 1, 0] -> ranks [0, 1, 2, 1, 3]."""
    out = []
    for parents in tree_parents:
        seen: dict[int, int] = {}
        ranks = []
        for parent in parents:
            if parent < 0:
                ranks.append(0)
            else:
                seen[parent] = seen.get(parent, 0) + 1
                ranks.append(seen[parent])
        out.append(ranks)
    return out


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
        observed_ranks: list[int] = []  # 0-based, capped at the last tracked rank
        hits: list[float] = []
        for row, (parents, ranks) in enumerate(zip(tree_parents, sibling_ranks(tree_parents), strict=True)):
            if not active[row]:
                continue
            reached = {0, *accepted_nodes[row]}  # the root and the accepted path
            for node, (parent, rank) in enumerate(zip(parents, ranks, strict=True)):
                if parent >= 0 and parent in reached:  # a verified node whose parent was reached
                    observed_ranks.append(min(rank, self.ranks) - 1)
                    hits.append(float(node in reached))
        if not observed_ranks:
            return
        rank = np.asarray(observed_ranks, dtype=np.int64)
        hit = np.asarray(hits)
        factor = self.decay**rank.size
        self.seen = self.seen * factor + np.bincount(rank, minlength=self.ranks)
        self.hits = self.hits * factor + np.bincount(rank, weights=hit, minlength=self.ranks)
        self.observations += int(rank.size)
