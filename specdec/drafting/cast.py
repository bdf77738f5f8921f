"""CAST: inference-cost-aware dynamic draft trees (Hong, Tan and Hu, "Inference-Cost-Aware
Dynamic Tree Construction for Efficient Inference in Large Language Models").

CAST is EAGLE-2's dynamic tree plus three cost-aware decisions, each driven by measured
forward latencies (`specdec.cost.CostTable`: f_T(B, c, n) and f_D(B, c, n) for batch B,
context c and n new tokens):

- **breadth pruning** (layer i): the candidates are the top-K nodes (by path confidence
  v(u) = prod of draft probabilities along the path) among the children of layer i-1's
  kept nodes. With u_k = (1/B) sum_rows sum_{s<=k} v_row(s) (batch-averaged cumulative
  confidence of the k best) and c_k = f_D(B, select(ctx_i), k) / f_T(B, select(ctx_i), 1),
  Algorithm 1 (`max_valid_index`) with threshold C1 picks n_i, the nodes kept (and
  expanded) at layer i;
- **depth pruning**: layer i+1 is drafted only if alpha_i * u_{n_i} / c_{n_i} >= C2, where
  alpha_i is the mean of a FIFO buffer A_i (size R, initialised to {1}) of the confidence
  gain ratios phi_i = u^{(i+1)}_{n_{i+1}} / u^{(i)}_{n_i} seen at earlier steps;
- **dynamic reranking**: all drafted nodes are ranked by v; with the batch-averaged sorted
  scores v(1) >= ... >= v(N) (N <= total_tokens), u_k = sum_{j<=k} v(j) and
  c_k = f_T(B, select(n0), k + 1) / f_T(B, select(n0), 1) (k draft tokens + the root),
  Algorithm 1 with threshold C3 over k = 0..N picks how many each row verifies. k = 0
  (the root only: plain decoding) is a candidate, so a tree that cannot pay for its
  verification cost shrinks to nothing.

With all three switched off (or thresholds 0) and calibration off, CAST is exactly
`Eagle2Policy`. `prune_rule="threshold"`, `rerank_rule="threshold"`, `calibrate=False` is
the paper's CAST. The defaults differ in three ways (docs/cast.md, "Our defaults"):

- **calibrated values** (`calibrate`): a node's value is its path's acceptance rate learned
  from the verifier's verdicts (`AcceptanceCalibrator`), not the raw draft confidence;
- **break-even rules** (`prune_rule`, `rerank_rule`): a node is expanded, a layer drafted and
  a node verified when it is predicted to raise the step's expected tokens per ms, instead of
  beating a fixed threshold (`StepPlan`);
- **learned overheads**: the tables' forward costs plus the engine's measured time per draft
  forward and per verification beyond them (`StepOverheads`).

The rules are module-level functions so tests check each on hand-built numbers. docs/cast.md
lists every place where the paper is vague and the choice made here.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from specdec import constants
from specdec.cost.table import CostTable, check_cost_options
from specdec.drafting.builder import Draft, DraftContext, TreeBuilder, check_tree_nodes, check_tree_sampling, root_only_draft
from specdec.drafting.calibration import AcceptanceCalibrator, collision_log_mass
from specdec.drafting.levels import CapturedLevels, fixed_place
from specdec.errors import SpecDecError
from specdec.hostwork import HostCopy
from specdec.models.static import node_bucket

if TYPE_CHECKING:
    from specdec.cost.profile import CostTableResolver
    from specdec.sources.base import DraftSource
    from specdec.stats import StepRecord

BATCH1_DEPTH, BATCH8_DEPTH = 13, 9
"""the paper's depths at batch size 1 and 8 (Appendix E)"""
BATCH1_THRESHOLD, BATCH8_THRESHOLD = 3.0, 2.5
"""the paper's thresholds at batch size 1 (its 8B models) and 8 (Appendix E)"""


# ----- the rules, as pure functions ---------------------------------------------------------


def max_valid_index(u: Sequence[float], c: Sequence[float], threshold: float, rtol: float = 1e-9) -> int:
    """Algorithm 1 ("Select Maximum Valid Index"): the largest 1-based j such that for every
    i < j the marginal utility (u[j] - u[i]) / (c[j] - c[i]) is at least `threshold`.

    u, c: equal-length sequences (utility and cost of taking 1, 2, ... items); threshold C >= 0.
    Index 1 is always valid. For non-decreasing c the test is equivalent to
    g[j] >= max_{i<j} g[i] with g = u - C * c (one pass); otherwise the pairwise test runs
    as printed. A gain with no extra cost counts as an infinite marginal utility. Comparisons
    allow a relative slack of `rtol` so a ratio equal to C (in exact arithmetic) passes.

    Example: u = [1, 1.5, 1.6], c = [1, 2, 3], C = 0.3 -> 2 (the third item adds 0.1 < 0.3).
    """
    n = len(u)
    if n != len(c):
        raise ValueError(f"max_valid_index: u has {n} entries, c has {len(c)}")
    if n == 0:
        raise ValueError("max_valid_index needs at least one entry")
    tol = rtol * (1.0 + max(abs(x) for x in u) + threshold * max(abs(x) for x in c))
    if all(b >= a for a, b in zip(c, c[1:], strict=False)):
        best = 1
        running = u[0] - threshold * c[0]  # max_{i<j} g[i]
        for j in range(1, n):
            g = u[j] - threshold * c[j]
            if g >= running - tol:
                best = j + 1
            running = max(running, g)
        return best
    best = 1
    for j in range(1, n):
        ok = True
        for i in range(j):
            du, dc = u[j] - u[i], c[j] - c[i]
            below = du < threshold * dc - tol if dc >= 0 else du / dc < threshold
            if below:
                ok = False
                break
        if ok:
            best = j + 1
    return best


def batch_utility(score: torch.Tensor, rows: torch.Tensor, k: int | None = None, presorted: bool = False) -> list[float]:
    """u_k for k = 1..K: the batch-averaged cumulative confidence of the k best candidates.

    score: [B, N] log path confidences (cum_logq; -inf for missing candidates);
    rows: [B] bool, the rows to average over (the active ones). Each row's confidences
    v = exp(score) are sorted in descending order; u_k = mean over rows of the sum of the
    k largest. Returns a list of length K = min(k, N) (all N when k is None).
    presorted: each row of `score` is already in descending order (skips the sort).
    """
    n = score.shape[1] if k is None else min(k, score.shape[1])
    count = int(rows.sum())
    if n == 0 or count == 0:
        return [0.0] * n
    return _utility(score, rows.to(torch.float64)[:, None] / count, n, presorted)


def _batch_mean(values: torch.Tensor, weights: torch.Tensor | None, dim: int) -> torch.Tensor:
    """The weighted sum over the batch dimension `dim` of `values` (weights [B, 1]: 1 / active
    rows, 0 for the others, broadcast against the trailing dims); weights None: a batch of one
    active row, whose values are their own mean (no op)."""
    return values.select(dim, 0) if weights is None else (values * weights).sum(dim=dim)


def _utility(score: torch.Tensor, weights: torch.Tensor | None, n: int, presorted: bool) -> list[float]:
    """`batch_utility` with the row weights given ([B, 1] float64: 1 / active rows, 0 for the
    others) and n >= 1: a handful of tensor ops and one transfer, as it runs several times a step."""
    return _utility_tensor(score, weights, n, presorted).tolist()


def _utility_tensor(score: torch.Tensor, weights: torch.Tensor | None, n: int, presorted: bool) -> torch.Tensor:
    """`_utility` on the device: [n] float64 (read it together with others in one transfer)."""
    top = score[:, :n] if presorted else torch.topk(score, n, dim=1).values  # [B, n] descending
    return _batch_mean(top.double().exp(), weights, 0).cumsum(dim=0)


def _trim_flat(utility: list[float]) -> list[float]:
    """Drop the trailing entries that add nothing (candidates that are missing in every row)."""
    end = len(utility)
    while end > 1 and utility[end - 1] <= utility[end - 2]:
        end -= 1
    return utility[:end]


def breadth_count(utility: Sequence[float], draft_cost: Sequence[float], threshold: float) -> int:
    """n_i: how many of layer i's candidates to keep (1..len(utility)), by Algorithm 1 on the
    utilities u_k and normalised draft costs c_k = f_D(k) / f_T(1), threshold C1."""
    return max_valid_index(utility, draft_cost, threshold)


def rerank_count(utility: Sequence[float], target_cost: Sequence[float], threshold: float) -> int:
    """How many draft tokens each row verifies (0..N), by Algorithm 1 with threshold C3 on
    u = [0, u_1..u_N] and c = [c_0..c_N], c_k = f_T(k + 1) / f_T(1) (so c_0 = 1: the root only)."""
    if len(target_cost) != len(utility) + 1:
        raise ValueError(f"rerank_count: {len(utility)} utilities need {len(utility) + 1} costs (c_0..c_N), got {len(target_cost)}")
    return max_valid_index([0.0, *utility], target_cost, threshold) - 1


def break_even_count(utility: Sequence[float], target_cost: Sequence[float], draft_cost: float) -> int:
    """How many draft tokens each row verifies (0..N) so that the step's expected rate
    (1 + u_k) / (d + c_k) is highest: tokens committed (the bonus token plus the expected
    accepted ones) per unit of step time (the draft time d already spent plus verifying
    k + 1 tokens), both in units of one plain decoding step f_T(1). Equivalently,
    Algorithm 1 with a threshold that is not fixed but equals the break-even rate of the
    step so far: a token is added while its marginal utility beats the current rate."""
    if len(target_cost) != len(utility) + 1:
        raise ValueError(f"break_even_count: {len(utility)} utilities need {len(utility) + 1} costs (c_0..c_N), got {len(target_cost)}")
    u = [0.0, *utility]
    rates = [(1.0 + u[k]) / max(draft_cost + target_cost[k], 1e-12) for k in range(len(u))]
    return max(range(len(rates)), key=lambda k: (rates[k], -k))


class DepthBuffers:
    """The FIFO buffers A_i of depth pruning: each holds the last R confidence gain ratios
    phi_i = u^{(i+1)}_{n_{i+1}} / u^{(i)}_{n_i} of layer i and starts as {1}."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._buffers: dict[int, deque[float]] = {}

    def _buffer(self, layer: int) -> deque[float]:
        if layer not in self._buffers:
            self._buffers[layer] = deque([1.0], maxlen=self.size)
        return self._buffers[layer]

    def alpha(self, layer: int) -> float:
        """alpha_i = Avg(A_i)."""
        buf = self._buffer(layer)
        return sum(buf) / len(buf)

    def push(self, layer: int, phi: float) -> None:
        self._buffer(layer).append(float(phi))

    def values(self, layer: int) -> list[float]:
        return list(self._buffer(layer))


def grow_decision(alpha: float, utility: float, draft_cost: float, threshold: float) -> bool:
    """Depth pruning: draft layer i+1 iff alpha_i * u^{(i)}_{n_i} / c^{(i)}_{n_i} >= C2."""
    if draft_cost <= 0:
        return utility > 0 or threshold <= 0
    return alpha * utility / draft_cost >= threshold


def batch_preset(batch: int, at_1: float, at_8: float) -> float:
    """The paper's setting at batch 1 and batch 8, linear in log2(B) in between, and the
    batch-8 value from 8 on."""
    w = min(max(math.log2(max(batch, 1)) / 3.0, 0.0), 1.0)
    return at_1 + (at_8 - at_1) * w


class _LinearFit:
    """y ~ theta . x by exponentially weighted least squares (weight w per observation), with a
    small ridge `penalty` per coefficient that keeps a coefficient near 0 until the data
    separate it from the others."""

    def __init__(self, weight: float, penalty: Sequence[float]) -> None:
        n = len(penalty)
        self.weight = weight
        self.xx = np.zeros((n, n))
        self.xy = np.zeros(n)
        self.ridge = np.diag(np.asarray(penalty, dtype=float))
        self.theta = np.zeros(n)

    def add(self, x: Sequence[float], y: float) -> None:
        v = np.asarray(x, dtype=float)
        self.xx = (1 - self.weight) * self.xx + self.weight * np.outer(v, v)
        self.xy = (1 - self.weight) * self.xy + self.weight * y * v
        self.theta = np.linalg.solve(self.xx + self.ridge, self.xy)


@dataclass
class StepOverheads:
    """What a step costs beyond the cost tables' forwards, learned from the engine's timings.

    The tables time bare forwards; a step also spends Python and framework time once per step
    (the policy's bookkeeping, the root's distribution), per drafted layer and per expanded
    node (top-k, tree bookkeeping, kernel launches), and per verification and verified node
    (tree mask, accept rule, cache commit). After each step, (measured - predicted) draft time
    is fitted as s + a * layers + b * expanded nodes and (measured - predicted) verification
    time as c + e * tree nodes, by exponentially weighted least squares (weight `weight` per
    step; a small ridge keeps the per-layer and per-node terms at 0 until the data tell them
    apart from the per-step one). A residual is clipped to [-predicted, 2 * predicted + 2 ms]
    so one stalled step (a page fault, another process) moves the fit by a bounded amount.
    The per-step terms may go negative when a table overstates the device; the per-layer and
    per-node terms are used only when positive.

    A step also costs time outside drafting and verification (committing the accepted path to
    both caches, the engine's bookkeeping, the policy's own feedback), the same whatever the
    tree; it is tracked as an exponentially weighted mean (`other_ms`), each observation
    clipped to [0, 2 * mean + 2 ms] (a prompt admitted mid-batch prefills inside a step)."""

    weight: float = 0.1
    _draft: _LinearFit = field(init=False, repr=False)
    _verify: _LinearFit = field(init=False, repr=False)
    _other: float = field(default=0.0, init=False, repr=False)
    _expected: tuple[float, int, int, float, int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._draft = _LinearFit(self.weight, (1e-6, 0.1, 1.0))  # [per step, per layer, per node]
        self._verify = _LinearFit(self.weight, (1e-6, 1.0))  # [per step, per tree node]

    @property
    def draft_step_ms(self) -> float:
        """extra draft-side ms per step"""
        return float(self._draft.theta[0])

    @property
    def draft_ms(self) -> float:
        """extra ms per drafted layer (draft forward after the root's), >= 0"""
        return max(float(self._draft.theta[1]), 0.0)

    @property
    def draft_node_ms(self) -> float:
        """extra ms per expanded node (the width of each expansion), >= 0"""
        return max(float(self._draft.theta[2]), 0.0)

    @property
    def other_ms(self) -> float:
        """ms per step outside drafting and verification, >= 0"""
        return self._other

    def observe_other(self, other_ms: float) -> None:
        """One step's measured time outside drafting and verification (ms)."""
        clipped = min(max(other_ms, 0.0), 2.0 * self._other + 2.0)
        self._other = (1 - self.weight) * self._other + self.weight * clipped

    @property
    def verify_ms(self) -> float:
        """extra ms per verification"""
        return float(self._verify.theta[0])

    @property
    def verify_node_ms(self) -> float:
        """extra ms per verified tree node, >= 0"""
        return max(float(self._verify.theta[1]), 0.0)

    def expect(self, draft_forward_ms: float, layers: int, expanded_nodes: int, verify_forward_ms: float, tree_nodes: int) -> None:
        """What the tables predict for the step just drafted: its draft forwards' total time,
        how many layers it drafted after the root's forward and how many nodes they expanded,
        and its verification forward's time over `tree_nodes` positions."""
        self._expected = (draft_forward_ms, layers, expanded_nodes, verify_forward_ms, tree_nodes)

    def skip(self) -> None:
        """Learn nothing from the step just drafted (its times are not typical of a step)."""
        self._expected = None

    def observe(self, draft_ms: float, verify_ms: float) -> None:
        """The step's measured draft and verification time (ms)."""
        if self._expected is None:
            return
        predicted_draft, layers, nodes, predicted_verify, tree_nodes = self._expected
        self._expected = None
        self._draft.add((1.0, layers, nodes), _clip(draft_ms - predicted_draft, predicted_draft))
        self._verify.add((1.0, tree_nodes), _clip(verify_ms - predicted_verify, predicted_verify))


def _clip(residual: float, predicted: float) -> float:
    return min(max(residual, -predicted), 2.0 * predicted + 2.0)


@dataclass(frozen=True)
class StepPlan:
    """Break-even pruning's view of a step in progress: verifying the `verified` best nodes
    drafted so far gives `utility` expected accepted tokens for `drafted` + verify_cost[verified]
    ms (draft spent + verification).

    values: the pool's node values, best first (per node, not cumulative). When given, new
    nodes are weighed against the pool as reranking will: they may *replace* weaker pool nodes
    in the verified set (`best_with`), so a layer of strong nodes pays even where the nodes
    drafted so far already fill every slot that verification gives for free. Without them
    (older callers), new nodes are verified on top of the plan's `verified` ones."""

    utility: float
    verified: int
    drafted: float
    verify_cost: list[float]
    """v_0..v_m: the cost of verifying k draft tokens (and the root)"""
    values: tuple[float, ...] = ()

    @property
    def rate(self) -> float:
        """Expected tokens committed per unit of time: (1 + u) / (d + v)."""
        return (1.0 + self.utility) / max(self.drafted + self.verify_cost[self.verified], 1e-12)

    def best_with(self, new: Sequence[float], extra: float) -> float:
        """The best rate reranking could reach if nodes of values `new` (per node) joined the
        pool at an extra draft cost `extra`: the best k of pool and new nodes together, each
        k costing verify_cost[k]."""
        top = len(self.verify_cost) - 1
        drafted = self.drafted + extra
        if not self.values:  # additive: the new nodes on top of the plan's verified ones
            best, gain = 0.0, 0.0
            for j, v in enumerate(sorted(new, reverse=True), start=1):
                gain += v
                more = min(self.verified + j, top)
                best = max(best, (1.0 + self.utility + gain) / max(drafted + self.verify_cost[more], 1e-12))
            return best
        merged = sorted([*self.values, *new], reverse=True)[:top]
        best = 1.0 / max(drafted + self.verify_cost[0], 1e-12)
        u = 0.0
        for k, v in enumerate(merged, start=1):
            u += v
            best = max(best, (1.0 + u) / max(drafted + self.verify_cost[k], 1e-12))
        return best

    def best_with_many(self, news: Sequence[Sequence[float]], extras: Sequence[float]) -> list[float]:
        """`[best_with(new, extra) for new, extra in zip(news, extras)]` with array operations:
        one row per candidate set (the pool and the set's nodes, padded with -inf), sorted,
        cumulated and divided by each k's cost at once. Break-even pruning asks this for every
        width of every layer it weighs, so it runs a hundred times a step: a Python loop over k per
        set cost milliseconds of host time per step on the bundled pair."""
        if not self.values or not news:  # additive plans (older callers) take the loop
            return [self.best_with(new, extra) for new, extra in zip(news, extras, strict=True)]
        top = len(self.verify_cost) - 1
        pool = len(self.values)
        rows = np.full((len(news), pool + max(len(new) for new in news)), -np.inf)  # [J, P + N]
        rows[:, :pool] = self.values
        for i, new in enumerate(news):
            rows[i, pool : pool + len(new)] = new
        merged = -np.sort(-rows, axis=1)[:, :top]  # [J, m] best first; -inf past each set's real count
        drafted = self.drafted + np.asarray(extras, dtype=np.float64)  # [J]
        cost = np.asarray(self.verify_cost[1 : merged.shape[1] + 1], dtype=np.float64)  # verify_cost[k], k = 1..m
        rates = (1.0 + np.cumsum(merged, axis=1)) / np.maximum(drafted[:, None] + cost[None, :], 1e-12)  # [J, m]; -inf past the count
        root_only = 1.0 / np.maximum(drafted + self.verify_cost[0], 1e-12)  # [J]
        best = root_only if merged.shape[1] == 0 else np.maximum(root_only, rates.max(axis=1))
        return best.tolist()

    def gains(self, predicted: Sequence[float], draft_cost: float, chain: Sequence[float] = (), chain_cost: float = 0.0) -> bool:
        """Whether drafting one more layer is predicted to raise the rate.

        predicted: the cumulative predicted utilities of the next layer's best 1, 2, ... new
        nodes; the layer pays when verifying some of them (with the pool, `best_with`) beats
        the rate now, counting its draft cost. chain: the predicted utilities of the best
        path's next node in each later layer, each costing `chain_cost` to draft; a layer also
        pays when it and the L layers after it, one node each, beat the rate now (one layer
        alone can fall short of the rate while the path it starts pays)."""
        now = self.rate * (1.0 + 1e-9)
        nodes = _diffs(predicted)
        if not nodes:
            return False
        if self.best_with(nodes, draft_cost) > now:
            return True
        path, cost = [nodes[0]], draft_cost
        for extra in chain:
            path.append(extra)
            cost += chain_cost
            if self.best_with(path, cost) > now:
                return True
        return False


def batch_bucket(batch: int) -> int:
    """The power of two at or above `batch` (1, 2, 4, 8, ...): rows of a rolling batch that
    shrinks share estimates within a bucket."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass
class _DecayedRatio:
    """R = sum y / sum x over exponentially decayed observations (y, x), with the decayed
    second moments that give R's standard error (the ratio estimator's: its residuals
    y - R * x, weighted, over the effective number of observations the weights hold)."""

    y: float = 0.0
    x: float = 0.0
    weight: float = 0.0
    """decayed count of observations"""
    moments: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """decayed sums of y^2, y * x, x^2 and of the squared weights"""

    def add(self, y: float, x: float, decay: float) -> None:
        """One observation; the earlier ones' weights shrink by `decay`."""
        self.y = decay * self.y + y
        self.x = decay * self.x + x
        self.weight = decay * self.weight + 1.0
        yy, yx, xx, w2 = self.moments
        self.moments = (decay * yy + y * y, decay * yx + y * x, decay * xx + x * x, decay * decay * w2 + 1.0)

    @property
    def ratio(self) -> float | None:
        """None before any observation."""
        return self.y / self.x if self.weight > 0 and self.x > 0 else None

    @property
    def mean_y(self) -> float:
        return self.y / self.weight

    @classmethod
    def combined(cls, parts: Sequence[_DecayedRatio]) -> _DecayedRatio:
        """One ratio over the observations of several (their sums added: R = sum y / sum x)."""
        out = cls()
        for part in parts:
            out.y, out.x, out.weight = out.y + part.y, out.x + part.x, out.weight + part.weight
            out.moments = tuple(a + b for a, b in zip(out.moments, part.moments, strict=True))  # type: ignore[assignment]
        return out

    @property
    def squared_weights(self) -> float:
        """The decayed sum of the observations' squared weights (the spread of the weights:
        `n_eff` = weight^2 / this)."""
        return self.moments[3]

    def residual_sd(self) -> float | None:
        """The standard deviation of one observation's residual y - R * x (weighted, with the
        effective number of observations' correction); None with fewer than `MIN_NOISE_STEPS`
        effective observations."""
        rate = self.ratio
        if rate is None:
            return None
        yy, yx, xx, w2 = self.moments
        w = self.weight
        n_eff = w * w / w2
        if n_eff < MIN_NOISE_STEPS:
            return None
        residual = max(0.0, yy - 2.0 * rate * yx + rate * rate * xx)  # sum of w * (y - R * x)^2
        return math.sqrt(residual / w * n_eff / (n_eff - 1.0))

    def standard_error(self) -> float | None:
        """None with fewer than `MIN_NOISE_STEPS` effective observations (no estimate)."""
        sd = self.residual_sd()
        if sd is None:
            return None
        return sd * math.sqrt(self.squared_weights) / self.x


@dataclass
class _ModeTimes:
    """Drafted and plain steps at one batch bucket: a mode's speed is its steps' wall ms over
    the tokens they commit per row, a ratio of decayed sums (a mean of per-step ratios would
    overstate it: a step that commits one token costs about as much as one that commits six),
    with its standard error, so a lead can be told from noise.

    Most of a drafted step's noise is in the tokens it commits (acceptance is a coin toss per
    node; on the bundled pair at batch 8 the tokens per row vary 19% from step to step, the
    step's ms 8%), so when the policy says how many tokens it expected the step to commit, the
    speed is a control-variate estimate: recent ms over recent *expected* tokens (`per_expected`,
    decay `decay`), times how many tokens were committed per expected one over a much longer
    window (`committed_per_expected`, decay `long_decay`): the acceptance noise averages out over
    the long window, and the recent window follows the step's cost as it changes. Without
    expectations (plain steps: one token each) the expected tokens are the committed ones and
    the factor is 1."""

    per_expected: dict[bool, _DecayedRatio] = field(default_factory=dict)
    """plain (True) / drafted (False) -> step ms over expected tokens per row, recent steps"""
    committed_per_expected: dict[bool, _DecayedRatio] = field(default_factory=dict)
    """plain / drafted -> committed over expected tokens per row, a long window"""
    since_plain: int = 0
    """drafted steps since the last plain one"""
    since_drafted: int = 0
    """plain steps since the last drafted one"""
    drafted_seen: int = 0
    """drafted steps observed at this bucket, timed or not (`PlainDecodingCheck.cold_steps`)"""
    last_drafted_beat_plain: bool = False
    """the last timed drafted step committed its tokens faster than plain steps do on average"""
    siblings: dict[int, _ModeTimes] | None = None
    """every bucket of the `PlainDecodingCheck` this one belongs to (None: this bucket alone)"""
    prior_tokens: float = 0.0
    """how many expected tokens of this bucket's own the other buckets' factor weighs as (`factor`)"""

    def add(self, plain: bool, step_ms: float, tokens: float, decay: float, expected: float | None = None, long_decay: float = 0.995) -> None:
        """One timed step of a mode that committed `tokens` per row (the policy expected
        `expected`; None: no expectation, the committed tokens stand in); the mode's earlier
        steps' weights shrink by `decay` (`long_decay` for the committed-per-expected factor)."""
        x = tokens if expected is None or expected <= 0 else expected
        self.per_expected.setdefault(plain, _DecayedRatio()).add(step_ms, x, decay)
        self.committed_per_expected.setdefault(plain, _DecayedRatio()).add(tokens, x, long_decay)

    def factor(self, plain: bool) -> tuple[float, float | None] | None:
        """Committed per expected token of a mode's steps, with its standard error (None: too few
        steps to tell): drafted steps' own ratio shrunk toward the other buckets' pooled one,
        (committed + k * pooled ratio) / (expected + k), with k = `prior_tokens` x P / (P +
        `prior_tokens`) for a pool of P expected tokens (about `prior_tokens` once P is large).

        How many tokens a step commits per expected one is a property of the draft and the
        text, not of the batch size, and its noise is most of a drafted step's (a coin toss
        per node), so a bucket that a rolling batch reaches only for a few steps at its end
        borrows the other buckets' hundreds of steps instead of deciding on three: on the
        bundled pair at batch 4 (2026-11-26), three timed steps of a last row that committed
        one token each set its drafted speed at 19.7 ms a token against 9.5 measured over all
        of its drafted steps, and the row's remaining steps ran plain, at 14.8. A bucket's
        own steps outweigh the pooled ratio once they expected more than k tokens. The pool
        leaves the bucket's own steps out, so a batch of one size throughout is timed as before."""
        own = self.committed_per_expected.get(plain)
        if own is None or own.ratio is None:
            return None
        others = [] if plain or self.siblings is None or self.prior_tokens <= 0 else [t.committed_per_expected[False] for t in self.siblings.values() if t is not self and False in t.committed_per_expected]
        pooled = _DecayedRatio.combined(others)
        if pooled.ratio is None:  # no other bucket has drafted steps: this one's alone
            return own.ratio, own.standard_error()
        # the pool weighs k expected tokens when it holds many more, and less when it holds few
        # (a busy bucket barely moves toward a bucket reached for three steps)
        k = self.prior_tokens * pooled.x / (pooled.x + self.prior_tokens)
        ratio = (own.y + k * pooled.ratio) / (own.x + k)
        # residual noise of one step: the bucket's own estimate, at least the pooled one (a few
        # steps that agree by chance have no spread); the pooled ratio's own error weighs k
        sds = [sd for sd in (own.residual_sd(), pooled.residual_sd()) if sd is not None]
        se_pooled = pooled.standard_error()
        if not sds or se_pooled is None:
            return ratio, None
        return ratio, math.sqrt(max(sds) ** 2 * own.squared_weights + (k * se_pooled) ** 2) / (own.x + k)

    def mean_ms(self, plain: bool) -> float | None:
        """The mode's decayed mean step ms (None until timed)."""
        r = self.per_expected.get(plain)
        return r.mean_y if r is not None and r.weight > 0 else None

    def ms_per_token(self, plain: bool) -> float | None:
        """None until the mode has been timed."""
        recent, factor = self.per_expected.get(plain), self.factor(plain)
        if recent is None or factor is None or recent.ratio is None or not factor[0]:
            return None
        return recent.ratio / factor[0]

    def standard_error(self, plain: bool) -> float | None:
        """The standard error of `ms_per_token(plain)`: the two ratios' relative errors in
        quadrature (they are estimated from different noise: the step's ms, the acceptance)."""
        rate = self.ms_per_token(plain)
        if rate is None:
            return None
        recent, factor = self.per_expected[plain], self.factor(plain)
        se_recent = recent.standard_error()
        if se_recent is None or factor is None or factor[1] is None or recent.ratio is None:
            return None
        return rate * math.hypot(se_recent / recent.ratio, factor[1] / factor[0])

    @property
    def drafted(self) -> float | None:
        return self.ms_per_token(False)

    @property
    def plain(self) -> float | None:
        return self.ms_per_token(True)


MIN_NOISE_STEPS = 3.0
"""effective timed steps a mode needs before its noise is estimated (`_ModeTimes.standard_error`)"""


@dataclass
class PlainDecodingCheck:
    """Whether drafting pays at all, from the wall clock: CAST's plan is only as good as its
    cost model, so a step that drafts and a plain step (the root alone, no draft forward:
    `DraftSource.defer`) are timed against each other, per committed token, and the faster
    mode runs. The slower one is probed now and then, so a change (a harder stretch of text,
    a batch that fills up) is noticed:

    - while drafting is ahead, one plain step every `probe_every` drafted steps, or every
      `4 * probe_every` once it is ahead by more than `clear_lead` (a probe then costs less
      than 1 / (4 * probe_every) of the throughput: it is itself a plain step, at plain speed);
    - while plain steps are ahead (`plain_ahead`: faster by more than the noise of the two
      timings, `z` standard errors, and by at least `margin`), two drafted steps every
      `probe_every` plain steps, or every `4 * probe_every` once they lead by more than
      `sure_lead` (the first drafted step forwards the tokens the draft owes, so only the
      second is timed).

    Times are kept per batch bucket (`batch_bucket`): a step of 8 rows says little about a
    step of 2. Within a bucket a step's time is scaled to the bucket's own size by the cost
    model (`relative_cost`: f_T(B, 1) / f_T(bucket, 1)), so modes timed at different sizes of
    one bucket compare fairly: a rolling batch of 16 rows drains through 15 ... 9 at its end,
    and on the bundled pair (AMD EPYC CPU, 2026-12-02) its drafted steps there, cheaper for
    having fewer rows, set the bucket's drafted speed at 26.0 ms a token against 26.2 for plain
    steps, while at 16 rows they took 33.2 against 26.0: the next call drafted at 16 rows.
    How many tokens a drafted step commits per expected one is pooled across the buckets
    (`prior_tokens`, `_ModeTimes.factor`): it does not depend on the batch size. A mode's speed
    is its steps' wall time (drafting, verification, commits, bookkeeping and the policy's
    feedback) over the tokens they committed per active row, both summed with exponential
    decay (`decay`, `_ModeTimes`), each step's time clipped to 3x the mode's mean so one
    stalled step cannot flip the decision. Until both modes are timed at a bucket, steps draft (after `warm_up` drafted steps, one plain step is timed)."""

    probe_every: int = 16
    clear_lead: float = 1.15
    sure_lead: float = 1.3
    """plain steps ahead by more than this: drafting is probed 4x less often (a drafted step's
    speed is noisy, so a smaller lead keeps the frequent probes: a wrong early verdict must not stick)"""
    margin: float = 0.02
    """plain steps run only when faster by at least this share, and by more than `z` standard
    errors of the two timings: drafting has the benefit of the doubt, since CAST learns
    (calibration, overheads) only while it drafts, its first steps are its slowest, and a
    drafted step's speed is noisy, at batch 1 most (measured on the bundled pair: with a fixed
    3% lead the check went plain at batch 1 where always drafting was 1.08x AR). A fixed lead of
    10%, the rule before, kept drafting at batch 8 where plain steps were 9% faster, steadily."""
    z: float = 2.0
    """standard errors by which plain steps must lead (`_ModeTimes.standard_error`)"""
    unknown_noise_margin: float = 0.10
    """the lead required while a mode has too few timed steps for a noise estimate (and of the
    cost model's predicted plain step, `plain_next`'s predicted_plain)"""
    decay: float = 0.95
    """per timed step of a mode: its older steps' weight (about the last 20 count, so the slow
    first drafted steps are soon forgotten)"""
    long_decay: float = 0.995
    """per timed step of a mode: the weight of its older steps in how many tokens a step
    commits per expected token (about the last 400 count: `_ModeTimes`)"""
    warm_up: int = 16
    cold_steps: int = 4
    """the first drafted steps at each bucket are not timed: a process's first steps load
    kernels and fill caches (on an H200, 2026-11-25, CAST's first timed call at batch 1 ran 54
    of its 56 steps plain after its warm-up call's first drafted steps timed slow; drafting was
    1.9x faster than plain steps once timed again)"""
    prior_tokens: float = 16.0
    """a bucket's drafted steps count their committed-per-expected tokens against the pooled
    ratio of the other buckets' drafted steps, weighted as this many expected tokens of their
    own (`_ModeTimes.factor`: about eight steps at batch 1; 0: each bucket on its own)"""
    _buckets: dict[int, _ModeTimes] = field(default_factory=dict, repr=False)
    _discard_next: bool = field(default=False, repr=False)
    """the next drafted step pays the draft's catch-up: not timed"""

    def times(self, batch: int) -> _ModeTimes:
        bucket = batch_bucket(batch)
        if bucket not in self._buckets:
            self._buckets[bucket] = _ModeTimes(siblings=self._buckets, prior_tokens=self.prior_tokens)
        return self._buckets[bucket]

    def plain_next(self, batch: int, predicted_plain: Callable[[], float | None] | None = None, relative_cost: float = 1.0) -> bool:
        """Whether the next step at this batch size should draft nothing.

        relative_cost: what a step at `batch` rows costs against one at its bucket's size (the
        cost model's; 1: the same), by which the prediction is scaled as timed steps are (`observe`).

        predicted_plain: the cost model's ms per token of a plain step at this batch size (None:
        no prediction), asked only while the bucket has drafted steps timed but no plain one: a
        plain step is timed at once, before `warm_up` drafted steps, when the prediction is
        faster than the drafted steps by more than `unknown_noise_margin` (a prediction has no
        noise estimate; a rolling batch's last rows reach a
        bucket of their own late, for a few steps, and these are the rows whose drafts the target
        rejects most)."""
        t = self.times(batch)
        if t.drafted is None:
            return False
        if t.plain is None:
            if t.since_plain >= self.warm_up:
                return True
            predicted = predicted_plain() if predicted_plain is not None else None
            return predicted is not None and predicted / relative_cost * (1 + self.unknown_noise_margin) < t.drafted
        if self.plain_ahead(t):  # plain steps are ahead: probe drafting now and then, two steps in a row
            if t.since_drafted == 0 and t.last_drafted_beat_plain:  # the probe just timed beat plain steps: draft on until the means agree
                return False
            interval = self.probe_every * (4 if t.drafted > self.sure_lead * t.plain else 1)
            return t.since_plain != 1 and t.since_drafted < interval
        interval = self.probe_every * (4 if t.plain > self.clear_lead * t.drafted else 1)
        return t.since_plain >= interval

    def plain_ahead(self, t: _ModeTimes) -> bool:
        """Plain steps are faster per token than drafted ones by at least `margin` and by more
        than `z` standard errors of the difference; by `unknown_noise_margin` while either mode
        has too few timed steps to estimate its noise."""
        drafted, plain = t.drafted, t.plain
        if drafted is None or plain is None:
            return False
        se_drafted, se_plain = t.standard_error(False), t.standard_error(True)
        if se_drafted is None or se_plain is None:
            return plain * (1 + self.unknown_noise_margin) < drafted
        lead = drafted - plain
        return lead > plain * self.margin and lead > self.z * math.hypot(se_drafted, se_plain)

    def observe(self, batch: int, plain: bool, step_ms: float, tokens_per_row: float, expected_tokens: float | None = None, relative_cost: float = 1.0) -> None:
        """One step's wall time (ms) and the tokens it committed per active row (and expected to
        commit, when the policy says: `_ModeTimes`). relative_cost: what a step at `batch` rows
        costs against one at its bucket's size (the cost model's, > 0; 1: the same): the step's
        time is divided by it, so each bucket's times are at its own size (see the class)."""
        t = self.times(batch)
        if relative_cost > 0:
            step_ms /= relative_cost
        if plain:
            t.since_drafted += 1
            t.since_plain = 0
            self.expect_catch_up()
        else:
            t.since_plain += 1
            t.since_drafted = 0
            t.drafted_seen += 1
            if self._discard_next:
                self._discard_next = False
                return
            if t.drafted_seen <= self.cold_steps:
                return
        if step_ms <= 0 or tokens_per_row <= 0:
            return
        if not plain:
            plain_rate = t.plain
            t.last_drafted_beat_plain = plain_rate is not None and step_ms / tokens_per_row < plain_rate
        mean_ms = t.mean_ms(plain)
        if mean_ms is not None:
            step_ms = min(step_ms, 3.0 * mean_ms)
        t.add(plain, step_ms, tokens_per_row, self.decay, expected_tokens, self.long_decay)

    def expect_catch_up(self) -> None:
        """The next drafted step forwards tokens the draft owes from plain steps: it is not timed."""
        self._discard_next = True

    def state(self) -> dict[int, dict[str, float | None]]:
        """Per batch bucket: ms per committed token of drafted and plain steps."""
        return {
            b: {
                "drafted_ms_per_token": t.drafted,
                "plain_ms_per_token": t.plain,
                "drafted_standard_error": t.standard_error(False),
                "plain_standard_error": t.standard_error(True),
            }
            for b, t in sorted(self._buckets.items())
        }


def _cumsum(values: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


@dataclass
class _Step:
    """One step's settings and running costs (ms), shared by CAST's helpers."""

    b: int
    n0: int
    depth: int
    k: int
    table: CostTable
    c1: float
    c2: float
    c3: float
    verify_ms: list[float]
    """verifying k draft tokens (and the root), k = 0..m, with the learned overheads"""
    o_draft: float
    o_node: float
    forward_ms: float = 0.0
    """the draft forwards' time as the tables predict it"""
    drafted_ms: float = 0.0
    """the step's draft time so far, with overheads (and the step's other time)"""
    expanded: int = 0


@dataclass
class _PendingPlan:
    """A drafted step's numbers for `_replan`. A step that read its values while drafting has
    them here (`layers`, `pools`: cumulative utilities per layer); one that did not has the
    device's copy on its way (`values`, `_layer_values`'s [L, k + m']) and the count it verified."""

    st: _Step
    drafted_at: list[float]
    alphas: tuple[float, float] | None
    layers: list[list[float]] = field(default_factory=list)
    pools: list[list[float]] = field(default_factory=list)
    values: HostCopy | None = None
    widths: list[int] = field(default_factory=list)
    """(deferred values) the widths the step drafted"""
    verified: int = 0
    """(deferred values) the draft tokens per row it verified"""


def _diffs(cumulative: Sequence[float]) -> list[float]:
    """Per-item values from cumulative utilities u_1, u_2, ... (u_0 = 0)."""
    out, prev = [], 0.0
    for u in cumulative:
        out.append(max(u - prev, 0.0))
        prev = u
    return out


# ----- the policy ----------------------------------------------------------------------------


@dataclass
class CastPolicy:
    """CAST's cost-aware dynamic tree; every init field is a method option.

    `depth` and the thresholds default to the paper's presets, which depend on the batch
    size B (the roots' batch, finished rows included: they share the forwards):
    depth 13 at B = 1 and 9 at B >= 8; C1 = C2 = C3 = 3.0 at B = 1 and 2.5 at B >= 8;
    linear in log2(B) in between. The cost tables come from `cost_table` (injected), else
    `cost_profile` (a JSON file from `specdec profile`), else, once `bind_models` has given
    the pair (SpeculativeDecoder does), the bundled pair's shipped profile or a quick
    measurement taken before decoding (`prepare_costs`).
    """

    depth: int | None = None
    """maximum tree depth H (None: 13 at batch 1 ... 9 at batch >= 8)"""
    top_k: int = 12
    """K: children per expanded node and candidates per layer"""
    total_tokens: int = 72
    """m: the most draft tokens verified per row"""
    c1: float | None = None
    """breadth-pruning threshold C1 (None: the batch preset)"""
    c2: float | None = None
    """depth-pruning threshold C2 (None: the batch preset)"""
    c3: float | None = None
    """dynamic-reranking threshold C3 (None: the batch preset)"""
    buffer: int = 8
    """R: length of each depth-pruning FIFO buffer A_i"""
    breadth_pruning: bool = True
    depth_pruning: bool = True
    dynamic_rerank: bool = True
    rerank_rule: str = "break-even"
    """break-even (default): verify the k that maximises the step's expected tokens per unit
    time (1 + u_k) / (d + c_k), no threshold to tune; threshold: the paper's Algorithm 1 with C3"""
    lookahead: int = 0
    """break-even depth pruning: how many layers past the next one the best path may count
    when deciding whether to draft the next layer (0, the default: the next layer alone;
    counting more was measured slower on the bundled pair, see docs/cast.md)"""
    calibrate: bool = True
    """value nodes by their calibrated acceptance (learned online from the verifier's verdicts,
    `AcceptanceCalibrator`) instead of the raw draft confidence; False is the paper's v(u)"""
    prune_rule: str = "break-even"
    """break-even (default): breadth and depth pruning keep a node or a layer while its predicted
    tokens per unit of cost beat the step's own expected rate, and a layer skipped `buffer`
    steps in a row is drafted once to refresh its buffer; threshold: the paper's C1 and C2"""
    deterministic: bool = False
    """freeze the step times learned from the wall clock (break-even rules then use the cost
    tables alone), so tree shapes depend only on the tables and the verdicts: with a fixed
    cost profile and a seed, sampled output is the same on every run"""
    cost_profile: str | None = None
    """path of a cost profile JSON (see `specdec profile`)"""
    cost_table: CostTable | None = field(default=None, repr=False)
    """an in-memory CostTable (takes precedence; no identity check)"""
    tree_sampling: str = "sampled"
    """when sampling: 'sampled' children drawn from the draft distribution, valued without looking
    at their own tokens (see `_add`), or 'topk' (`TREE_SAMPLING`)"""
    plain_steps: bool = True
    """draft nothing (no draft forward) while plain steps are measured faster than drafted ones
    (`PlainDecodingCheck`, timed by the wall clock, so `deterministic` ignores it), and at a row's
    last token: a guard against drafts that rarely agree with the target and batch sizes where
    drafting cannot pay (neutral on the bundled pair at batch 1 and 4 in an interleaved A/B;
    0.96-0.98x AR instead of 0.74-0.76x with a draft that never agrees; docs/cast.md "Plain steps")"""
    reads_while_drafting: bool | None = None
    """break-even pruning: whether a step reads its layers' values back to the host while it
    drafts (True: the step's own values decide how deep it drafts past the plan and how many
    nodes it verifies, one read after the planned layers and one per layer past them), or
    drafts the plan's layers, verifies the plan's predicted count and reads the values only
    after the verification forward is launched, for the next plan (False: no synchronisation
    while drafting, so a GPU's draft forwards and the host's launches overlap, and the
    planning overlaps the verification). None: False on CUDA devices, where each read stalls
    the GPU until the host has decided and launched what follows; True elsewhere (on a CPU a
    read costs nothing and the step's own values decide better). A step with no plan yet reads."""
    name: str = "cast"
    uses_draft: bool = True
    requires_cost_table: ClassVar[bool] = True
    """CAST's every decision reads the costs"""
    last_widths: list[int] = field(default_factory=list, init=False, repr=False)
    """n_i of each drafted layer at the last step"""
    last_verified: int = field(default=0, init=False, repr=False)
    """draft tokens per row kept for verification at the last step (before per-row validity)"""
    _buffers: DepthBuffers = field(init=False, repr=False)
    _skipped: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _cells: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)
    """this step's calibration cells per node (calibrate only), [B, n] per add in creation order"""
    _weights: torch.Tensor | None = field(default=None, init=False, repr=False)
    """[B, 1]: each row's weight in the batch-averaged utilities (1 / active rows, or 0); None at B = 1"""
    _sampled: bool = field(default=False, init=False, repr=False)
    """this step's children are drawn (set by `draft`)"""
    _calibrators: dict[bool, AcceptanceCalibrator] = field(
        default_factory=dict, init=False, repr=False
    )
    """one calibration table per kind of children, top-k (False) and drawn (True): their values mean
    different things (a top-k child's own draft probability, a drawn child's parent collision mass)
    and are accepted by different rules, so a server alternating greedy and sampled requests keeps two.
    The top-k table has one row per proposed sibling rank (`top_k` rows): a 12th child is not valued as a 3rd."""
    overheads: StepOverheads = field(default_factory=lambda: StepOverheads(), init=False, repr=False)
    """the engine's measured time per draft forward and per verification beyond the tables"""
    _last_tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = field(default=None, init=False, repr=False)
    _feedback_ms: float = field(default=0.0, init=False, repr=False)
    """how long the previous feedback took (part of the step's time outside drafting and verification)"""
    _plan: list[int] | None = field(default=None, init=False, repr=False)
    """break-even pruning: the widths the next step expands, layer by layer (made after a step's tree, `plan_ahead`)"""
    _plan_verified: int | None = field(default=None, init=False, repr=False)
    """break-even pruning: the draft tokens per row the next step is predicted to verify (made with `_plan`)"""
    _pending_plan: _PendingPlan | None = field(default=None, init=False, repr=False)
    """what `_replan` needs, from the step just drafted, until `plan_ahead` (or the next draft) makes the plan"""
    _alphas_fixed: tuple[float, float] | None = field(default=None, init=False, repr=False)
    """calibration's child rates as of the drafted step, while a deferred `_replan` runs"""
    _resolver: CostTableResolver | None = field(default=None, init=False, repr=False)
    _capacity: int = field(default=64, init=False, repr=False)
    """the largest builder capacity a step has needed (the next builder starts with it)"""
    _levels: CapturedLevels | None = field(default=None, init=False, repr=False)
    """this step's captured layers (`_captured_layer`); None: op by op (not captured, or the builder outgrew its buffers)"""
    _loaded: CostTable | None = field(default=None, init=False, repr=False)
    plain_check: PlainDecodingCheck = field(default_factory=PlainDecodingCheck, init=False, repr=False)
    """drafted against plain steps, timed (`plain_steps`)"""
    _expected_tokens: float | None = field(default=None, init=False, repr=False)
    """tokens per active row the step just drafted was expected to commit (`_verify_count`), for the plain check"""
    _step_plain: bool | None = field(default=None, init=False, repr=False)
    """whether the step just drafted was plain (None: not timed, e.g. a row's last token)"""
    _step_relative_cost: float = field(default=1.0, init=False, repr=False)
    """the step's cost against one at its batch bucket's size (`_relative_cost`), for the plain check"""
    _owed: bool = field(default=False, init=False, repr=False)
    """the draft owes tokens of plain steps: the next drafted step forwards them (a catch-up
    whose draft time is not an overhead of drafting, so `StepOverheads` does not learn from it)"""
    _catching_up: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise SpecDecError(f"lookahead={self.lookahead!r} must be an integer >= 0")
        for name in ("top_k", "total_tokens", "buffer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecDecError(f"{name}={value!r} must be a positive integer")
        if self.depth is not None and (isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1):
            raise SpecDecError(f"depth={self.depth!r} must be a positive integer (or None for the batch preset)")
        check_tree_nodes(1 + self.total_tokens, f"cast total_tokens={self.total_tokens} (draft tokens verified per row)", "--total-tokens")
        for name in ("c1", "c2", "c3"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            ):
                raise SpecDecError(f"{name}={value!r} must be a finite number >= 0 (or None for the batch preset)")
        if self.rerank_rule not in ("threshold", "break-even"):
            raise SpecDecError(f"rerank_rule={self.rerank_rule!r} must be 'threshold' (the paper's C3) or 'break-even'")
        if self.prune_rule not in ("threshold", "break-even"):
            raise SpecDecError(f"prune_rule={self.prune_rule!r} must be 'threshold' (the paper's C1 and C2) or 'break-even'")
        for name, rule, flag in (("c1", "prune_rule", "--prune-rule"), ("c2", "prune_rule", "--prune-rule"), ("c3", "rerank_rule", "--rerank-rule")):
            if getattr(self, name) is not None and getattr(self, rule) != "threshold":
                raise SpecDecError(
                    f"{name}={getattr(self, name)!r} is a threshold, but {rule}={getattr(self, rule)!r} sets its own from the "
                    f"measured costs; pass {rule}='threshold' ({flag} threshold) to use {name}, or leave {name} unset"
                )
        for name in ("breadth_pruning", "depth_pruning", "dynamic_rerank", "calibrate", "plain_steps", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise SpecDecError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.reads_while_drafting is not None and not isinstance(self.reads_while_drafting, bool):
            raise SpecDecError(f"reads_while_drafting={self.reads_while_drafting!r} must be True, False or None (None: False on CUDA devices)")
        check_cost_options(self.cost_table, self.cost_profile)
        check_tree_sampling(self.tree_sampling)
        self._buffers = DepthBuffers(self.buffer)
        self._calibrators = {False: AcceptanceCalibrator.top_k(self.children_per_node), True: AcceptanceCalibrator.pooled()}

    # ----- settings ----------------------------------------------------------------------
    @property
    def children_per_node(self) -> int:
        """Children a node proposes: top_k, at most total_tokens (a child ranked below that has
        total_tokens siblings valued at least as high, values never rising with the rank, so it
        could never be verified)."""
        return min(self.top_k, self.total_tokens)

    def depth_for(self, batch: int) -> int:
        return self.depth if self.depth is not None else round(batch_preset(batch, BATCH1_DEPTH, BATCH8_DEPTH))

    def thresholds_for(self, batch: int) -> tuple[float, float, float]:
        """(C1, C2, C3) for a batch of `batch` rows."""
        preset = batch_preset(batch, BATCH1_THRESHOLD, BATCH8_THRESHOLD)
        c1, c2, c3 = (preset if v is None else float(v) for v in (self.c1, self.c2, self.c3))
        return c1, c2, c3

    @property
    def buffers(self) -> DepthBuffers:
        """The depth-pruning buffers A_i (kept across steps)."""
        return self._buffers

    # ----- cost tables -------------------------------------------------------------------
    def bind_models(self, target: torch.nn.Module, draft: torch.nn.Module | None, resolver: CostTableResolver | None = None) -> None:
        """Give the policy its target and draft models, so it can find (or measure) their
        cost profile. Without an injected `cost_table` this is required unless `cost_profile`
        names a file. The table is prepared now for batch 1 (a quick measurement when no
        profile fits), so that cost is paid when the decoder is built, not inside a timed
        generation; `prepare_costs` extends it to a session's largest batch before decoding.
        resolver: an existing resolver of the same models and `cost_profile` to share (its
        tables, measured or loaded once, serve every policy built over the pair)."""
        if draft is None or self.cost_table is not None:
            return
        from specdec.cost.profile import bound_resolver

        self._resolver = bound_resolver(target, draft, self.cost_profile, resolver)

    def wants_cost_table(self, device: torch.device) -> bool:
        """Whether `bind_models` loads or measures a table: unless one was injected, always."""
        return self.cost_table is None

    def prepare_costs(self, max_batch: int) -> None:
        """Before decoding: make the cost table cover batches of up to `max_batch` rows
        (measuring what a measured table lacks; never done inside a step). Called by the
        engine when a decode session starts."""
        if self._resolver is not None:
            self._resolver.prepare(max_batch)

    def table_for(self, batch: int) -> CostTable:
        """The cost table used for a batch of `batch` rows."""
        if self.cost_table is not None:
            return self.cost_table
        if self._resolver is not None:
            return self._resolver.table_for(batch)
        if self.cost_profile is not None:
            if self._loaded is None:
                self._loaded = CostTable.load(self.cost_profile)
            return self._loaded
        raise SpecDecError(
            "--method cast needs forward-cost tables: pass cost_profile=PATH (from `specdec profile`) or cost_table=CostTable, "
            "or build the decoder with SpeculativeDecoder, which finds or measures them"
        )

    def _relative_cost(self, batch: int, ctx: DraftContext) -> float:
        """What a plain step of `batch` rows costs against one at its bucket's size, by the cost
        table (`PlainDecodingCheck`: f_T(B, n0, 1) / f_T(bucket, n0, 1)); 1 at the bucket's own
        size, when the context length is not known on the host, or without a table."""
        bucket = batch_bucket(batch)
        if bucket == batch or ctx.host_context_len is None or not ctx.host_context_len:
            return 1.0
        n0 = max(ctx.host_context_len)
        try:
            table = self.table_for(batch)
        except SpecDecError:
            return 1.0
        at_bucket = table.target_cost(bucket, n0, 1)
        return table.target_cost(batch, n0, 1) / at_bucket if at_bucket > 0 else 1.0

    def _predicted_plain_ms(self, batch: int, ctx: DraftContext) -> float | None:
        """The cost model's ms per committed token of a plain step (the root alone: one target
        forward of one token per row, the verification and step overheads learned so far); None
        when the context length is not known on the host (a read), no row is active, or the rules
        learn no overheads (threshold rules, `deterministic`: the table's forward alone would
        understate a step)."""
        if ctx.host_context_len is None or not self._learns_costs or not ctx.host_active or not any(ctx.host_active):
            return None
        n0 = max(n for n, a in zip(ctx.host_context_len, ctx.host_active, strict=True) if a)
        forward = self.table_for(batch).target_cost(batch, n0, 1)
        return forward + max(self.overheads.verify_ms, -0.5 * forward) + self.overheads.verify_node_ms + self.overheads.other_ms

    # ----- drafting ----------------------------------------------------------------------
    def draft(self, source: DraftSource, roots: torch.Tensor, ctx: DraftContext) -> Draft:
        self._settle_plan()  # the previous step's plan, if the engine did not ask for it while verifying (`plan_ahead`)
        self._sampled = ctx.samples_children(self.tree_sampling)
        b = roots.shape[0]
        depth = min(self.depth_for(b), ctx.max_depth)
        self.last_widths = []
        self.last_verified = 0
        self._last_tree = None
        self._step_plain = None
        self._expected_tokens = None
        if self._plain_steps_on:
            self._step_relative_cost = self._relative_cost(b, ctx)
            plain = self.plain_check.plain_next(b, lambda: self._predicted_plain_ms(b, ctx), self._step_relative_cost)
            if (plain or depth == 0) and source.defer(roots):  # no draft forward at all
                self._step_plain = plain if depth > 0 else None  # a last token is not a timing of plain steps
                self._owed = True
                return root_only_draft(roots)
            self._step_plain = False if depth > 0 else None
        self._catching_up, self._owed = self._owed, False
        # break-even layers are drafted at the widths the host planned, without reading their values:
        # each can replay as a captured graph (`_expand`), its width bucketed
        levels = None
        if self.prune_rule == "break-even" and depth > 1:
            levels = CapturedLevels.for_step(source, ("cast", self.children_per_node, self.calibrate, self._sampled), sampled=self._sampled, by_default=False)
        self._levels = levels
        # capacity: the most nodes a step has needed so far, so the builder's buffers rarely grow mid-step;
        # captured layers sit at fixed columns (`_layer_place`): room for every layer at its widest
        capacity = self._capacity if levels is None else max(self._capacity, self._layer_place(self.depth_for(b), self.children_per_node)[0])
        builder = TreeBuilder(source, roots, ctx, keep_draft_probs=self._sampled, capacity=capacity, workspace=levels and levels.workspace)
        dev = roots.device
        rows = ctx.active.to(dev).bool()  # [B] rows whose utilities count
        active_rows = [r for r, a in enumerate(ctx.host_active) if a] if ctx.host_active is not None else rows.nonzero().flatten().tolist()
        if depth == 0 or not active_rows:
            return builder.finish()
        table = self.table_for(b)
        c1, c2, c3 = self.thresholds_for(b)
        if ctx.host_context_len is not None:  # known on the host: no device read
            n0 = max(ctx.host_context_len[r] for r in active_rows)
        else:
            lens = ctx.context_len.to(dev)
            n0 = int(lens[rows].max().item()) if lens.numel() == b else 0  # padded context of the batch
        k = min(self.children_per_node, builder.root_logprobs.shape[-1])
        # break-even rules work in ms: the tables' forward costs plus the engine's measured overheads
        t_verify = table.target_costs(b, n0, self.total_tokens + 1)  # f_T(B, n0, n) for n = 0..m+1 (ms)
        forward_ms = table.draft_costs(b, n0 + 1, 1)[1]  # the root's draft forward, as the tables predict it
        o_draft = o_verify = o_node = o_vnode = o_step = 0.0
        if self._learns_costs:  # a negative correction (a table that overstates) takes off at most half a forward
            o_draft, o_node, o_vnode = self.overheads.draft_ms, self.overheads.draft_node_ms, self.overheads.verify_node_ms
            o_verify = max(self.overheads.verify_ms, -0.5 * t_verify[1])
            # the step's time outside drafting and verification is paid whatever the tree: it counts
            # in every rate's denominator, as if spent before drafting
            o_step = max(self.overheads.draft_step_ms, -0.5 * forward_ms) + self.overheads.other_ms
        verify_ms = [t_verify[j + 1] + o_verify + o_vnode * (j + 1) for j in range(self.total_tokens + 1)]  # k draft tokens + the root
        st = _Step(b=b, n0=n0, depth=depth, k=k, table=table, c1=c1, c2=c2, c3=c3, verify_ms=verify_ms, o_draft=o_draft, o_node=o_node)
        st.forward_ms = forward_ms
        st.drafted_ms = forward_ms + o_step

        # [B, 1]: utilities average the active rows (one row: its own, no weights needed)
        self._weights = rows[:, None] / float(len(active_rows)) if b > 1 else None
        # node values: log v(u) (raw draft confidence) or the calibrated log acceptance of u's
        # path; the root's is its score (0, or -inf for a finished row)
        self._cells = [constants.full((b, 1), 0, torch.long, dev)]  # per add: calibration cells (calibrate only)
        root_value = builder.score[:, :1]  # [B, 1]
        if levels is not None:  # the root's children replay too, from its distribution copied to a level buffer
            levels.begin(builder, step_slots=(depth - 1) * node_bucket(k), fixed_layout=True)
            candidates, cand_value = self._captured_layer(levels, builder, None, root_value, 1, 1, k, 0)
        else:
            candidates, cand_value = self._add(builder, builder.root, root_value, builder.root_logprobs[:, None, :], builder.root_valid, k, 1)  # [B, k] best first
        if self.prune_rule == "break-even":
            count = self._draft_planned(builder, st, candidates, cand_value)
        else:
            count = self._draft_layerwise(builder, st, candidates, cand_value)
        self._capacity = max(self._capacity, builder.capacity)
        verified = 1 + min(count, builder.nodes_added - 1)  # the root + count nodes
        # every layer was captured: so is a greedy step's selection, at the node bucket of its width (at T > 0
        # the verifier's random numbers follow the tree's width, so a padded tree would change the sampled text)
        if self._levels is not None and ctx.params.greedy:
            drafted = self._captured_selection(self._levels, builder, verified, k)
        else:
            keep = builder.top_by_score(None, count)  # by the nodes' values: the builder's score (`_add`)
            drafted = builder.finish(keep, width=verified)  # no read
        self._levels = None
        tree = drafted.tree
        if self.calibrate:
            # top-k children: their own log q, which their cells were looked up by (drawn ones: a stand-in)
            self._last_tree = (torch.cat(self._cells, dim=1).gather(1, drafted.builder_nodes), tree.parents, tree.valid, None if self._sampled else tree.logq)
        if self._learns_costs:
            nodes = min(verified, len(t_verify) - 1)
            self.overheads.expect(st.forward_ms, builder.draft_forwards - 1, st.expanded, t_verify[nodes], nodes)
        return drafted

    def _expand(
        self, builder: TreeBuilder, st: _Step, candidates: torch.Tensor, cand_value: torch.Tensor, width: int, kept_before: int, level: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expand the best `width` candidates of layer `level` (one draft forward); returns their
        children and values sorted by value, descending ([B, width * k] each), and books the layer's cost."""
        f_draft = st.table.draft_cost(st.b, st.n0 + 1 + kept_before, width)  # the draft cache: committed tokens, the root, kept layers
        st.forward_ms += f_draft
        st.drafted_ms += f_draft + st.o_node * width + st.o_draft
        st.expanded += width
        levels = self._levels
        if levels is not None:
            bucket = min(node_bucket(width), candidates.shape[1])
            column = self._layer_place(level, st.k)[0]
            if bucket <= node_bucket(st.k) and column + bucket * st.k <= builder.capacity:
                return self._captured_layer(levels, builder, candidates, cand_value, width, bucket, st.k, level)
            # the builder outgrows its buffers: op by op for the rest of the step; the next step's have room
            self._levels = None
            self._capacity = max(self._capacity, 2 * builder.capacity, column + bucket * st.k)
        frontier = candidates[:, :width]  # [B, n_i]
        frontier_valid = builder.valid.gather(1, frontier)
        logprobs = builder.expand(frontier, frontier_valid, depth=level)  # [B, n_i, V]
        return self._add(builder, frontier, cand_value[:, :width], logprobs, frontier_valid, st.k, level + 1)

    @staticmethod
    def _layer_place(level: int, k: int) -> tuple[int, int]:
        """Where captured layer `level` (>= 1) sits (`levels.fixed_place`): room for its widest
        frontier, node_bucket(k) nodes (a planned width is at most k), so a layer's graph key does
        not follow the widths drafted before it."""
        return fixed_place(level, k, node_bucket(k))

    @classmethod
    def _captured_selection(cls, levels: CapturedLevels, builder: TreeBuilder, verified: int, k: int) -> Draft:
        """The tree of the `verified` best nodes by value (the root first: `top_by_score`), replayed
        as one graph (`CapturedLevels.finish`): its width is the node bucket of `verified` (what a
        static-shape verification pads to anyway), and which sorted ranks are kept is a device mask
        filled before the replay, so one graph serves every count of a bucket. The kept nodes are
        the op-by-op ones, in the same order; the columns past them are padding (invalid). It runs
        placed at the end of the last layer's room (`_layer_place`), so its key depends on the
        tree's depth and width, not on the last layer's width."""
        levels.place(*cls._layer_place(builder.draft_forwards, k))  # layers drafted: draft_forwards - 1 (the root's forward is one)
        b, n, dev = builder.batch_size, builder.num_nodes, builder.device
        width = min(node_bucket(verified), builder.nodes_added)
        kept_ranks = levels.buffer(("kept_ranks", width), constants.below(width, verified, dev))  # [width]: the first `verified`

        def select() -> Draft:
            order = torch.sort(builder.score, dim=1, descending=True, stable=True).indices[:, :width]  # [B, width] best first
            keep = torch.zeros(b, n, dtype=torch.bool, device=dev).scatter_(1, order, kept_ranks.expand(b, width))
            return builder.finish(keep.logical_and_(builder.valid), width=width)

        return levels.finish(select, width=width, reads=(kept_ranks,))

    def _captured_layer(
        self, levels: CapturedLevels, builder: TreeBuilder, candidates: torch.Tensor | None, cand_value: torch.Tensor, width: int, bucket: int, k: int, level: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_expand` replayed as one graph (`specdec.drafting.levels`), or with `candidates` None
        the root's children (level 0, from its distribution copied to a level buffer, which is
        also the kept root distribution when sampling; cand_value: the root's value [B, 1]).
        A layer below the root: the best `bucket` >= width
        candidates are expanded (a node bucket: a few shapes to capture, the width a static-shape
        forward pads to anyway), the ones beyond `width` masked out by a device mask filled before
        the replay, so their children are invalid (value -inf, sorted after every real child) and
        the tree is the op-by-op one (up to float rounding: the padding columns' step slots move
        later layers' keys to other cache columns). Returns the children and values, best first, [B, bucket * k]
        each, in output buffers (the first width * k as `_expand`'s). Drawn children read their
        random numbers from a buffer whose first `width` columns are drawn before the replay as op
        by op draws them, and the expanded nodes' distributions go to an output buffer."""
        b, dev = builder.batch_size, builder.device
        root = None
        if candidates is None:
            root = levels.buffer(("dist", 0), builder.root_logprobs[:, None, :])  # [B, 1, V]
            if self._sampled:
                builder._dist_chunks[0] = root
        else:  # at its fixed place, holes left by narrower layers before it
            column, slot = self._layer_place(level, k)
            levels.place(column, slot)
        # outputs: the first bucket * k columns of one buffer per layer (the widest layer's), so the next
        # layer reads them at one address whatever this layer's width
        full = (b, node_bucket(k) * k)
        nodes = levels.output(("candidates", level + 1), full, torch.long)[:, : bucket * k]
        values = levels.output(("values", level + 1), full, cand_value.dtype)[:, : bucket * k]
        expanded = None if root is not None else levels.buffer(("expanded", level, bucket), constants.below(bucket, width, dev))  # [bucket]: the first `width`
        cells = levels.output(("cells", level + 1, bucket), (b, bucket * k), torch.long) if self.calibrate else None  # (kept whole: `run` tracks it)
        tables = self._calibrator.device_tables(dev) if self.calibrate else ()
        uniforms = dists = None
        if self._sampled:  # [B, bucket, V] each
            shape3 = (b, bucket, builder.root_logprobs.shape[-1])
            uniforms = levels.uniforms(("uniforms", level, bucket), shape3, width=width)
            dists = root if root is not None else levels.output(("dist", level, bucket), shape3, builder.root_logprobs.dtype)

        def layer() -> torch.Tensor:
            if candidates is None or expanded is None:  # the root's children
                frontier, frontier_valid, logprobs = builder.root, builder.root_valid, root
                assert logprobs is not None
            else:
                frontier = candidates[:, :bucket]  # [B, bucket]
                frontier_valid = builder.valid.gather(1, frontier).logical_and_(expanded)
                logprobs = builder.expand(frontier, frontier_valid, depth=level, out=dists)  # [B, bucket, V]
            children, child_values = self._add(builder, frontier, cand_value[:, :bucket], logprobs, frontier_valid, k, level + 1, masked=root is None, uniforms=uniforms)
            if cells is not None:  # the layer's calibration cells at a fixed address, for feedback
                self._cells[-1] = cells.copy_(self._cells[-1])
            values.copy_(child_values)
            return nodes.copy_(children)

        reads = tuple(t for t in (candidates, cand_value, expanded, nodes, values, cells, *tables, uniforms, dists) if t is not None)
        levels.run(("layer", level, bucket), layer, reads=reads, lists=(self._cells,))
        if self.calibrate and root is None and bucket < node_bucket(k):  # the cells line up with the builder's columns: the hole's too
            self._cells.append(constants.full((b, (node_bucket(k) - bucket) * k), 0, torch.long, dev))
        return nodes, values

    def _draft_planned(self, builder: TreeBuilder, st: _Step, candidates: torch.Tensor, cand_value: torch.Tensor) -> int:
        """Break-even pruning with few reads. The layers' widths come from the plan made at the
        end of the previous step (`_replan`) and are drafted without looking at their values;
        then the layers' and the pool's utilities are read in one transfer. If the last layer
        still pays (`_decide` on this step's own numbers), drafting goes on a layer at a time
        (one read each), so a confident step is not held back by a cautious plan; a plan that
        was too deep is corrected at the next step. From all the numbers read, the verified
        count (this step) and the next step's plan are decided. Returns the count."""
        widths = list(self._plan[: max(st.depth - 1, 0)]) if self._plan is not None else []
        k = st.k
        layer_values = [cand_value[:, :k]]  # per layer [B, k]: its candidates' values, best first
        layer_ends = [builder.num_nodes]  # per layer: the builder's node count once its candidates are added
        drafted_at = [st.drafted_ms]  # the step's draft time when each layer's candidates are known
        kept_before = 0

        def layer(width: int) -> None:
            nonlocal candidates, cand_value, kept_before
            candidates, cand_value = self._expand(builder, st, candidates, cand_value, width, kept_before, len(layer_values))  # best first
            layer_values.append(cand_value[:, :k])
            layer_ends.append(builder.num_nodes)
            drafted_at.append(st.drafted_ms)
            kept_before += width

        for width in widths:
            layer(width)
        if self._plan_verified is not None and self._defers_reads(builder.device):
            # no read while drafting: verify the plan's predicted count; the values travel to the
            # host behind the draft forwards and are read for the next plan after the verification is launched
            count = min(self._plan_verified, self.total_tokens) if self.dynamic_rerank else self.total_tokens
            values = HostCopy(self._layer_values(builder, layer_values, layer_ends))
            self._pending_plan = _PendingPlan(st, drafted_at, self._alphas(1) if self.calibrate else None, values=values, widths=widths, verified=count)
            # (the last layer's candidate count and the expected tokens are known when `_settle_plan` reads the values)
            self.last_widths, self.last_verified, self._expected_tokens = [*widths, k], count, None
            return count
        layers: list[list[float]] = []
        pools: list[list[float]] = []
        while True:
            # one transfer: the unread layers' batch-averaged values (cumulated on the host)
            flat = self._layer_values(builder, layer_values[len(layers) :], layer_ends[len(layers) :]).tolist()  # [L', k + m']
            for values in flat:
                layers.append(_trim_flat(_cumsum(values[:k])))
                pools.append(_trim_flat(_cumsum(values[k:])))
            level = len(layers)
            if level >= st.depth or not layers[-1]:
                break
            width, grow = self._decide(st, level, layers[-1], pools[-1], drafted_at[-1], st.n0 + 1 + kept_before, None)
            if not grow:
                break
            widths.append(width)
            layer(width)
        self._push_gain_ratios(widths, layers)
        # the next step's plan is made in `plan_ahead`, while the target verifies this step's tree
        self._pending_plan = _PendingPlan(st, drafted_at, self._alphas(1) if self.calibrate else None, layers=layers, pools=pools)
        self.last_widths = [*widths, len(layers[-1])]
        return self._verify_count(st, pools[-1], st.drafted_ms)

    def _defers_reads(self, device: torch.device) -> bool:
        """Whether this step drafts its plan without reading values back (`reads_while_drafting`);
        only break-even reranking (or none) verifies a count the plan can predict."""
        if self.dynamic_rerank and self.rerank_rule != "break-even":
            return False
        return not self.reads_while_drafting if self.reads_while_drafting is not None else device.type == "cuda"

    def _push_gain_ratios(self, widths: list[int], layers: list[list[float]]) -> None:
        """Without calibration: the paper's gain ratios phi_i, for each pair of drafted layers."""
        if self.calibrate:
            return
        for i in range(1, len(layers)):
            below = widths[i] if i < len(widths) else len(layers[i])
            above = layers[i - 1][min(widths[i - 1], len(layers[i - 1])) - 1] if layers[i - 1] else 0.0
            if above > 0 and layers[i]:
                self._buffers.push(i, layers[i][min(below, len(layers[i])) - 1] / above)

    def _layer_values(self, builder: TreeBuilder, values: list[torch.Tensor], ends: list[int]) -> torch.Tensor:
        """[L, k + m'] batch-averaged confidences exp(value) of L layers: each layer's candidates
        (values [B, k] each, best first), then its pool: the best m' = min(m, nodes) values of
        every node drafted up to it (the first `ends` builder nodes, root excluded), best first.
        Six tensor ops whatever L: every layer's pool is one masked top-k of the builder's values."""
        n = ends[-1] - 1  # non-root nodes so far
        dev = builder.device
        prefixes = constants.prefix_masks(n, dev)
        drafted = torch.stack([prefixes[e - 1] for e in ends])  # [L, n] the nodes drafted up to each layer
        scores = builder.score[:, 1 : n + 1]  # [B, n]
        pooled = torch.where(drafted[:, None, :], scores, constants.full((), float("-inf"), scores.dtype, dev))  # [L, B, n]
        pools = torch.topk(pooled, min(self.total_tokens, n), dim=2).values  # [L, B, m']
        return _batch_mean(torch.cat([torch.stack(values), pools], dim=2).exp(), self._weights, 1)

    def _draft_layerwise(self, builder: TreeBuilder, st: _Step, candidates: torch.Tensor, cand_value: torch.Tensor) -> int:
        """The paper's threshold rules, layer by layer: each layer's utilities are read when it is
        drafted (one read per layer); returns the verified count."""
        kept_before = 0  # sum_{j<i} n_j
        prev_utility: float | None = None
        for level in range(1, st.depth + 1):
            utility = _trim_flat(_utility_tensor(cand_value, self._weights, cand_value.shape[1], presorted=True).tolist())
            width, grow = self._decide_threshold(st, level, utility, st.n0 + 1 + kept_before, prev_utility)
            self.last_widths.append(width)
            if level == st.depth or not grow:
                break
            candidates, cand_value = self._expand(builder, st, candidates, cand_value, width, kept_before, level)
            candidates, cand_value = candidates[:, : st.k], cand_value[:, : st.k]
            kept_before += width
            prev_utility = utility[width - 1]
        pool: list[float] = []
        n = min(builder.num_nodes - 1, self.total_tokens)
        if self.dynamic_rerank and n > 0:
            pool = _trim_flat(_utility(builder.score[:, 1:], self._weights, n, presorted=False))
        return self._verify_count(st, pool, st.drafted_ms)

    def _decide_threshold(self, st: _Step, level: int, utility: list[float], ctx_i: int, prev_utility: float | None) -> tuple[int, bool]:
        """The paper's breadth (C1) and depth (C2) rules at `level`: (n_i, draft layer i+1?)."""
        f_draft = st.table.draft_costs(st.b, ctx_i, len(utility))[1:]  # f_D(B, ctx_i, j) for j = 1..m
        t_one = max(st.table.target_cost(st.b, ctx_i, 1), 1e-9)  # a plain decoding step (ms)
        cost = [d / t_one for d in f_draft]  # the paper's c_1..c_m, in plain decoding steps
        width = breadth_count(utility, cost, st.c1) if self.breadth_pruning else len(utility)
        if prev_utility is not None and prev_utility > 0:
            self._buffers.push(level - 1, utility[width - 1] / prev_utility)
        grow = grow_decision(self._buffers.alpha(level), utility[width - 1], cost[width - 1], st.c2) if self.depth_pruning else True
        return width, grow

    def _alphas(self, level: int) -> tuple[float, float]:
        """How a node's value carries to its best and second-best child: with calibration the
        learned P(rank-r child accepted | node reached) (observed at every verification); without
        it the paper's alpha_i (the FIFO buffer of layer gain ratios) for the best child only."""
        if self.calibrate:
            if self._alphas_fixed is not None:
                return self._alphas_fixed
            return self._calibrator.child_rate(1), self._calibrator.child_rate(2)
        return self._buffers.alpha(level), 0.0

    def plan_ahead(self) -> None:
        """Make the next step's plan (`_replan`) from the step just drafted. It needs no verdict,
        so the engine calls this after launching the verification forward and before reading its
        verdict: on a GPU the host's planning overlaps the target's forward instead of holding up
        drafting (3.5 ms a step of profiled time in a sampling profile on an H100, about 1.6x the
        unprofiled). Without the call (the tree simulator, direct callers) the next `draft` makes
        the plan first, with the same inputs (the child rates as of this step)."""
        self._settle_plan()

    def _settle_plan(self) -> None:
        """Make the pending plan, if a step left one (`plan_ahead`)."""
        pending, self._pending_plan = self._pending_plan, None
        if pending is None:
            return
        layers, pools = pending.layers, pending.pools
        if pending.values is not None:  # a step that read nothing while drafting: its values now
            k = pending.st.k
            for row in pending.values.wait().tolist():  # [L, k + m']
                layers.append(_trim_flat(_cumsum(row[:k])))
                pools.append(_trim_flat(_cumsum(row[k:])))
            self._push_gain_ratios(pending.widths, layers)
            self.last_widths = [*pending.widths, len(layers[-1])]
            pool, verified = pools[-1], min(pending.verified, len(pools[-1]))
            self._expected_tokens = 1.0 + (pool[verified - 1] if verified else 0.0)
        self._alphas_fixed = pending.alphas
        try:
            self._plan, self._plan_verified = self._replan(pending.st, layers, pools, pending.drafted_at)
        finally:
            self._alphas_fixed = None

    def _decide(
        self, st: _Step, level: int, utility: list[float], pool: list[float], drafted_ms: float, ctx_i: int, prev_utility: float | None
    ) -> tuple[int, bool]:
        """Break-even breadth and depth at `level` (layer `level`'s candidates known, with
        cumulative utilities `utility`; `pool`: the cumulative utilities of the best nodes drafted
        so far; `drafted_ms`: the step's draft time so far): (n_i, draft layer i+1?).

        Expanding the best j candidates predicts children of values alpha_1 * v and alpha_2 * v
        (v: each expanded candidate's value); they join the pool, where reranking may verify them
        in place of weaker nodes (`StepPlan.best_with`), at the cost of drafting j nodes. The width
        is the j with the best predicted rate, and the layer is drafted when that rate beats the
        step's rate now (or, with `lookahead`, when the best path it starts does)."""
        plan = self._plan_of(pool, st.verify_ms, drafted_ms)
        f_draft = st.table.draft_costs(st.b, ctx_i, len(utility))[1:]
        d_ms = [d + st.o_node * j for j, d in enumerate(f_draft, start=1)]
        a1, a2 = self._alphas(level)
        values = _diffs(utility)

        def children(j: int) -> list[float]:
            return [a1 * v for v in values[:j]] + ([a2 * v for v in values[:j]] if a2 > 0 else [])

        rates = plan.best_with_many([children(j) for j in range(1, len(values) + 1)], [d_ms[j - 1] + st.o_draft for j in range(1, len(values) + 1)])
        width = len(values)
        if self.breadth_pruning:
            width = max(range(1, len(values) + 1), key=lambda j: (rates[j - 1], -j))
        if prev_utility is not None and prev_utility > 0:
            self._buffers.push(level - 1, utility[width - 1] / prev_utility)
        if not self.depth_pruning:
            return width, True
        now = plan.rate * (1.0 + 1e-9)
        grow = rates[width - 1] > now
        if not grow and self.lookahead > 0 and values:
            path, cost = children(width), d_ms[width - 1] + st.o_draft
            best = a1 * values[0]
            for step in range(1, min(st.depth - level, self.lookahead + 1)):
                path.append(best * a1**step)
                cost += d_ms[0] + st.o_draft
                if plan.best_with(path, cost) > now:
                    grow = True
                    break
        return width, grow

    def _replan(self, st: _Step, layers: list[list[float]], pools: list[list[float]], drafted_at: list[float]) -> tuple[list[int], int]:
        """The next step's widths: the break-even decisions replayed on this step's numbers, layer
        by layer; past the last drafted layer, on predicted ones (the next layer's candidates
        valued alpha_1 times the candidates they would be children of), so the plan can deepen
        by more than one layer per step and shrinks as soon as a layer stops paying. Also the
        draft tokens per row that break-even reranking would verify from the planned tree's pool
        (what a step that reads nothing while drafting verifies)."""
        widths: list[int] = []
        kept_before = 0
        measured = True
        utility, pool, drafted = layers[0], pools[0], drafted_at[0]
        for level in range(1, st.depth + 1):
            if not utility:
                break
            width, grow = self._decide(st, level, utility, pool, drafted, st.n0 + 1 + kept_before, None)
            if self.depth_pruning and not self.calibrate and level < st.depth:
                if not grow and self._skipped.get(level, 0) >= self.buffer:
                    grow = True  # refresh A_i: its ratios are only observed when layer i+1 is drafted
                self._skipped[level] = 0 if grow else self._skipped.get(level, 0) + 1
            if level == st.depth or not grow:
                break
            widths.append(width)
            if measured and level < len(layers):
                utility, pool, drafted = layers[level], pools[level], drafted_at[level]
            else:
                measured = False
                vals = sorted((self._alphas(level)[0] * v for v in _diffs(utility)[:width]), reverse=True)
                drafted += st.table.draft_cost(st.b, st.n0 + 1 + kept_before, width) + st.o_node * width + st.o_draft
                pool = _cumsum(sorted([*_diffs(pool), *vals], reverse=True)[: self.total_tokens])
                utility = _cumsum(vals)
            kept_before += width
        return widths, self._plan_of(pool, st.verify_ms, drafted).verified

    def _plan_of(self, pool: list[float], verify_ms: list[float], drafted_ms: float) -> StepPlan:
        """The best the step can do with the nodes drafted so far (cumulative utilities `pool`):
        the k that maximises the expected rate (1 + u_k) / (d + v_k), as break-even reranking picks it."""
        k = break_even_count(pool, verify_ms[: len(pool) + 1], drafted_ms)
        return StepPlan(utility=([0.0, *pool])[k], verified=k, drafted=drafted_ms, verify_cost=verify_ms, values=tuple(_diffs(pool)))

    def _verify_count(self, st: _Step, pool: list[float], drafted_ms: float) -> int:
        """Draft tokens per row to verify: dynamic reranking over the pool's cumulative
        utilities, or `total_tokens` when it is off."""
        self._expected_tokens = None
        if not self.dynamic_rerank:
            self.last_verified = self.total_tokens
        elif self.rerank_rule == "break-even":
            self.last_verified = break_even_count(pool, st.verify_ms[: len(pool) + 1], drafted_ms) if pool else 0
        else:
            n = len(pool)
            t_ms = st.table.target_costs(st.b, st.n0, n + 1)  # f_T(n0, tokens) for tokens = 0..N+1
            cost = [t_ms[j + 1] / max(t_ms[1], 1e-9) for j in range(n + 1)]  # c_0..c_N
            self.last_verified = rerank_count(pool, cost, st.c3) if n else 0
        verified = min(self.last_verified, len(pool))
        self._expected_tokens = 1.0 + (pool[verified - 1] if verified else 0.0)  # per active row: the bonus token and the verified nodes' utility
        return self.last_verified

    def _add(
        self,
        builder: TreeBuilder,
        nodes: torch.Tensor,
        parent_value: torch.Tensor,
        logprobs: torch.Tensor,
        valid: torch.Tensor,
        k: int,
        depth: int,
        masked: bool = False,
        uniforms: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add k children of each node [B, m] (all at depth - 1; values parent_value [B, m], -inf
        at invalid nodes; distributions logprobs [B, m, V]), laid out k per parent in the
        draft's order (top-k, or draw order), give them values, and return their indices and
        values sorted by value, descending ([B, m * k] each). The values are the builder's
        `score` (creation order, -inf at invalid nodes), which reranking reads; with calibration
        each node's calibration cell is kept too (`_cells`), for feedback.

        Top-k children are valued by their own draft probability (cum_logq, or calibrated from
        logq and rank). A sampled child must not be: whether it is kept may not depend on its
        own token (docs/ARCHITECTURE.md), and CAST's widths and verified counts sum the values
        of every candidate, later-drawn siblings included, whose draws depend on the earlier
        ones' tokens. So a sampled child's value uses only what precedes its draw: its parent's
        value, its draw rank and the parent's collision mass log sum_v q(v)^2 (the draft's
        expected probability of its own sample) in place of logq, calibrated per rank like
        logq (or taken as is without calibration), and made non-increasing in the rank so the
        kept siblings are always the first ones drawn. (CAST ranks by these values, so no
        Gumbel keys are computed: `draw_children`.)
        masked: `valid` masks out valid nodes too (a captured layer's padding columns), so top-k
        children take it as well (else a node's validity is its own, from its cum_logq).
        uniforms: drawn children's random numbers [B, m, V] (a captured layer's buffer), or None
        to draw them here.
        """
        start = builder.num_nodes  # the new nodes are columns start..start + m*k - 1
        b, m, _ = logprobs.shape
        cells = gain = None  # [B, m, k] each; gain None: the value is cum_logq (log v(u))
        if self._sampled:
            parents, tokens, logq, child_valid = builder.draw_children(nodes, logprobs, k, valid, uniforms)  # valued below, not by Gumbel keys
            if self.calibrate:
                cells, gain = self._calibrator.drawn_child_rates(logprobs, k)
            else:  # the collision mass itself, the same for each parent's k draws
                gain = collision_log_mass(logprobs).expand(b, m, k)
        else:
            top = torch.topk(logprobs, k, dim=-1)  # [B, m, k]
            if self.calibrate:
                cells, gain = self._calibrator.child_rates(top.values, k)
        if cells is not None:
            self._cells.append(cells.reshape(b, m * k))
        value = None if gain is None else parent_value[:, :, None] + gain  # add_children sets it -inf at invalid nodes
        if self._sampled:
            assert value is not None
            builder.add(parents, tokens, logq, child_valid, sampled=True, score=value.reshape(b, m * k), depth=depth, children_per_parent=k)
        else:
            # invalid parents have cum_logq -inf: their children are invalid without a validity mask
            builder.add_children(nodes, valid if masked else None, top.indices, top.values, score=value, depth=depth)
        top_nodes = torch.sort(builder.score[:, start:], dim=1, descending=True, stable=True)  # [B, m*k] the new nodes, best first
        return top_nodes.indices.add_(start), top_nodes.values

    @property
    def _calibrator(self) -> AcceptanceCalibrator:
        """The calibration table of this step's kind of children (top-k or drawn)."""
        return self._calibrators[self._sampled]

    @property
    def _plain_steps_on(self) -> bool:
        """Steps may draft nothing (`plain_steps`, timed by the wall clock: not when `deterministic`)."""
        return self.plain_steps and not self.deterministic

    @property
    def _learns_costs(self) -> bool:
        """Break-even rules correct the tables with the engine's measured step times (unless `deterministic`)."""
        return (self.prune_rule == "break-even" or self.rerank_rule == "break-even") and not self.deterministic

    def note_plain_step(self) -> None:
        """The engine ran a plain step without asking (`max_draft_rows`): the draft owes its root,
        so the next drafted step is a catch-up, neither an overhead to learn nor a drafted step to
        time (as after a plain step of CAST's own)."""
        self._owed = True
        self.plain_check.expect_catch_up()

    def feedback(self, record: StepRecord) -> None:
        """Calibration: every verified node whose parent was reached (the root, or a node on the
        accepted path) is one observation of (draft probability, sibling rank) -> accepted.
        The depth buffers adapt inside `draft`. Break-even rules also learn the engine's time
        per step beyond what the cost tables predict (`StepOverheads`)."""
        started = time.perf_counter()
        try:
            self._feedback(record)
        finally:
            self._feedback_ms = (time.perf_counter() - started) * 1e3

    def _feedback(self, record: StepRecord) -> None:
        if self._pending_plan is not None and self._pending_plan.values is not None:
            self._settle_plan()  # the step's values (and expected tokens), if `plan_ahead` was not called
        one_off = record.graph_captures > 0  # the step's times include capturing CUDA graphs: learn no time from it
        if self._step_plain is not None and record.step_s > 0:
            active = sum(record.active)
            if active and not one_off:
                tokens = sum(c for c, a in zip(record.committed, record.active, strict=True) if a) / active
                expected = None if self._step_plain else self._expected_tokens
                self.plain_check.observe(len(record.active), self._step_plain, record.step_s * 1e3 + self._feedback_ms, tokens, expected, self._step_relative_cost)
            self._step_plain = None
        if self._catching_up or one_off:  # this step's draft forwarded the tokens owed by plain steps, or it captured graphs: not an overhead
            self.overheads.skip()
            self._catching_up = False
        if self._learns_costs and not one_off:
            self.overheads.observe(record.draft_s * 1e3, record.verify_s * 1e3)
            if record.step_s > 0:  # outside drafting and verification: commits, bookkeeping, the last feedback
                self.overheads.observe_other((record.step_s - record.draft_s - record.verify_s) * 1e3 + self._feedback_ms)
        if not self.calibrate or self._last_tree is None or not record.accepted_nodes:
            return
        cells, parents, valid, logq = self._last_tree
        self._last_tree = None
        self._calibrator.observe_tree(cells, parents, valid, record, logq)

    def state(self) -> dict[str, Any]:
        """Introspection: the last step's layer widths and verified count, and the buffers."""
        return {
            "widths": list(self.last_widths),
            "verified": self.last_verified,
            "buffers": {i: self._buffers.values(i) for i in sorted(self._buffers._buffers)},
            "calibration": self._calibrator.state(),
            "plain_vs_drafted": self.plain_check.state(),
            "overheads_ms": {
                "draft_step": self.overheads.draft_step_ms,
                "draft_layer": self.overheads.draft_ms,
                "draft_node": self.overheads.draft_node_ms,
                "verify": self.overheads.verify_ms,
                "verify_node": self.overheads.verify_node_ms,
                "step_other": self.overheads.other_ms,
            },
        }
