"""Acceptance calibration: what a draft token's confidence says about its acceptance.

Cost-aware trees (CAST) value a node by v(u), the product of draft probabilities along its
path, as if the draft's confidence were the chance that the target accepts it. Under
lossless sampling that is roughly true; under greedy verification it is not: a token is
accepted when it is the target's argmax, which happens far more often than the draft's
probability of it suggests when the draft spreads its mass (on the bundled pair the
expected accepted length summed from raw confidences is a third of the measured one).

`AcceptanceCalibrator` learns the map from the verifier's verdicts. Each verified node
whose parent was reached (on the accepted path, or the root) is one observation: its local
draft probability q = q_D(token | parent), its rank among its siblings (1 = the draft's
favourite, 2, 3+), and whether the target accepted it. Per rank, q is binned; each bin
holds exponentially decayed counts plus a prior of `prior` pseudo-observations at a mean
that starts at the identity (acceptance = q, the uncalibrated value) and moves to the rank's
pooled acceptance rate as evidence arrives, and the bins' rates are made
non-decreasing in q (pool-adjacent-violators), so a calibrated path value is still never
larger for a child than for its parent. The calibrated path value is the product of the
calibrated local rates along the path.

Calibration only shapes trees; verification is untouched, so outputs stay lossless (each
step's tree depends on past verdicts only, as in DynaTree's history rule).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specdec.isotonic import isotonic

RANK_PRIOR = 10.0
"""pseudo-observations before a rank's pooled rate replaces the identity as its bins' prior"""
REFIT_EVERY = 4
"""the calibrated table is refitted after each of the first REFIT_EVERY updates, then every REFIT_EVERY-th"""
LOG_FLOOR = math.log(1e-6)
"""calibrated local log-rates are clamped to [LOG_FLOOR, log(1 - 1e-6)]"""


class AcceptanceCalibrator:
    """Calibrated acceptance rate of a draft token from its local draft probability and
    sibling rank, learned online from verdicts (see the module docstring)."""

    def __init__(self, bins: int = 10, ranks: int = 3, prior: float = 2.0, decay: float = 0.998) -> None:
        if bins < 1 or ranks < 1:
            raise ValueError(f"AcceptanceCalibrator needs bins >= 1 and ranks >= 1 (got {bins}, {ranks})")
        if not 0.0 < decay <= 1.0 or prior <= 0:
            raise ValueError(f"AcceptanceCalibrator needs 0 < decay <= 1 and prior > 0 (got {decay}, {prior})")
        self.bins, self.ranks, self.prior, self.decay = bins, ranks, prior, decay
        self.centers = (np.arange(bins) + 0.5) / bins  # the identity prior's rate per bin
        self.seen = np.zeros((ranks, bins))  # decayed observation counts
        self.hits = np.zeros((ranks, bins))  # decayed accepted counts
        self.observations = 0
        self._updates = 0
        self._set_rates(np.tile(self.centers, (ranks, 1)))  # the identity until verdicts arrive

    def rates(self) -> np.ndarray:
        """[ranks, bins] calibrated acceptance rates (prior included, monotone in q).

        Each bin is shrunk towards a prior mean that starts at the identity (the bin's q) and
        moves to its rank's pooled rate as that rank gathers observations, so a sparse bin
        (a rank-1 token the draft gives q < 0.1) borrows its rank's evidence instead of
        staying at q."""
        seen_rank = self.seen.sum(axis=1, keepdims=True)  # [R, 1]
        pooled = self.hits.sum(axis=1, keepdims=True) / np.maximum(seen_rank, 1e-12)
        w = RANK_PRIOR / (RANK_PRIOR + seen_rank)
        prior_mean = w * self.centers + (1 - w) * pooled  # [R, bins]
        raw = (self.hits + self.prior * prior_mean) / (self.seen + self.prior)
        return np.array([isotonic(raw[r], self.seen[r] + self.prior) for r in range(self.ranks)])

    def _cells(self, logq: torch.Tensor, rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = logq.exp().nan_to_num(0.0)
        b = (q * self.bins).long().clamp(0, self.bins - 1)
        r = (rank.long() - 1).clamp(0, self.ranks - 1)
        return r, b

    def local_logprob(self, logq: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        """Calibrated log acceptance of tokens with local draft log-probs `logq` and sibling
        ranks `rank` (1-based), same shape; -inf where logq is -inf."""
        q_bin = (logq.exp() * self.bins).long().clamp_(0, self.bins - 1)  # exp(-inf) = 0: bin 0
        cell = (rank.long() - 1).clamp_(0, self.ranks - 1) * self.bins + q_bin
        if self._flat_log_rate.device != logq.device:
            self._flat_log_rate = self._flat_log_rate.to(logq.device)
        return self._flat_log_rate[cell].masked_fill_(~torch.isfinite(logq), float("-inf"))

    def observe(self, logq: torch.Tensor, rank: torch.Tensor, accepted: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Record verdicts: logq, rank, accepted (and mask) have one shape; the entries where
        mask is True (all when None) are verified nodes whose parent was reached. One
        transfer to the host."""
        if logq.numel() == 0:
            return
        use = torch.isfinite(logq) if mask is None else (mask & torch.isfinite(logq))
        r, b = self._cells(logq, rank)
        # [2, M]: each entry's cell (-1 where not observed) and whether it was accepted, read at once
        packed = torch.stack([torch.where(use, r * self.bins + b, -1).flatten(), accepted.long().flatten()]).cpu().numpy()
        keep = packed[0] >= 0
        cell, hit = packed[0][keep], packed[1][keep].astype(float)
        n = cell.size
        factor = self.decay**n
        self.seen *= factor
        self.hits *= factor
        size = self.ranks * self.bins
        self.seen += np.bincount(cell, minlength=size).reshape(self.ranks, self.bins)
        self.hits += np.bincount(cell, weights=hit, minlength=size).reshape(self.ranks, self.bins)
        self.observations += n
        self._updates += 1
        if self._updates <= REFIT_EVERY or self._updates % REFIT_EVERY == 0:  # refit the table now and then
            self._set_rates(self.rates())

    def _set_rates(self, rates: np.ndarray) -> None:
        self._log_rate = torch.from_numpy(np.log(np.clip(rates, 1e-6, 1 - 1e-6))).float()  # [R, bins]
        self._flat_log_rate = self._log_rate.reshape(-1)  # [R * bins], indexed by (rank - 1) * bins + q bin

    def child_rate(self, rank: int = 1) -> float:
        """P(a node's rank-`rank` child is accepted | the node was reached): the decayed share of
        accepted observations of that rank, with `prior` pseudo-observations at 1/2."""
        r = min(max(rank, 1), self.ranks) - 1
        return float((self.hits[r].sum() + 0.5 * self.prior) / (self.seen[r].sum() + self.prior))

    def state(self) -> dict[str, object]:
        """Introspection: observations so far and the calibrated rate per rank and q bin."""
        return {"observations": self.observations, "rates": np.round(self.rates(), 3).tolist(), "child_rate": round(self.child_rate(), 4)}
