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
favourite, 2, 3+), and whether the target accepted it. Per rank, q is binned (`DEFAULT_EDGES`:
tenths above q = 0.1, log-spaced below, so that a child the draft gives 0.002 is not valued
like one it gives 0.08); each bin holds exponentially decayed counts plus a prior of `prior`
pseudo-observations at the rank's fitted power law q^γ evaluated at the bin's centre. γ starts
at 1 (the identity: acceptance = q, the uncalibrated value) and is fitted to the rank's
verdicts as they arrive (`rank_exponents`), so a sparse bin borrows its rank's evidence in a
form that keeps its own q: a rank whose q = 0.25 children are accepted 90% of the time values
an unobserved q = 0.05 bin at about 0.77, and an unobserved rank keeps the identity at the
bin's q. Where the law fits, a bin is pooled with it more strongly (`prior_strength`: empirical
Bayes over the rank's bins; `_law_weight`: per bin, the posterior odds that it follows the law
rather than only loosely), so a calibrated draft is valued by its law, not by 14 noisy bins,
while a bin that contradicts the law keeps its own evidence; the law is evaluated at each bin's
mean observed q (`mean_logq`), and within a bin a token's rate follows the law through the
bin's rate (a q = 0.98 favourite is not valued like the bin's mean 0.94: over a five-token path
that is 0.90 against 0.73). The bins' rates are made non-decreasing in q (pool-adjacent-violators). The
calibrated path value is the product of the calibrated local rates along the path. That is
CAST's table for top-k children (`AcceptanceCalibrator.top_k`); drawn children and DynaTree keep
the earlier, coarser one (`AcceptanceCalibrator.pooled`: 10 equal bins, ranks 3+ in one row, a
sparse bin's prior moving from its centre to the rank's pooled rate).

Calibration only shapes trees; verification is untouched, so outputs stay lossless (each
step's tree depends on past verdicts only, as in DynaTree's history rule).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdec import constants
from specdec.isotonic import isotonic

if TYPE_CHECKING:
    from specdec.stats import StepRecord

DEFAULT_EDGES = (0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
"""interior q edges of the calibration bins (14 bins): log-spaced below 0.1, where the draft's
lower-ranked children live, tenths above"""
RANK_PRIOR = 10.0
"""pseudo-observations of the identity (acceptance = q, at the rank's own observed q's) in the
fit of a rank's exponent γ: evidence moves γ away from 1 once it outweighs them"""
MAX_PRIOR = 1000.0
"""the most pseudo-observations `prior_strength` puts at a bin's power-law rate"""
EXPONENTS = np.exp(np.arange(-80, 33) * 0.05)
"""the γ grid of `rank_exponents` (0.018 to 4.95, 5% apart, 1 included)"""
EARLY_REFITS = 4
"""the calibrated table is refitted after each of the first EARLY_REFITS updates (it starts from a prior) ..."""
REFIT_EVERY = 16
"""... then once the updates since the last refit reach 1 / REFIT_GROWTH of the updates at the last
refit, at most REFIT_EVERY apart (each refit reads the counts from the device: one host read):
refits after updates 1, 2, 3, 4, 6, 9, 13, 19, 28, 42, 58, 74, ... While the table still moves
they follow each other closely: a table left stale for 12 steps after a prior-dominated early fit
made CAST verify twice the nodes it should in the tree simulation (tests/test_tree_rules.py)"""
REFIT_GROWTH = 2
"""see REFIT_EVERY"""
LOG_FLOOR = math.log(1e-6)
LOG_CEIL = math.log(1 - 1e-6)
"""calibrated local log-rates are clamped to [LOG_FLOOR, LOG_CEIL]"""


def collision_log_mass(logprobs: torch.Tensor) -> torch.Tensor:
    """log sum_v q(v)^2 of each distribution `logprobs` [..., V] -> [..., 1]: the draft's expected
    probability of its own sample, a token-free stand-in for a drawn child's logq."""
    return torch.logsumexp(2 * logprobs, dim=-1, keepdim=True).clamp_(max=0.0)


_lgamma = np.vectorize(math.lgamma, otypes=[np.float64])


def _log_beta(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return _lgamma(x) + _lgamma(y) - _lgamma(x + y)


def _log_beta_binomial(hits: np.ndarray, seen: np.ndarray, mean: np.ndarray, strength: np.ndarray) -> np.ndarray:
    """log P(hits of seen | the rate ~ Beta(strength * mean, strength * (1 - mean))), up to the
    binomial coefficient (the same for every prior), elementwise; counts may be fractional.
    Host arithmetic (at refits), no torch ops."""
    m = np.clip(mean, 1e-9, 1 - 1e-9)
    a, b = strength * m, strength * (1 - m)
    miss = np.maximum(seen - hits, 0.0)
    return _log_beta(hits + a, miss + b) - _log_beta(a, b)


def _law_weight(hits: np.ndarray, seen: np.ndarray, mean: np.ndarray, strength: np.ndarray, prior: float) -> np.ndarray:
    """Posterior probability, per bin, that its rate follows the law (`strength` pseudo-observations
    at `mean`) rather than only loosely (`prior` of them), the two equally likely a priori."""
    follows = _log_beta_binomial(hits, seen, mean, strength)
    loose = _log_beta_binomial(hits, seen, mean, np.full_like(strength, prior))
    return 1.0 / (1.0 + np.exp(np.clip(loose - follows, -50.0, 50.0)))


class AcceptanceCalibrator:
    """Calibrated acceptance rate of a draft token from its local draft probability and
    sibling rank, learned online from verdicts (see the module docstring)."""

    def __init__(
        self,
        edges: Sequence[float] | None = DEFAULT_EDGES,
        ranks: int = 3,
        prior: float = 10.0,
        decay: float = 0.998,
        bins: int | None = None,
        rank_prior: str = "power",
    ) -> None:
        """edges: the interior q edges of the bins, increasing in (0, 1); or None with `bins`:
        that many equal-width bins. ranks: calibration rows (sibling rank r uses row
        min(r, ranks): later ranks share the last). prior: pseudo-observations per bin at the
        rank's prior mean (10: in the tree simulator 2 let a bin follow its own noise, 10 and 20
        did equally well; docs/cast.md, "Draft confidence is not acceptance"). decay: per-observation forgetting.
        rank_prior: the prior mean of a bin, "power" (the rank's fitted power law at the bin's
        centre, `rank_exponents`) or "pooled" (the bin's centre moving to the rank's pooled rate
        as the rank gathers RANK_PRIOR observations: for drawn children, whose q is a stand-in,
        see `pooled`)."""
        if rank_prior not in ("power", "pooled"):
            raise ValueError(f"AcceptanceCalibrator rank_prior={rank_prior!r} must be 'power' or 'pooled'")
        self.rank_prior = rank_prior
        if edges is None or bins is not None:
            if bins is None or bins < 1:
                raise ValueError(f"AcceptanceCalibrator needs bins >= 1 when it is given or edges is None (got bins={bins})")
            edges = [i / bins for i in range(1, bins)]
        edges = [float(e) for e in edges]
        if any(not 0.0 < e < 1.0 for e in edges) or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
            raise ValueError(f"AcceptanceCalibrator needs edges increasing strictly inside (0, 1) (got {edges})")
        if ranks < 1:
            raise ValueError(f"AcceptanceCalibrator needs ranks >= 1 (got {ranks})")
        if not 0.0 < decay <= 1.0 or prior <= 0:
            raise ValueError(f"AcceptanceCalibrator needs 0 < decay <= 1 and prior > 0 (got {decay}, {prior})")
        self.edges = np.array(edges)
        self.bins, self.ranks, self.prior, self.decay = len(edges) + 1, ranks, prior, decay
        lo, hi = np.concatenate([[0.0], self.edges]), np.concatenate([self.edges, [1.0]])
        # each bin's representative q (the identity prior's rate): the geometric centre of a
        # log-spaced bin (hi / lo >= 2.5), the middle of a narrow one and of the bottom bin
        self.centers = np.where((lo > 0) & (hi >= 2.5 * lo), np.sqrt(lo * np.maximum(hi, 1e-12)), (lo + hi) / 2)
        self._seen = np.zeros((ranks, self.bins))  # decayed observation counts (host copy, as of the last flush)
        self._hits = np.zeros((ranks, self.bins))  # decayed accepted counts
        self._sum_logq = np.zeros((ranks, self.bins))  # decayed sums of the observed tokens' log q
        self._observations = 0
        self._log_centers = np.log(self.centers)
        # the counts are accumulated where the verdicts live (no read per step): [4, ranks * bins + 1]
        # rows seen, hits, the log q sums and (column 0 of row 3) the observation count; the last
        # column collects unobserved entries (whatever their log q: that column is never read). Read back (one transfer) when the table is refitted or the counts are asked for.
        self._acc: torch.Tensor | None = None
        self._dirty = False
        self._updates = 0
        self._refitted_at = 0  # `_updates` at the last refit
        self._child = np.full(ranks, 0.5)  # child_rate per rank, as of the last refit
        self._edges: dict[torch.device, torch.Tensor] = {}  # log q bin edges per device
        self._offsets: dict[tuple[int, torch.device], torch.Tensor] = {}  # `child_rates`' rank offsets per (k, device)
        self._gamma = np.ones(ranks)  # each rank's exponent γ as of the last refit (`rank_exponents`)
        # the tables on each device they were asked for, at one address for good: a refit copies into them
        # (a captured drafting level reads them, `specdec.drafting.levels`)
        self._device_tables: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._set_rates(np.tile(self.centers, (ranks, 1)))  # the identity until verdicts arrive

    @classmethod
    def top_k(cls, ranks: int) -> AcceptanceCalibrator:
        """The table for top-k children (a child's q is its own draft probability): `ranks` rows
        (one per proposed rank), log-spaced low-q bins, each rank's power law as the prior."""
        return cls(DEFAULT_EDGES, ranks=ranks)

    @classmethod
    def pooled(cls) -> AcceptanceCalibrator:
        """The earlier, coarser table: 10 equal q bins, ranks 3+ in one row, 2 pseudo-observations
        per bin at a prior that moves from the bin's centre to the rank's pooled rate. Used for
        children drawn from the draft (their q is the parent's collision mass, the same for every
        draw; with the `top_k` layout CAST drafted more and ran 3-6% slower on the bundled pair at
        T = 1) and for DynaTree's top-k children: DynaTree prunes nodes worth less than τ = 0.03,
        and the coarse bottom bin values every child with q < 0.1 at 0.05 before evidence (it is
        verified, so calibration learns whether such children are accepted), where the `top_k`
        table values it at about its own q; on a tiny random pair DynaTree with the `top_k` table
        verified no child and so learned nothing, and on the bundled pair it was neutral (τ 2.85 ->
        2.78, tok/s 104.6 -> 106.0, greedy, B = 1, one run). docs/cast.md, "Draft confidence is
        not acceptance"."""
        return cls(None, ranks=3, prior=2.0, bins=10, rank_prior="pooled")

    @property
    def seen(self) -> np.ndarray:
        """[ranks, bins] decayed observation counts."""
        self._flush()
        return self._seen

    @property
    def hits(self) -> np.ndarray:
        """[ranks, bins] decayed accepted counts."""
        self._flush()
        return self._hits

    @property
    def observations(self) -> int:
        """verdicts observed so far"""
        self._flush()
        return self._observations

    def _flush(self) -> None:
        """Bring the device-side counts to the host (one transfer)."""
        if not self._dirty or self._acc is None:
            return
        size = self.ranks * self.bins
        acc = self._acc.cpu().numpy()
        self._seen = acc[0, :size].reshape(self.ranks, self.bins).copy()
        self._hits = acc[1, :size].reshape(self.ranks, self.bins).copy()
        self._sum_logq = acc[2, :size].reshape(self.ranks, self.bins).copy()
        self._observations = round(float(acc[3, 0]))
        self._dirty = False

    def mean_logq(self) -> np.ndarray:
        """[ranks, bins] each cell's mean observed log q, with one pseudo-observation at the bin's
        centre (an unobserved cell: the centre). The identity's rate in a cell is its mean q, not
        its centre: a draft whose confidences crowd a bin's top end is accepted above the centre."""
        self._flush()
        return (self._sum_logq + self._log_centers[None, :]) / (self._seen + 1.0)

    def bin_of(self, q: float) -> int:
        """The bin (column of `rates`) of local draft probability q."""
        return int(np.searchsorted(self.edges, q, side="right"))

    def rank_exponents(self) -> np.ndarray:
        """[ranks] γ per rank: the penalised maximum-likelihood exponent of P(accepted) = q^γ
        over the rank's binned verdicts (each bin at its centre), with RANK_PRIOR
        pseudo-observations of the identity (γ = 1) spread over the bins as the rank's own
        observations are. γ < 1: the draft's q understates acceptance (greedy verification of
        a spread-out draft); γ > 1: it overstates it."""
        self._flush()
        log_c = self.mean_logq()  # [R, bins] each cell's mean log q
        q = np.exp(log_c)
        log_hit = EXPONENTS[None, :, None] * log_c[:, None, :]  # [R, G, bins] log q^γ
        log_miss = np.log1p(-np.minimum(np.exp(log_hit), 1 - 1e-9))  # [R, G, bins] log (1 - q^γ)
        share = (self._seen + 1e-3) / (self._seen + 1e-3).sum(axis=1, keepdims=True)  # [R, bins]
        hits = self._hits + RANK_PRIOR * share * q  # [R, bins] with the identity's pseudo-verdicts
        misses = np.maximum(self._seen - self._hits, 0.0) + RANK_PRIOR * share * (1 - q)
        loglik = np.einsum("rb,rgb->rg", hits, log_hit) + np.einsum("rb,rgb->rg", misses, log_miss)  # [R, G]
        return EXPONENTS[loglik.argmax(axis=1)]

    def rates(self, exponents: np.ndarray | None = None) -> np.ndarray:
        """[ranks, bins] calibrated acceptance rates (prior included, monotone in q).

        Each bin is shrunk towards its rank's power law at the bin's mean q, q̄^γ
        (`rank_exponents`, `mean_logq`; γ = 1, the identity, before evidence), so a sparse bin (a rank-1
        token the draft gives q < 0.1) borrows its rank's evidence without losing its own q
        (`rank_prior="pooled"`: towards the rank's pooled rate from the bin's centre instead).
        exponents: each rank's γ when already computed (`rank_exponents`)."""
        self._flush()
        if self.rank_prior == "power":
            gamma = self.rank_exponents() if exponents is None else exponents
            prior_mean = np.exp(self.mean_logq() * gamma[:, None])  # [R, bins]
        else:
            seen_rank = self._seen.sum(axis=1, keepdims=True)  # [R, 1]
            pooled = self._hits.sum(axis=1, keepdims=True) / np.maximum(seen_rank, 1e-12)
            w = RANK_PRIOR / (RANK_PRIOR + seen_rank)
            prior_mean = w * self.centers + (1 - w) * pooled  # [R, bins]
        raw = (self._hits + self.prior * prior_mean) / (self._seen + self.prior)
        if self.rank_prior == "power":  # bins that follow the law take it with more weight (`prior_strength`, `_law_weight`)
            strength = self.prior_strength(prior_mean)  # [R, bins]
            follows = (self._hits + strength * prior_mean) / (self._seen + strength)
            w = _law_weight(self._hits, self._seen, prior_mean, strength, self.prior)
            raw = w * follows + (1 - w) * raw
        return np.array([isotonic(raw[r], self._seen[r] + self.prior) for r in range(self.ranks)])

    def prior_strength(self, prior_mean: np.ndarray) -> np.ndarray:
        """[R, bins] pseudo-observations at `prior_mean` [R, bins] per bin: at least `prior`, more
        as far as the rank's bins scatter about its power law no more than their counts' binomial
        noise does (empirical Bayes: the between-bin variance σ² of the true rates about the law,
        by the method of moments, and the beta prior of that variance, p (1 - p) / σ² - 1
        pseudo-observations; at most MAX_PRIOR). A draft the law fits (a calibrated one) gets
        its law, not 14 noisy bins; one it does not fit keeps its bins' own evidence."""
        seen = self._seen
        observed = seen >= 1.0
        rate = np.where(observed, self._hits / np.maximum(seen, 1e-12), prior_mean)
        p = np.clip(prior_mean, 1e-6, 1 - 1e-6)
        excess = np.where(observed, seen * ((rate - p) ** 2 - p * (1 - p) / np.maximum(seen, 1e-12)), 0.0)  # [R, bins]
        total = np.maximum((seen * observed).sum(axis=1, keepdims=True), 1e-12)
        variance = np.maximum(excess.sum(axis=1, keepdims=True) / total, 0.0)  # [R, 1] σ² per rank
        strength = p * (1 - p) / np.maximum(variance, 1e-12) - 1.0
        return np.clip(strength, self.prior, MAX_PRIOR)

    def _log_edges(self, device: torch.device) -> torch.Tensor:
        edges = self._edges.get(device)
        if edges is None:
            edges = self._edges[device] = torch.tensor(np.log(self.edges), dtype=torch.float32, device=device)
        return edges

    def _cells(self, logq: torch.Tensor, rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = torch.bucketize(logq.float().nan_to_num(float("-inf")), self._log_edges(logq.device), right=True)
        r = (rank.long() - 1).clamp(0, self.ranks - 1)
        return r, b

    def local_logprob(self, logq: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        """Calibrated log acceptance of tokens with local draft log-probs `logq` and sibling
        ranks `rank` (1-based), same shape; -inf where logq is -inf."""
        r, q_bin = self._cells(logq, rank)  # -inf: bin 0
        cell = r * self.bins + q_bin
        if self.rank_prior == "power":
            line = self._line(logq.device)[cell]  # [..., 2]
            rate = torch.addcmul(line[..., 0], line[..., 1], logq.float().nan_to_num(LOG_FLOOR, neginf=LOG_FLOOR)).clamp_(LOG_FLOOR, LOG_CEIL)
        else:
            rate = self.log_rate(cell)
        return rate.masked_fill_(~torch.isfinite(logq), float("-inf"))

    def cells(self, logq: torch.Tensor, rank_offset: torch.Tensor) -> torch.Tensor:
        """The table cell of tokens with local draft log-probs `logq`: (rank - 1) * bins + q bin,
        with `rank_offset` = (min(rank, ranks) - 1) * bins given (`rank_offsets`); a -inf logq
        falls in the q = 0 bin. Two ops: a bucketize and an add (broadcasting)."""
        return torch.bucketize(logq, self._log_edges(logq.device), right=True) + rank_offset

    def child_rates(self, local: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Table cells and calibrated log acceptance rates of k children per parent in rank order.

        local: [..., k] the children's local draft log-probs, or [..., 1] one stand-in value per
        parent for all k (drawn children). Returns (cells, log rates), each [..., k]; a -inf local
        log-prob falls in the q = 0 bin (finite rate: mask invalid children yourself). The rank
        offsets are cached per (k, device): three ops per call, five for a `top_k` table (its
        cells' lines in log q)."""
        key = (k, local.device)
        offsets = self._offsets.get(key)
        if offsets is None:
            offsets = self._offsets[key] = self.rank_offsets(torch.arange(1, k + 1, device=local.device))  # [k]
        cells = self.cells(local, offsets)
        if self.rank_prior != "power":
            return cells, self.log_rate(cells)
        line = self._line(local.device)[cells]  # [..., k, 2]: each cell's intercept and slope in log q
        return cells, torch.addcmul(line[..., 0], line[..., 1], local).clamp_(LOG_FLOOR, LOG_CEIL)

    def drawn_child_rates(self, logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Table cells and calibrated log acceptance rates of k children drawn (without
        replacement, in draw order) from each of the distributions `logprobs` [..., V].

        A drawn child's value may not depend on its own token (exactness of sampling
        verification), so it is looked up from what precedes its draw: its draw rank and the
        parent's collision mass (`collision_log_mass`), and made non-increasing in the rank so
        that any cut by value keeps the first draws. Returns (cells, log rates), each [..., k]."""
        cells, rates = self.child_rates(collision_log_mass(logprobs), k)
        return cells, rates.cummin(dim=-1).values

    def rank_offsets(self, ranks: torch.Tensor) -> torch.Tensor:
        """(min(rank, ranks) - 1) * bins for 1-based sibling ranks (cache it: it depends on the shape only)."""
        return (ranks.long() - 1).clamp(0, self.ranks - 1) * self.bins

    def _line(self, device: torch.device) -> torch.Tensor:
        """[R * bins, 2] each cell's log-rate line in log q (intercept, slope), on `device`."""
        return self._device_table("line", self._flat_line, device)

    def device_tables(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The tables `child_rates` reads on `device` (at fixed addresses: a refit writes over them)."""
        return (self._line(device),) if self.rank_prior == "power" else (self._device_table("log_rate", self._flat_log_rate, device),)

    def log_rate(self, cells: torch.Tensor) -> torch.Tensor:
        """Calibrated log acceptance of the tokens in `cells` (finite everywhere: mask invalid nodes yourself)."""
        return self._device_table("log_rate", self._flat_log_rate, cells.device)[cells]

    def _device_table(self, name: str, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`host` (a table as of the last refit) on `device`: the CPU tensor itself there, else a
        copy made once and refreshed in place by each refit (`_set_rates`)."""
        if device.type == "cpu":
            return host
        table = self._device_tables.get((name, device))
        if table is None:
            table = self._device_tables[(name, device)] = host.to(device)
        return table

    def observe_cells(self, cells: torch.Tensor, accepted: torch.Tensor, mask: torch.Tensor, logq: torch.Tensor | None = None) -> None:
        """`observe` for tokens given by their table cells (`cells`) and local log q (`logq`;
        None: each cell's centre); only entries where `mask` is True count."""
        if cells.numel() == 0:
            return
        overflow = constants.full((), self.ranks * self.bins, torch.long, cells.device)  # the cell of unobserved entries
        self._accumulate(torch.where(mask, cells, overflow).flatten(), mask.sum(), accepted, logq)

    def observe_tree(self, cells: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, record: StepRecord, logq: torch.Tensor | None = None) -> None:
        """The verdicts on one verified tree: every valid non-root node whose parent was reached (the
        root, or a node on the row's accepted path) is one observation, accepted iff it was reached.

        cells: [B, N] each node's table cell (`cells`), in the verified tree's order; parents,
        valid: [B, N] the tree's; record: the step's `StepRecord` (its `accepted_nodes` index the
        same tree); logq: [B, N] the nodes' local draft log-probs (the q the cells were looked up
        by; None: each cell's centre, for tables whose q is a stand-in). The reached nodes are marked on the host and copied to the device once."""
        if not record.accepted_nodes:
            return
        host_reached = np.zeros(tuple(parents.shape), dtype=np.bool_)  # [B, N]
        for r, path in enumerate(record.accepted_nodes):
            if record.active[r]:  # rows that finished accepted nothing
                host_reached[r, [0, *path]] = True
        if not host_reached.any():
            return
        reached = torch.from_numpy(host_reached).to(parents.device)
        # observed: verified non-root nodes whose parent was reached (the root has no parent: column 0 off)
        observed = valid & reached.gather(1, parents.clamp(min=0))
        observed[:, 0] = False
        self.observe_cells(cells, reached, observed, logq)

    def observe(self, logq: torch.Tensor, rank: torch.Tensor, accepted: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Record verdicts: logq, rank, accepted (and mask) have one shape; the entries where
        mask is True (all when None) are verified nodes whose parent was reached. The counts
        are updated on the verdicts' device; the host reads them only when the table is refitted
        (after each of the first EARLY_REFITS updates, then further and further apart, at most REFIT_EVERY)."""
        if logq.numel() == 0:
            return
        use = torch.isfinite(logq) if mask is None else (mask & torch.isfinite(logq))
        r, b = self._cells(logq, rank)
        size = self.ranks * self.bins
        self._accumulate(torch.where(use, r * self.bins + b, size).flatten(), use.sum(), accepted, logq.nan_to_num(0.0, neginf=0.0))

    def _accumulate(self, cell: torch.Tensor, n: torch.Tensor, accepted: torch.Tensor, logq: torch.Tensor | None = None) -> None:
        """Add observations (cell per entry, the overflow cell for unobserved ones; n observed;
        their log q, None: their cells' centres) on the device."""
        size = self.ranks * self.bins
        dev = cell.device
        if self._acc is None or self._acc.device != dev:
            self._acc = torch.zeros(4, size + 1, dtype=torch.float64, device=dev)
            self._acc[0, :size] = torch.from_numpy(self._seen.reshape(-1))
            self._acc[1, :size] = torch.from_numpy(self._hits.reshape(-1))
            self._acc[2, :size] = torch.from_numpy(self._sum_logq.reshape(-1))
            self._acc[3, 0] = float(self._observations)
            # log centre per cell (the overflow cell: 0), for observations without their own log q
            self._cell_log_centers = torch.from_numpy(np.append(np.tile(self._log_centers, self.ranks), 0.0)).to(dev)
        n = n.double()
        # decay the counts by decay ** (new observations), then add the new ones
        decay = torch.pow(self.decay, n)
        self._acc[:3].mul_(decay)  # the counts and the log q sums (row 3 holds the observation count)
        self._acc[0].index_add_(0, cell, constants.ones(cell.numel(), torch.float64, dev))
        self._acc[1].index_add_(0, cell, accepted.flatten().double())
        self._acc[2].index_add_(0, cell, self._cell_log_centers[cell] if logq is None else logq.flatten().double())
        self._acc[3, :1].add_(n)
        self._dirty = True
        self._updates += 1
        since = self._updates - self._refitted_at
        if self._updates <= EARLY_REFITS or since >= min(REFIT_EVERY, max(1, self._refitted_at // REFIT_GROWTH)):  # refit the table now and then
            self._refitted_at = self._updates
            self._flush()
            if self.rank_prior == "power":
                self._gamma = self.rank_exponents()
            self._set_rates(self.rates(self._gamma))
            self._child = np.array([self._rate_of(r) for r in range(1, self.ranks + 1)])

    def _set_rates(self, rates: np.ndarray) -> None:
        """Refit: the tables from `rates` [R, bins], written over the last ones where they exist
        (their addresses stay: a captured drafting level reads them). Computed in numpy; one copy
        into each table."""
        log_rate = np.log(np.clip(rates, 1e-6, 1 - 1e-6)).astype(np.float32)  # [R, bins]
        # within a cell the rate follows the rank's power law through the cell's rate at its mean
        # q: log rate(q) = log rate_cell + γ (log q - mean log q)
        slope = np.broadcast_to(self._gamma[:, None], rates.shape)  # [R, bins]
        intercept = log_rate.astype(np.float64) - slope * self.mean_logq()
        flat_log_rate = torch.from_numpy(log_rate.reshape(-1))  # [R * bins], indexed by (rank - 1) * bins + q bin
        flat_line = torch.from_numpy(np.stack([intercept, slope], axis=-1).reshape(-1, 2).astype(np.float32))  # [R * bins, 2]
        if getattr(self, "_flat_line", None) is None:  # the first fit (the constructor's)
            self._flat_line, self._flat_log_rate = flat_line, flat_log_rate
            self._log_rate = flat_log_rate.view(rates.shape)  # [R, bins]: the same table
        else:
            self._flat_line.copy_(flat_line)
            self._flat_log_rate.copy_(flat_log_rate)
        for (name, _), table in self._device_tables.items():
            table.copy_(self._flat_line if name == "line" else self._flat_log_rate)

    def _rate_of(self, rank: int) -> float:
        r = min(max(rank, 1), self.ranks) - 1
        return float((self._hits[r].sum() + 0.5 * self.prior) / (self._seen[r].sum() + self.prior))

    def child_rate(self, rank: int = 1) -> float:
        """P(a node's rank-`rank` child is accepted | the node was reached): the decayed share of
        accepted observations of that rank, with `prior` pseudo-observations at 1/2, as of the
        last refit (so asking reads nothing from the device)."""
        return float(self._child[min(max(rank, 1), self.ranks) - 1])

    def state(self) -> dict[str, object]:
        """Introspection: observations so far and the calibrated rate per rank and q bin."""
        return {
            "observations": self.observations,
            "edges": self.edges.tolist(),
            "exponents": np.round(self.rank_exponents(), 3).tolist(),
            "rates": np.round(self.rates(), 3).tolist(),
            "child_rate": round(self.child_rate(), 4),
        }
