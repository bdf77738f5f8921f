"""DynaTree: confidence-aware adaptive draft trees (Chen, Liu and Li, "DynaTree", 2025).

Each step grows the draft tree breadth-first, one draft forward per level (all expandable
frontier nodes of all rows batched into one `TreeBuilder.expand` call):

- **adaptive branching**: a node u with draft confidence c(u) = max_v q_D(v | u) gets its
  B(u) most likely children, B(u) = B_min if c(u) >= tau_h, B_max if c(u) < tau_l, else B_mid;
- **dynamic depth**: u is expanded iff d(u) < D_max and p(u) >= rho_stop and
  (d(u) < D_0 or p(u) >= rho_deep), with p(u) = exp(cum_logq(u)) its path's draft probability;
- **pruning**: a child with p(child) < tau is never added;
- **node budget**: at most N_max draft tokens per row; when a level's surviving candidates
  exceed what is left, the ones with the highest p are kept;
- **historical adjustment**: after every verification step the windowed acceptance moves
  D_0, tau_h and rho_deep (see `DynaTreePolicy`).

`phase` selects the paper's ablation presets (0 fixed tree ... 3 full DynaTree). The rules
are module-level functions so tests can check each one on hand-built distributions.
See docs/dynatree.md for the rules, defaults, bounds and the differences from the paper's
public code.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from statistics import NormalDist
from typing import TYPE_CHECKING, ClassVar

import torch

from specdec import constants
from specdec.cost.table import CostTable, check_cost_options
from specdec.drafting.builder import Draft, DraftContext, TreeBuilder, check_tree_nodes, check_tree_sampling
from specdec.drafting.calibration import AcceptanceCalibrator
from specdec.drafting.levels import CapturedLevels, fixed_place
from specdec.errors import SpecDecError
from specdec.models.static import node_bucket

if TYPE_CHECKING:
    from specdec.cost.profile import CostTableResolver
    from specdec.sources.base import DraftSource
    from specdec.stats import StepRecord

FREE_TOKENS_ACCELERATOR = 64
"""`free_tokens` on CUDA devices when the pair's forward costs cannot be had (a draft source with
no draft model): a verification forward of up to 64 tokens costs about one token's on a
data-centre GPU (memory-bound: the weights are read once whatever the token count; the H100
observation of issue 18, 3B target). Otherwise the width is measured (`FREE_WIDTH_TOLERANCE`)"""

FREE_WIDTH_TOLERANCE = 0.10
"""a measured free width ends at the knee of the target's costs (`cost_knee`), and at the latest
where a forward over n tokens a row costs more than a forward over one token by this share of the
step's least cost: that forward plus D_0 draft forwards of one token a row (at the same batch size
and context). A dimensionless rule, where a fixed token count holds for one model on one device.
Until 2026-11-26 the share was of the one-token forward alone: on an H100 (3B pair, B = 1) that
ended the width at 12 tokens, where 64 tokens cost 0.9 ms more in a step of about 15 ms and
DynaTree ran 1.2x faster with them (`benchmarks/gpu/2026-11-26`)"""

MIN_MEASURED_FREE = 4
"""tokens a row: a measured free width below this is no knee in the costs, only the price of a
token, and is not used (the paper's rules, which weigh nodes by their probability, instead):
on the bundled pair's CPU profile the width is 1-2 tokens, and a free width of 1-2 would cut every
tree to 1-2 nodes, where the paper's rules verify about 8"""

MEASURED_FREE_CAP = 128
"""tokens a row: the most a measured free width may span (profiles measure n up to 96-128;
costs past their grid are extrapolated, and the tree's buffers grow with the square of its nodes)"""

PHASES = (0, 1, 2, 3)
"""0 fixed tree (D_0, B_mid); 1 + adaptive branching; 2 + dynamic depth; 3 + history adjustment"""

TAU_HIGH_GAP = 0.05
"""the adapted tau_h stays at least this far above tau_l (unless it started closer)"""
TAU_HIGH_CEIL = 0.99
"""upper bound of the adapted tau_h (unless it started higher)"""
RHO_DEEP_CEIL = 0.9
"""upper bound of the adapted rho_deep (unless it started higher)"""
D0_FLOOR = 2
"""lower bound of the adapted D_0 (unless it started lower)"""
RATIO_HIGH, RATIO_LOW = 1.1, 0.9
"""history_rule 'predicted': the windowed ratio of accepted to predicted tokens above which drafting
gets more aggressive (the target accepts over 10% more than the draft's probabilities say) and
below which it gets more conservative"""
HISTORY_RULES = ("predicted", "drafted")
SIGNIFICANCE = 0.975
"""history_rule 'predicted': a window moves the parameters only when its mean per-step difference
between accepted and predicted tokens is outside this two-sided Student-t interval (95%) of zero
(the steps' own spread): the ratio of one window of W = 10 steps varies by about ±20-30% from noise
alone, so the ±10% band by itself fired on most windows and walked the parameters to a bound in
whichever direction a small bias pointed"""


def t_critical(dof: int) -> float:
    """The Student-t quantile `SIGNIFICANCE` (0.975) with `dof` degrees of freedom (dof >= 1), from
    the Cornish-Fisher expansion around the normal quantile: 4.17 at dof = 2 (exact 4.30), 3.16 at
    3 (3.18), 2.262 at 9 (2.262), within 0.1% beyond; a little eager for tiny windows only."""
    z = NormalDist().inv_cdf(SIGNIFICANCE)  # the normal quantile: 1.96
    nu = float(dof)
    return z + (z**3 + z) / (4 * nu) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * nu**2) + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * nu**3)


def significant_difference(pairs: list[tuple[float, float]]) -> bool:
    """Whether the window's accepted tokens differ from the predicted ones by more than noise:
    the mean per-step difference is outside the t interval of zero (`SIGNIFICANCE`), its spread
    estimated from the steps themselves. Windows of fewer than 3 steps cannot tell: True."""
    n = len(pairs)
    if n < 3:
        return True
    diffs = [a - p for a, p in pairs]
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    return abs(mean) > t_critical(n - 1) * math.sqrt(var / n)


# ----- the rules, as pure functions ---------------------------------------------------------


def confidence_branching(logprobs: torch.Tensor, tau_high: float, tau_low: float, b_min: int, b_mid: int, b_max: int) -> torch.Tensor:
    """B(u) from the confidence c(u) = max_v q_D(v | u).

    logprobs: [..., V] draft log-distributions over each node's children.
    Returns [...] int64: b_min where c >= tau_high, b_max where c < tau_low, else b_mid.
    """
    conf = logprobs.max(dim=-1).values.exp()  # [...]
    mid = torch.full_like(conf, b_mid, dtype=torch.long)
    out = torch.where(conf >= tau_high, torch.full_like(mid, b_min), mid)
    return torch.where(conf < tau_low, torch.full_like(mid, b_max), out)


def dynamic_depth_expandable(depth: int | torch.Tensor, cum_logq: torch.Tensor, d0: int, d_max: int, rho_stop: float, rho_deep: float) -> torch.Tensor:
    """The paper's depth gate: d(u) < D_max and p(u) >= rho_stop and (d(u) < D_0 or p(u) >= rho_deep).

    depth: an int (a whole level) or [...] int64; cum_logq: [...] path log-probabilities
    (p(u) = exp(cum_logq)). Returns [...] bool. Compared in log space; -inf (padding) fails.
    """
    depth_t = torch.as_tensor(depth, device=cum_logq.device)
    stop_ok = cum_logq >= _log(rho_stop)
    deep_ok = (depth_t < d0) | (cum_logq >= _log(rho_deep))
    return (depth_t < d_max) & stop_ok & deep_ok & torch.isfinite(cum_logq)


def keep_within_budget(score: torch.Tensor, valid: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """The budget cut of one level: per row, the `budget` valid candidates with the highest score.

    score: [B, n] (cum_logq of each candidate); valid: [B, n] bool; budget: [B] int64 nodes left.
    Ties go to the earlier column (node-major creation order). Returns keep [B, n] bool.
    Example: score [-0.1, -2, -0.5], all valid, budget 2 -> keep [True, False, True].
    """
    b, n = score.shape
    key = score.masked_fill(~valid, float("-inf"))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices  # [B, n]
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(n, device=score.device).expand(b, n).contiguous())  # [B, n]
    return valid & (rank < budget[:, None])


def compact(mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns of the True entries of each row first (in their order), then the others.

    mask: [B, n] bool. Returns (order [B, width] column indices, valid [B, width] bool).
    The padding columns point at distinct non-selected columns (never duplicates of a selected one).
    """
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :width]
    return order, mask.gather(1, order)


def _count_cap(threshold: float, cap: int) -> int:
    """How many nodes of one level can have path probability >= threshold: the path
    probabilities of a level sum to at most 1, so at most floor(1 / threshold) (+1 for
    rounding), and never more than `cap`."""
    return cap if threshold <= 0 else max(1, min(cap, int(1.0 / threshold) + 1))


def cost_knee(ns: list[int], costs: list[float], cap: int) -> int:
    """The knee of a forward's cost against its tokens a row: the k in 1..cap whose curve
    flat-then-linear, f(n) = a + s * max(0, n - k) with s >= 0, fits the measured (n, cost) points
    best (least squares; the smaller k on a tie: between two measured points the knee is not
    known, and the last point measured flat is the one known free). A GPU's memory-bound forward is flat to some
    tens of tokens and rises after; a CPU's rises from the first token (k = 1). Fitting the
    whole curve, not one point against another, keeps the knee where a measurement's noise
    would move a threshold."""
    best_k, best_sse = 1, math.inf
    mean_y = sum(costs) / len(costs)
    eps = 1e-12 * sum(y * y for y in costs)  # rounding: equal fits are ties
    for k in range(1, cap + 1):
        xs = [max(0, n - k) for n in ns]
        mean_x = sum(xs) / len(xs)
        sxx = sum((x - mean_x) ** 2 for x in xs)
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, costs, strict=True)) / sxx) if sxx > 0 else 0.0
        intercept = mean_y - slope * mean_x
        sse = sum((intercept + slope * x - y) ** 2 for x, y in zip(xs, costs, strict=True))
        if sse < best_sse - eps:
            best_k, best_sse = k, sse
    return best_k


def _device_of(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _longest_context(ctx: DraftContext) -> int | None:
    """The longest cache among the active rows, when the host knows it (no device read)."""
    if ctx.host_context_len is None:
        return None
    active = ctx.host_active if ctx.host_active is not None else [True] * len(ctx.host_context_len)
    lengths = [n for n, a in zip(ctx.host_context_len, active, strict=True) if a]
    return max(lengths) if lengths else None


def _log(p: float) -> float:
    return math.log(p) if p > 0 else float("-inf")


# ----- the policy ----------------------------------------------------------------------------


@dataclass
class DynaTreePolicy:
    """DynaTree's adaptive draft tree; every field is a method option (and a CLI flag).

    Drafting (one draft forward per level, rows batched and padded with invalid entries):

    1. Level 0 is the root (the last committed token, depth 0, p = 1); its children come from
       the draft distribution computed by `begin_step`.
    2. Every node u of the frontier proposes its B(u) most likely children (confidence rule;
       phase 0: B_mid for every node). A child v with p(v) < `prune_tau` is dropped.
    3. Budget: each row may add at most `max_nodes` draft tokens per step in total. If a
       level's surviving candidates exceed the row's remaining budget, the remaining-budget
       candidates with the highest p(v) are kept (ties: parent order, then child rank).
    4. A new node is expanded at the next level iff its row has budget left and it passes the
       depth gate: phases 0-1: d < D_0; phases 2-3: d < D_max and p >= rho_stop and
       (d < D_0 or p >= rho_deep). The hard limit `ctx.max_depth` (tokens left - 1) always
       applies, and rows with `ctx.active` False get a root-only tree.

    Depths count draft tokens: the root (last committed token) is depth 0, its children
    depth 1, so D_0 and D_max are the longest draft paths without / with deep expansion.

    Historical adjustment (phase 3, in `feedback`, after every verification step):

    - a_r = mean over the step's active rows with drafted > 0 of accepted_len / drafted (the
      fraction of drafted tokens the accept rule kept); a step where no active row drafted
      anything is skipped (no information);
    - a_bar = mean of the last min(#recorded steps, `history_window`) values of a_r;
    - a_bar > `accept_high` (more aggressive): D_0 += 1, tau_h -= `adjust_step`, rho_deep -= `adjust_step`;
    - a_bar < `accept_low` (more conservative): D_0 -= 1, tau_h += `adjust_step`, rho_deep += `adjust_step`;
    - each clamped to its bounds, which are the nominal ranges widened to contain the
      configured starting value: D_0 in [min(2, d0), d_max]; tau_h in
      [min(tau_low + 0.05, tau_high), max(0.99, tau_high)]; rho_deep in
      [rho_stop, max(0.9, rho_deep)].

    The adapted values live in `cur_d0`, `cur_tau_high`, `cur_rho_deep` (not options); they
    persist across `generate` calls (online learning) until `reset_history()`.
    """

    d0: int = 5
    """D_0, base depth: deeper nodes need p >= rho_deep (phases 0-1: the fixed depth)"""
    d_max: int = 8
    """D_max, hard maximum depth (phases 2-3)"""
    b_min: int = 1
    """children of a confident node (c >= tau_high)"""
    b_mid: int = 2
    """children of a middling node (phase 0: of every node)"""
    b_max: int = 3
    """children of an uncertain node (c < tau_low)"""
    tau_high: float = 0.9
    """tau_h, confidence at or above which a node gets b_min children"""
    tau_low: float = 0.4
    """tau_l, confidence below which a node gets b_max children"""
    prune_tau: float = 0.03
    """tau, a child with path probability p < tau is not added (0 disables pruning)"""
    rho_stop: float = 0.1
    """early stopping: nodes with p < rho_stop are not expanded (phases 2-3; 0 disables)"""
    rho_deep: float = 0.5
    """deep expansion: beyond D_0 only nodes with p >= rho_deep are expanded (phases 2-3)"""
    max_nodes: int = 256
    """N_max, draft tokens per row per step"""
    history_window: int = 10
    """W, steps in the acceptance window (phase 3)"""
    accept_high: float = 0.4
    """a_high: windowed acceptance above it makes drafting more aggressive (phase 3)"""
    accept_low: float = 0.15
    """a_low: windowed acceptance below it makes drafting more conservative (phase 3)"""
    adjust_step: float = 0.05
    """how far tau_h and rho_deep move per adjustment (phase 3)"""
    phase: int = 3
    """ablation preset: 0 fixed tree, 1 +adaptive branching, 2 +dynamic depth, 3 +history"""
    history_rule: str = "predicted"
    """phase 3's signal: 'predicted' compares the accepted tokens with the tree's own prediction
    (the sum of its nodes' path probabilities) over each full window of `history_window` steps
    (aggressive above 1.1x, conservative below 0.9x); 'drafted' is the paper's fraction of drafted
    tokens accepted, a sliding window against accept_low/accept_high"""
    tree_sampling: str = "sampled"
    """when sampling: 'sampled' children drawn from the draft distribution (valued without their own
    token: calibrated per draw rank, or by their Gumbel keys with `calibrate` off), or 'topk' (`TREE_SAMPLING`)"""
    calibrate: bool = True
    """p(u) and c(u) are calibrated acceptance rates learned online from the verifier's verdicts
    (`AcceptanceCalibrator`, as CAST's): p(u) the product of its path's calibrated local rates, c(u)
    the calibrated rate of u's best child, looked up from a top-k child's draft probability or, for
    drawn children, from the draw rank and the parent's collision mass; False: the paper's raw draft
    probabilities, and drawn children valued by their Gumbel keys"""
    free_sampled_children: int = 6
    """children each node draws inside the free width when sampling (T > 0; at least b_max), drawn
    without replacement: inside the free width a node's children cost no verification, and the
    rerank by p keeps the best; a sampled child is accepted with about the target's leftover mass,
    so more draws per node accept more. Bundled pair, T = 1, free_tokens=64: τ 2.96 with 3, 3.41
    with 6, 3.58 with 8 (the chain's 2.45; 8 prompts: on 16 and 32 prompts with two seeds, 6 and 8 were
    within the noise of each other); greedy, where low-ranked children are rarely accepted, the
    same τ with 3, 6 and 8 (3.53, 3.64, 3.50), so greedy steps keep b_max (`proposed_children`)"""
    free_tokens: int | None = None
    """tokens one verification forward takes for about the price of one, over the whole batch (a
    device property). Each row's share, n = free_tokens // B - 1 draft tokens, costs nothing to
    verify, so within it pruning (prune_tau), early stopping (rho_stop) and the confidence cap on
    branching (B(u)), which exist to save verification, are off (every node proposes b_max
    children), each level keeps its n best growing nodes, and the tree is the n best
    nodes by p over all levels (EAGLE-2's rerank) instead of a level-by-level budget; n is capped at
    max_nodes; 0 (or n < 1): the paper's rules. None (default): measured from the pair's forward
    costs on CUDA devices (the knee of the target's cost against tokens a row, per batch size and
    context, `free_width`; the cost profile CAST uses, loaded or measured before decoding), and
    elsewhere only when a cost_profile or cost_table is given, else 0 (a CPU pays for every token)"""
    cost_profile: str | None = None
    """a JSON file from `specdec profile` to measure the free width from (free_tokens None); None: on
    CUDA the pair's profile, found or measured as for CAST, elsewhere no free width"""
    cost_table: CostTable | None = None
    """an injected cost table to measure the free width from (Python API, tests)"""
    name: str = "dynatree"
    uses_draft: bool = True
    requires_cost_table: ClassVar[bool] = False
    """with no draft model to time (n-gram lookup) the free width falls back to `FREE_TOKENS_ACCELERATOR` on CUDA"""

    cur_d0: int = field(init=False, default=0)
    """adapted D_0 (equals d0 until phase 3 adjusts it)"""
    cur_tau_high: float = field(init=False, default=0.0)
    """adapted tau_h"""
    cur_rho_deep: float = field(init=False, default=0.0)
    """adapted rho_deep"""
    adjustments: int = field(init=False, default=0)
    """steps on which the history rule moved the parameters (up or down)"""
    _ratios: deque[float] = field(init=False, repr=False, default_factory=deque)
    """the last `history_window` per-step acceptances a_r (read through `history`)"""
    _calibrators: dict[bool, AcceptanceCalibrator] = field(default_factory=dict, init=False, repr=False)
    """one table per kind of children, top-k (False) and drawn (True): their values mean different
    things (a top-k child's own draft probability, a drawn child's parent collision mass) and are
    accepted by different rules, so a server alternating greedy and sampled requests keeps two"""
    _drawing: bool = field(default=False, init=False, repr=False)
    """whether the step being drafted (and so its feedback) has drawn children"""
    _cells: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)
    """this step's calibration cells per node, [B, n] per add in creation order (calibrated steps only)"""
    _last_tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)
    """the last calibrated step's (cells, parents, valid) in the verified tree's order, for feedback"""
    _free: bool = field(default=False, init=False, repr=False)
    """whether the step being drafted is inside a free verification width (`free_width` > 0)"""
    _calibrating: bool = field(default=False, init=False, repr=False)
    """whether the step being drafted calibrates (`calibrate`, phase >= 1; top-k or drawn children, each kind with its own table)"""
    _rank_limits: dict[tuple[int, float, torch.device], torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    """`_allowed_children`'s per-rank thresholds on log c(u), [k] per (k, tau_h, device)"""
    _predicted_sum: torch.Tensor | None = field(default=None, init=False, repr=False)
    """[B] the last tree's predicted accepted tokens per row (sum of p(u)), kept by `feedback`"""
    _resolver: CostTableResolver | None = field(default=None, init=False, repr=False)
    """the pair's cost tables, once `bind_models` found the free width must be measured"""
    _loaded_table: CostTable | None = field(default=None, init=False, repr=False)
    """`cost_profile` read as is, for a policy used without `bind_models` (no models to check it against)"""
    _free_widths: dict[tuple[int, int], int] = field(default_factory=dict, init=False, repr=False)
    """measured free width (draft tokens a row) per (batch size, context bucket) of `_widths_of`"""
    _widths_of: CostTable | None = field(default=None, init=False, repr=False)
    """the table `_free_widths` was read from (a resolver replaces its table when it measures more batch sizes)"""
    _unread: list[tuple[float, torch.Tensor, list[bool]]] = field(default_factory=list, init=False, repr=False)
    """history rule 'predicted': the window's steps whose predictions are still on the device, each
    (accepted tokens of its counted rows, [B] predicted tokens per row, which rows count), read
    together once the window is full (one host read per window, not one per step)"""

    def __post_init__(self) -> None:
        self._validate()
        self.reset_history()

    # ----- validation --------------------------------------------------------------------
    def _validate(self) -> None:
        if self.free_tokens is not None and (isinstance(self.free_tokens, bool) or not isinstance(self.free_tokens, int) or self.free_tokens < 0):
            raise SpecDecError(
                f"dynatree free_tokens={self.free_tokens!r} must be a non-negative integer (tokens a verification takes for the price of one; "
                "0: the paper's pruning rules); fix --free-tokens"
            )
        for name in ("d0", "d_max", "b_min", "b_mid", "b_max", "max_nodes", "history_window", "free_sampled_children"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecDecError(f"dynatree {name}={value!r} must be a positive integer; fix --{name.replace('_', '-')}")
        for name in ("tau_high", "tau_low", "prune_tau", "rho_stop", "rho_deep", "accept_high", "accept_low", "adjust_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise SpecDecError(f"dynatree {name}={value!r} must be a number; fix --{name.replace('_', '-')}")
        if isinstance(self.phase, bool) or self.phase not in PHASES:
            raise SpecDecError(f"dynatree phase={self.phase!r} must be one of 0, 1, 2, 3 (0 fixed tree, 1 +branching, 2 +dynamic depth, 3 +history); fix --dynatree-phase")
        if self.d0 > self.d_max:
            raise SpecDecError(f"dynatree d0={self.d0} exceeds d_max={self.d_max}; need D_0 <= D_max: lower --d0 or raise --d-max")
        if not self.b_min <= self.b_mid <= self.b_max:
            raise SpecDecError(
                f"dynatree branch bounds b_min={self.b_min}, b_mid={self.b_mid}, b_max={self.b_max} must satisfy 1 <= b_min <= b_mid <= b_max; "
                "fix --b-min/--b-mid/--b-max"
            )
        if not 0 < self.tau_low < self.tau_high < 1:
            raise SpecDecError(
                f"dynatree confidence thresholds tau_low={self.tau_low}, tau_high={self.tau_high} must satisfy 0 < tau_low < tau_high < 1; "
                "fix --tau-low/--tau-high"
            )
        if not 0 <= self.prune_tau < 1:
            raise SpecDecError(f"dynatree prune_tau={self.prune_tau} must be in [0, 1) (0 disables pruning); fix --prune-tau")
        if not 0 <= self.rho_stop < self.rho_deep < 1:
            raise SpecDecError(
                f"dynatree depth thresholds rho_stop={self.rho_stop}, rho_deep={self.rho_deep} must satisfy 0 <= rho_stop < rho_deep < 1; "
                "fix --rho-stop/--rho-deep"
            )
        if not 0 <= self.accept_low < self.accept_high <= 1:
            raise SpecDecError(
                f"dynatree acceptance targets accept_low={self.accept_low}, accept_high={self.accept_high} must satisfy "
                "0 <= accept_low < accept_high <= 1; fix --accept-low/--accept-high"
            )
        if not 0 < self.adjust_step <= 0.5:
            raise SpecDecError(f"dynatree adjust_step={self.adjust_step} must be in (0, 0.5]; fix --adjust-step")
        if self.history_rule not in HISTORY_RULES:
            raise SpecDecError(
                f"dynatree history_rule={self.history_rule!r} must be 'predicted' (accepted against the tree's prediction) "
                "or 'drafted' (the paper's accepted / drafted); fix --history-rule"
            )
        check_tree_sampling(self.tree_sampling)
        if not isinstance(self.calibrate, bool):
            raise SpecDecError(f"dynatree calibrate={self.calibrate!r} must be true or false; fix --calibrate on|off")
        check_cost_options(self.cost_table, self.cost_profile, "dynatree")
        # the largest tree these options can size: the deepest limit, with and without a free width (at batch 1)
        deepest = self.d0 if self.phase < 2 else self.d_max
        free = min(self._free_bound() - 1, self.max_nodes) if self.phase > 0 else 0
        check_tree_nodes(
            max(self.builder_capacity(deepest, 0), self.builder_capacity(deepest, max(free, 0), sampled=True)),
            f"dynatree b_max={self.b_max}, free_sampled_children={self.free_sampled_children}, d_max={self.d_max}, max_nodes={self.max_nodes}, prune_tau={self.prune_tau}",
            "--b-max, --free-sampled-children, --d-max or --max-nodes (or raise --prune-tau)",
        )

    # ----- adaptive state ----------------------------------------------------------------
    @property
    def _calibrator(self) -> AcceptanceCalibrator:
        """The calibration table of the kind of children being drafted (top-k or drawn)."""
        return self._calibrators[self._drawing]

    def reset_history(self) -> None:
        """Forget the acceptance history (and the calibration) and restore the configured D_0, tau_h, rho_deep."""
        self._calibrators = {False: AcceptanceCalibrator.pooled(), True: AcceptanceCalibrator.pooled()}
        self._last_tree = None
        self.cur_d0 = self.d0
        self.cur_tau_high = float(self.tau_high)
        self.cur_rho_deep = float(self.rho_deep)
        self.adjustments = 0
        self._ratios = deque(maxlen=self.history_window)
        self._unread = []
        self._pairs: deque[tuple[float, float]] = deque(maxlen=self.history_window)  # (accepted, predicted) per step
        self._predicted_sum = None
        self._last_ratio: float | None = None  # the last full window's accepted / predicted

    def state(self) -> dict[str, object]:
        """Introspection: the adapted parameters, the history rule's moves and last full window's
        accepted / predicted ratio, and the calibration table of each kind of children."""
        return {
            "d0": self.cur_d0,
            "tau_high": self.cur_tau_high,
            "rho_deep": self.cur_rho_deep,
            "adjustments": self.adjustments,
            "last_window_ratio": self._last_ratio,
            "free_widths": {f"batch {b}, context bucket {c}": n for (b, c), n in self._free_widths.items()},
            "calibration": {"top-k": self._calibrators[False].state(), "drawn": self._calibrators[True].state()},
        }

    def bounds(self) -> dict[str, tuple[float, float]]:
        """The closed ranges the history rule keeps D_0, tau_h and rho_deep in."""
        return {
            "d0": (min(D0_FLOOR, self.d0), self.d_max),
            "tau_high": (min(self.tau_low + TAU_HIGH_GAP, self.tau_high), max(TAU_HIGH_CEIL, self.tau_high)),
            "rho_deep": (self.rho_stop, max(RHO_DEEP_CEIL, self.rho_deep)),
        }

    @property
    def history(self) -> deque[float]:
        """The last `history_window` per-step acceptances a_r ('predicted': accepted over predicted
        tokens; reading it mid-window reads the window's predictions so far: a host read)."""
        self._read_predictions()
        return self._ratios

    def _read_predictions(self) -> None:
        """Move the window's unread steps into `_pairs` and the history: one read for all of them."""
        if not self._unread:
            return
        predicted = torch.cat([p for _, p, _ in self._unread]).tolist()
        start = 0
        for accepted, sums, counted in self._unread:
            expected = float(sum(p for p, c in zip(predicted[start : start + sums.numel()], counted, strict=False) if c))
            start += sums.numel()
            self._pairs.append((accepted, expected))
            self._ratios.append(accepted / expected if expected > 0 else 0.0)
        self._unread = []

    def windowed_acceptance(self) -> float | None:
        """a_bar: with history_rule 'drafted' the mean of the recorded per-step acceptances; with
        'predicted' the window's accepted tokens over its predicted ones (None before the first)."""
        if self.history_rule == "predicted":
            self._read_predictions()
            predicted = sum(p for _, p in self._pairs)
            return sum(a for a, _ in self._pairs) / predicted if predicted > 0 else self._last_ratio
        return sum(self._ratios) / len(self._ratios) if self._ratios else None

    def feedback(self, record: StepRecord) -> None:
        """Calibration: the verdicts on the last tree (every phase that calibrates); phase 3: record
        this step's acceptance and apply the history rule (every step)."""
        if self._last_tree is not None:
            cells, parents, valid = self._last_tree
            self._last_tree = None
            self._calibrator.observe_tree(cells, parents, valid, record)
        if self.phase < 3:
            return
        predicted, self._predicted_sum = self._predicted_sum, None
        if self.history_rule == "predicted":
            if predicted is None:
                return
            counted = [bool(act and dr > 0) for act, dr in zip(record.active, record.drafted, strict=True)][: predicted.shape[0]]
            if not any(counted):
                return
            accepted = float(sum(a for a, c in zip(record.accepted_len, counted, strict=True) if c))
            self._unread.append((accepted, predicted, counted))  # read with the rest of the window, not now
            if len(self._pairs) + len(self._unread) < self.history_window:
                return  # one decision per full window of fresh evidence: a sliding window would move
            a_bar = self._last_ratio = self.windowed_acceptance()  # every step on the same noisy evidence, a random walk to the bounds
            significant = significant_difference(list(self._pairs))
            self._pairs.clear()
            if not significant:  # the window's deviation is within its own noise: no move
                return
            high, low = RATIO_HIGH, RATIO_LOW
        else:
            rates = [acc / dr for act, dr, acc in zip(record.active, record.drafted, record.accepted_len, strict=True) if act and dr > 0]
            if not rates:
                return
            self._ratios.append(sum(rates) / len(rates))
            a_bar = sum(self._ratios) / len(self._ratios)
            high, low = self.accept_high, self.accept_low
        if a_bar is None:
            return
        bounds = self.bounds()
        d0_lo, d0_hi = bounds["d0"]
        th_lo, th_hi = bounds["tau_high"]
        rd_lo, rd_hi = bounds["rho_deep"]
        if a_bar > high:
            self.cur_d0 = int(min(self.cur_d0 + 1, d0_hi))
            self.cur_tau_high = round(max(self.cur_tau_high - self.adjust_step, th_lo), 6)
            self.cur_rho_deep = round(max(self.cur_rho_deep - self.adjust_step, rd_lo), 6)
            self.adjustments += 1
        elif a_bar < low:
            self.cur_d0 = int(max(self.cur_d0 - 1, d0_lo))
            self.cur_tau_high = round(min(self.cur_tau_high + self.adjust_step, th_hi), 6)
            self.cur_rho_deep = round(min(self.cur_rho_deep + self.adjust_step, rd_hi), 6)
            self.adjustments += 1

    # ----- the free verification width ----------------------------------------------------
    def measures_free_width(self, device: torch.device) -> bool:
        """Whether the free width comes from measured forward costs: free_tokens unset, a tree
        that adapts (phase > 0), and a table given or a CUDA device (where one is found or measured)."""
        if self.free_tokens is not None or self.phase == 0:
            return False
        return self.cost_table is not None or self.cost_profile is not None or device.type == "cuda"

    def bind_models(self, target: torch.nn.Module, draft: torch.nn.Module | None, resolver: CostTableResolver | None = None) -> None:
        """Give the policy the pair, so it can find (or measure) their cost profile when its free
        width is measured (`measures_free_width`); otherwise nothing is loaded or measured. The
        table is prepared now for batch 1, before any generation is timed (`prepare_costs`
        extends it to a session's largest batch). resolver: a shared one of the same models."""
        if draft is None or self.cost_table is not None or not self.measures_free_width(_device_of(target)):
            return
        from specdec.cost.profile import bound_resolver

        self._resolver = bound_resolver(target, draft, self.cost_profile, resolver)

    def wants_cost_table(self, device: torch.device) -> bool:
        """Whether `bind_models` on a target on `device` loads or measures a cost table."""
        return self.cost_table is None and self.measures_free_width(device)

    def prepare_costs(self, max_batch: int) -> None:
        """Before decoding: the cost table covers batches of up to `max_batch` rows (never measured inside a step)."""
        if self._resolver is not None:
            self._resolver.prepare(max_batch)

    def _free_bound(self) -> int:
        """The widest free width (tokens a row, root included) these options allow: for sizing checks."""
        if self.free_tokens is not None:
            return self.free_tokens
        return max(FREE_TOKENS_ACCELERATOR, min(MEASURED_FREE_CAP, self.max_nodes + 1))

    def free_width(self, batch: int, device: torch.device, context: int | None = None) -> int:
        """Draft tokens per row inside the verification's free width at `batch` rows on `device`
        with caches of about `context` tokens, at most the node budget N_max (`max_nodes`, which also
        bounds the builder's buffers), or 0 (the paper's rules) when that is below 1 or in phase 0
        (the fixed tree). free_tokens given: free_tokens // batch - 1. Measured: n - 1 for n the
        knee of the target's forward costs against tokens a row (`cost_knee`, at most
        `MEASURED_FREE_CAP`), from the cost table at this batch size and context (interpolated
        between measured ones; the smallest context when unknown), cut where a forward over n
        tokens costs more than one over one token by `FREE_WIDTH_TOLERANCE` of the step's least
        cost (that forward plus D_0 one-token draft forwards); 0 when n < `MIN_MEASURED_FREE`.
        On CUDA with no table to be had, `FREE_TOKENS_ACCELERATOR` // batch - 1."""
        if self.phase == 0:
            return 0
        batch = max(batch, 1)
        table = self._cost_table() if self.measures_free_width(device) else None
        if table is not None:
            n = self._measured_free_width(table, batch, context)
        elif self.free_tokens is not None:
            n = self.free_tokens // batch - 1
        else:
            n = FREE_TOKENS_ACCELERATOR // batch - 1 if device.type == "cuda" else 0
        n = min(n, self.max_nodes)
        return n if n >= 1 else 0

    def _cost_table(self) -> CostTable | None:
        if self.cost_table is not None:
            return self.cost_table
        if self._resolver is not None:
            return self._resolver.table_for(1)
        if self.cost_profile is not None:
            if self._loaded_table is None:
                self._loaded_table = CostTable.load(self.cost_profile)
            return self._loaded_table
        return None

    def _measured_free_width(self, table: CostTable, batch: int, context: int | None) -> int:
        bucket = table.select(context if context is not None else table.contexts[0])
        if table is not self._widths_of:  # another table: its widths are read afresh
            self._widths_of, self._free_widths = table, {}
        key = (batch, bucket)
        cached = self._free_widths.get(key)
        if cached is None:
            costs = table.target_costs(batch, bucket, MEASURED_FREE_CAP)  # [0, f(1), ..., f(cap)] ms
            grid = [n for n in table.n_grid if n <= MEASURED_FREE_CAP]  # the measured points (costs between them are interpolated)
            knee = cost_knee(grid, [costs[n] for n in grid], MEASURED_FREE_CAP)
            step_floor = costs[1] + self.d0 * table.draft_cost(batch, bucket, 1)  # the least a step costs: verification and D_0 draft levels
            limit = costs[1] + FREE_WIDTH_TOLERANCE * step_floor
            flat = max(n for n in range(1, MEASURED_FREE_CAP + 1) if costs[n] <= limit)  # costs are non-decreasing in n
            # a curve that rises gently from the first token, as a GPU's does at small batches
            # (on an H200 a 3B target's forward over 8 tokens a row cost 8% more than over one, over
            # 96 tokens 20%: about log-shaped), has no hinge: the fit puts its knee at 1-2 tokens,
            # which gave the paper's rules (no free width) exactly where verification is cheapest.
            # There the tolerance alone says how far a verification stays about one token's price,
            # measured against what a step costs anyway.
            widest = flat if knee < MIN_MEASURED_FREE else min(knee, flat)
            # a width exists only where verification is nearly free from the start: a forward over
            # MIN_MEASURED_FREE tokens within the tolerance of one over one token (a CPU's costs,
            # linear from the first token, have none; measured against the step alone, a draft
            # that costs as much as the target would make a few CPU tokens look free)
            gentle = costs[MIN_MEASURED_FREE] <= costs[1] * (1.0 + FREE_WIDTH_TOLERANCE)
            cached = self._free_widths[key] = widest - 1 if gentle and widest >= MIN_MEASURED_FREE else 0
        return cached

    # ----- drafting ----------------------------------------------------------------------
    def proposed_children(self, free: int, sampled: bool) -> int:
        """Children each node proposes: b_mid (phase 0, the fixed tree), inside a free width of
        `free` draft tokens a row with drawn children max(b_max, free_sampled_children), else b_max."""
        if self.phase == 0:
            return self.b_mid
        return max(self.b_max, self.free_sampled_children) if free and sampled else self.b_max

    def level_caps(self, free: int, sampled: bool = False) -> tuple[int, int]:
        """(candidates a level keeps, nodes a frontier holds) inside a free width of `free` draft
        tokens per row, or under the paper's rules (free = 0); sampled: the children are drawn."""
        if free:
            return free * self.proposed_children(free, sampled), free
        level_cap = _count_cap(self.prune_tau, self.max_nodes)  # nodes a level can hold: sum of p over a level <= 1
        return level_cap, _count_cap(self.rho_stop, level_cap) if self.phase >= 2 else level_cap

    def builder_capacity(self, limit: int, free: int, sampled: bool = False) -> int:
        """Nodes a step's builder holds for a tree `limit` levels deep: the root and every level's
        candidates uncompacted (top-k levels add all m * k, invalid ones included)."""
        return 1 + self.proposed_children(free, sampled) * (1 + max(0, limit - 1) * self.level_caps(free, sampled)[1])

    def depth_limit(self, ctx: DraftContext) -> int:
        """Deepest node depth this step: D_0 (phases 0-1) or D_max (phases 2-3), capped by ctx.max_depth."""
        return max(0, min(self.cur_d0 if self.phase < 2 else self.d_max, ctx.max_depth))

    def branching(self, logprobs: torch.Tensor) -> torch.Tensor:
        """B(u) for frontier distributions logprobs [B, m, V] -> [B, m] int64 (phase 0: b_mid)."""
        if self.phase == 0:
            return torch.full(logprobs.shape[:-1], self.b_mid, dtype=torch.long, device=logprobs.device)
        return confidence_branching(logprobs, self.cur_tau_high, self.tau_low, self.b_min, self.b_mid, self.b_max)

    def expandable(self, depth: int, cum_logq: torch.Tensor, limit: int) -> torch.Tensor:
        """Depth gate for nodes at `depth` with path log-probs cum_logq [B, k] -> [B, k] bool."""
        if self.phase < 2:
            return torch.full_like(cum_logq, depth < limit, dtype=torch.bool) & torch.isfinite(cum_logq)
        return dynamic_depth_expandable(depth, cum_logq, self.cur_d0, limit, self.rho_stop, self.cur_rho_deep)

    def _allowed_children(self, top_logq: torch.Tensor, k: int, device: torch.device) -> torch.Tensor:
        """Which of each node's k top children the confidence rule keeps (rank < B(u)).

        top_logq: [B, m, 1] log c(u) (the node's best child's log-prob, or its calibrated rate).
        Returns [k] (phase 0: b_mid for every node; inside the free width: all k, B(u) exists to save
        nodes that cost nothing there) or [B, m, k] bool. With b_min <= b_mid <= b_max,
        rank < B(u) iff log c(u) < T[rank], with T = +inf below b_min, log tau_h below b_mid, log
        tau_l below b_max and -inf from b_max on (the same B(u) as `confidence_branching`): one
        comparison against a per-rank table cached per (k, tau_h)."""
        if self.phase == 0:
            return constants.below(k, self.b_mid, device)
        if self._free:  # inside the free width every proposed child is a candidate: the rerank by p decides
            return constants.below(k, k, device)
        key = (k, self.cur_tau_high, device)
        table = self._rank_limits.get(key)
        if table is None:
            limits = [math.inf if r < self.b_min else _log(self.cur_tau_high) if r < self.b_mid else _log(self.tau_low) if r < self.b_max else -math.inf for r in range(k)]
            table = self._rank_limits[key] = torch.tensor(limits, device=device)  # [k]
        return top_logq < table

    def _growing(self, depth: int, node_valid: torch.Tensor, score: torch.Tensor, limit: int, rho_stop: float) -> torch.Tensor | None:
        """Which of a level's nodes (all at `depth`) get children, [B, w] bool; None when no
        node of that depth may (the depth limit). Phases 0-1: every valid node above the limit;
        phases 2-3: the paper's gate p(u) >= rho_stop and (d(u) < D_0 or p(u) >= rho_deep), with
        the depth parts decided on the host (one comparison on the device). rho_stop: the
        option, or 0 inside the free width."""
        if depth >= limit:
            return None
        threshold = self._growth_threshold(depth, rho_stop)
        if threshold is None or threshold == float("-inf"):  # every valid node (inside a free width above D_0): no op
            return node_valid
        return score >= threshold  # invalid nodes have score -inf (the builder writes it): the comparison alone

    def _growth_threshold(self, depth: int, rho_stop: float) -> float | None:
        """The log p(u) a node at `depth` needs to grow (`_growing`): None in phases 0-1 (every valid node grows)."""
        if self.phase < 2:
            return None
        return _log(rho_stop) if depth < self.cur_d0 else max(_log(rho_stop), _log(self.cur_rho_deep))

    def _growth_reads(self, depth: int) -> bool:
        """Inside the free width (no early stop): whether which nodes at `depth` grow depends on
        their values (the deep-expansion gate p(u) >= rho_deep, from D_0 on, phases 2-3), so the
        level needs its host read; shallower than D_0 (and in phases 0-1) every valid node grows."""
        return self.phase >= 2 and depth >= self.cur_d0

    def _add_top_level(
        self, builder: TreeBuilder, frontier: torch.Tensor, frontier_valid: torch.Tensor, logprobs: torch.Tensor, k: int, log_tau: float, depth: int
    ) -> torch.Tensor:
        """A level of top-k children where no node budget binds: one topk, the branching mask and
        one add. frontier, frontier_valid: [B, m]; logprobs: [B, m, V]; returns the children [B, m*k]
        (their table cells appended to `_cells` when calibrating)."""
        dev = frontier.device
        m = frontier.shape[1]
        top = torch.topk(logprobs, k, dim=-1)  # [B, m, k]
        # inside the free width every proposed child of a frontier node is a candidate (no branching cap,
        # no pruning): its validity is the node's (frontier padding points at real, non-growing nodes)
        every_child = self._free and log_tau == float("-inf")
        if self._calibrating:  # p(child) = p(u) x the child's calibrated local rate; c(u) = the best child's rate
            cells, gain = self._calibrator.child_rates(top.values, k)  # [B, m, k] each
            self._cells.append(cells.view(cells.shape[0], m * k))
            value = builder.score.gather(1, frontier)[:, :, None] + gain  # [B, m, k]
            if every_child:
                return builder.add_children(frontier, frontier_valid, top.indices, top.values, score=value, depth=depth)  # [B, m*k]
            allowed = self._allowed_children(gain[:, :, :1], k, dev) & (value >= log_tau)  # [B, m, k]
            allowed &= frontier_valid[:, :, None]
            return builder.add_children(frontier, allowed, top.indices, top.values, score=value, depth=depth)  # [B, m*k]
        allowed = frontier_valid if every_child else frontier_valid[:, :, None] & self._allowed_children(top.values[:, :, :1], k, dev)  # rank < B(u)
        return builder.add_children(frontier, allowed, top.indices, top.values, min_cum_logq=log_tau, depth=depth)  # [B, m*k]

    @staticmethod
    def _free_frontier(builder: TreeBuilder, grow: torch.Tensor, start: int, free: int, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inside the free width: the level's (builder columns start..) `free` best growing nodes by
        p, growing ones first. grow: [B, w], which of the level's nodes grow (`_growing`), or
        `valid` itself, their validity, when every valid one does. Returns their columns within the
        level and whether each grows, [B, min(w, free)] each."""
        cap = min(grow.shape[1], free)
        score = builder.score[:, start:]
        if grow is not valid:  # the valid nodes that do not grow go last (invalid ones are -inf already)
            score = score.masked_fill(~grow, float("-inf"))
        order = torch.topk(score, cap, dim=1).indices  # [B, cap]
        return order, grow.gather(1, order)

    def _captured_levels(
        self, levels: CapturedLevels, builder: TreeBuilder, limit: int, k: int, free: int, log_tau: float, sampled: bool
    ) -> int:
        """Every level inside the free width, from the root's children down, each replayed as one
        graph (`specdec.drafting.levels`): the forward of the frontier [B, m] (nodes at `depth`;
        the root's distribution, copied to a level buffer, for the first level), their top-k or
        drawn children, which grow and the next frontier. Between two levels the host reads the
        growing count only where op by op reads it: where the deep-expansion gate decides it
        (`_growth_reads`), under the root's children only for drawn ones. Drawn children read their
        random numbers from a buffer filled before the level (as op by op draws them) and the
        frontier's distributions, kept for verification, go to an output buffer. Each level sits
        at its fixed place (`levels.fixed_place`). Returns the depth of the last level's frontier."""
        b = builder.batch_size
        vocab = builder.root_logprobs.shape[-1]
        root = levels.buffer(("dist", 0), builder.root_logprobs[:, None, :])  # [B, 1, V]
        if sampled:  # the kept root distribution: the buffer (`CapturedLevels.finish` reads it there)
            builder._dist_chunks[0] = root
        frontier, frontier_valid, depth = builder.root, builder.root_valid, 0
        while True:
            last = depth + 1 >= limit  # the children are at the depth limit: nothing grows under them
            m = frontier.shape[1]
            if depth:
                levels.place(*fixed_place(depth, k, free))  # room for `free` nodes a level (`builder_capacity`)
            threshold = None if last else self._growth_threshold(depth + 1, 0.0)
            cap = min(m * k, free)
            # the next frontier: the first `cap` columns of one buffer per depth, read by the next level at one address whatever m
            next_frontier = levels.output(("frontier", depth + 1), (b, free), torch.long)[:, :cap]
            next_valid = levels.output(("frontier_valid", depth + 1), (b, free), torch.bool)[:, :cap]
            cells = levels.output(("cells", depth + 1, m), (b, m * k), torch.long) if self._calibrating else None
            tables = self._calibrator.device_tables(builder.device) if self._calibrating else ()
            shape = (b, m, vocab)
            uniforms = levels.uniforms(("uniforms", depth, m), shape) if sampled else None  # the draws' random numbers
            # the frontier's distributions: the root's buffer, or the level's forward into an output buffer (kept when sampling)
            dists = root if depth == 0 else levels.output(("dist", depth, m), shape, builder.root_logprobs.dtype) if sampled else None
            body = partial(self._captured_level, builder, frontier, frontier_valid, next_frontier, next_valid, cells, k, free, log_tau, depth, limit, uniforms, dists)
            reads = (frontier, frontier_valid, next_frontier, next_valid, *((cells,) if cells is not None else ()), *tables)
            reads += tuple(t for t in (uniforms, dists) if t is not None)
            levels.run(("level", depth, m, threshold), body, reads=reads, lists=(self._cells,))
            if cells is not None and depth and m < free:  # the cells line up with the builder's columns: the hole's too
                self._cells.append(constants.full((b, (free - m) * k), 0, torch.long, builder.device))
            if last:
                return depth
            frontier, frontier_valid, depth = next_frontier, next_valid, depth + 1
            if self._growth_reads(depth) and (depth > 1 or sampled):  # how many nodes grow: the level's one host read
                cut = self._growing_frontier(frontier, frontier_valid)
                if cut is None:
                    return depth - 1
                frontier, frontier_valid = cut

    @staticmethod
    def _growing_frontier(frontier: torch.Tensor, frontier_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A free-width frontier [B, m] (growing nodes first) cut to the node bucket of its largest
        row's growing count (one host read); None when nothing grows."""
        n_growing = int(frontier_valid.sum(dim=1).amax())
        if not n_growing:
            return None
        n_growing = min(node_bucket(n_growing), frontier_valid.shape[1])
        return frontier[:, :n_growing], frontier_valid[:, :n_growing]

    def _captured_level(
        self,
        builder: TreeBuilder,
        frontier: torch.Tensor,
        frontier_valid: torch.Tensor,
        next_frontier: torch.Tensor,
        next_valid: torch.Tensor,
        cells: torch.Tensor | None,
        k: int,
        free: int,
        log_tau: float,
        depth: int,
        limit: int,
        uniforms: torch.Tensor | None,
        dists: torch.Tensor | None,
    ) -> torch.Tensor:
        """A captured level's body (`_captured_levels`): writes the next frontier's builder
        columns and whether each grows to next_frontier, next_valid [B, min(m*k, free)], and
        the children's table cells to `cells` [B, m*k] when calibrating. uniforms: drawn
        children's random numbers [B, m, V] (None: top-k children). dists [B, m, V]: at depth 0
        the root's distribution; below, where the frontier's forward writes its distributions
        (None: anywhere, when they are not kept)."""
        logprobs = dists if depth == 0 else builder.expand(frontier, frontier_valid, depth=depth, out=dists)  # [B, m, V]
        assert logprobs is not None
        start = builder.num_nodes
        if uniforms is not None:
            m = frontier.shape[1]
            self._add_level_with_budget(builder, frontier, frontier_valid, logprobs, k, m * k, log_tau, True, depth + 1, budget_binds=False, uniforms=uniforms)
        else:
            self._add_top_level(builder, frontier, frontier_valid, logprobs, k, log_tau, depth + 1)
        if cells is not None:  # the level's cells at a fixed address, for feedback
            self._cells[-1] = cells.copy_(self._cells[-1])
        valid = builder.last_valid
        grow = self._growing(depth + 1, valid, builder.score[:, start:], limit, 0.0)
        if grow is None:
            return valid
        order, grows = self._free_frontier(builder, grow, start, free, valid)
        next_valid.copy_(grows)
        return torch.add(order, start, out=next_frontier)

    def _add_level_with_budget(
        self,
        builder: TreeBuilder,
        frontier: torch.Tensor,
        frontier_valid: torch.Tensor,
        logprobs: torch.Tensor,
        k: int,
        level_cap: int,
        log_tau: float,
        sampled: bool,
        depth: int,
        budget_binds: bool = True,
        uniforms: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One level the general way (drawn children, or a node budget that may bind): the
        children of each frontier node (B(u) of its k candidates), pruned by path probability,
        cut to each row's remaining budget (when `budget_binds`: the level's candidates may
        reach it), compacted and added at `depth`. Returns their indices [B, w] and which rows
        have budget left ([B] bool; None when the budget could not bind). uniforms: the draws'
        random numbers [B, m, V] (a captured level's buffer), or None to draw them here."""
        dev = frontier.device
        b, m = frontier.shape
        budget = self.max_nodes - (builder.valid.sum(dim=1) - 1) if budget_binds else None  # [B] draft tokens each row may still add
        cells = None
        if sampled and self._calibrating:
            # drawn children are valued without their own token: the parent's value times the calibrated
            # rate of the draw rank given the parent's collision mass, non-increasing in the rank so that
            # pruning and the budget keep the first draws (as CAST's)
            parents, tokens, logq, valid = builder.draw_children(frontier, logprobs, k, frontier_valid, uniforms)  # each [B, m*k]
            cells, gain = self._calibrator.drawn_child_rates(logprobs, k)  # [B, m, k] each
            cum = builder.score.gather(1, parents) + gain.view(b, m * k)
        elif sampled:  # uncalibrated: drawn children are pruned and cut by their Gumbel keys, never by their own logq
            parents, tokens, logq, valid, cum = builder.sample_children(frontier, logprobs, k, frontier_valid, uniforms)  # each [B, m*k]
        else:
            parents, tokens, logq, valid = builder.top_children(frontier, logprobs, k, frontier_valid)  # each [B, m*k]
            if self._calibrating:  # p(child): the parent's calibrated value times the child's calibrated local rate
                cells, gain = self._calibrator.child_rates(logq.view(b, m, k), k)  # [B, m, k] each
                cum = builder.score.gather(1, parents) + gain.view(b, m * k)
            else:
                cum = builder.cum_logq.gather(1, parents) + logq  # [B, m*k] p(child) in log space
        if self._free and log_tau == float("-inf"):
            # inside the free width every proposed child is a candidate (no branching cap, no pruning): its
            # parent's validity (in `valid` already) and a token inside the draft's support
            valid = valid & (logq > float("-inf"))
        else:
            # rank < B(u), with c(u) the calibrated rate of u's best child or the draft's own confidence
            log_conf = gain[:, :, :1] if cells is not None else logprobs.amax(dim=-1, keepdim=True)  # [B, m, 1] log c(u)
            allowed = (self._allowed_children(log_conf, k, dev) & frontier_valid[:, :, None]).reshape(b, m * k)
            valid = valid & allowed & (logq > float("-inf"))
            valid = valid & (cum >= log_tau)  # probability-threshold pruning
        if budget is not None:
            valid = keep_within_budget(cum, valid, budget)  # strict node budget
        # a static width, no read: path probabilities of a level sum to at most 1; Gumbel keys of
        # drawn children and calibrated rates have no such bound, so their level keeps every
        # candidate column (the builder has room for uncompacted levels; the level's read in
        # `draft` cuts the frontier and `finish` the tree to the counts that are real)
        width = min(valid.shape[1], level_cap) if not (sampled or cells is not None) else valid.shape[1]
        keyed = sampled or cells is not None  # nodes carry their own score (keys or calibrated rates)
        if width < valid.shape[1]:  # top-k by path probability only: valid candidates first, cut to the static width
            order, valid = compact(valid, width)  # [B, w]
            parents, tokens, logq = parents.gather(1, order), tokens.gather(1, order), logq.gather(1, order)
        # else every candidate column stays where it was proposed, invalid ones included: `finish`
        # keeps only valid nodes, in builder order, so the tree is the one compaction would give
        if cells is not None:
            self._cells.append(cells.reshape(b, m * k))
        nodes = builder.add(parents, tokens, logq, valid, sampled=sampled, score=cum if keyed else None, depth=depth, children_per_parent=k)  # [B, w]
        return nodes, None if budget is None else budget > builder.last_valid.sum(dim=1)

    def draft(self, source: DraftSource, roots: torch.Tensor, ctx: DraftContext) -> Draft:
        limit = self.depth_limit(ctx)
        sampled = ctx.samples_children(self.tree_sampling)
        self._drawing = sampled
        self._calibrating = self.calibrate and self.phase > 0  # phase 0 (fixed tree) has no p(u) or c(u) to calibrate
        self._last_tree = None  # a step that does not calibrate leaves nothing for feedback to pair with its record
        # inside the verification's free width: no pruning, no early stop; each level's `free` best
        # growing nodes form the next frontier (a node outside them is outside the final best `free`,
        # and so are its children, whose p is lower) and the tree is the `free` best nodes by p
        free = self.free_width(roots.shape[0], roots.device, _longest_context(ctx))
        proposed = self.proposed_children(free, sampled)
        self._free = bool(free)
        rho_stop = 0.0 if free else self.rho_stop
        level_cap, frontier_cap = self.level_caps(free, sampled)
        # inside the free width every level's shape is fixed by the host's options (top-k or drawn
        # children), so levels can replay as captured graphs (`_captured_levels`)
        levels = None
        if free and limit > 1:
            levels = CapturedLevels.for_step(source, ("dynatree", self.phase, proposed, free, self._calibrating, sampled), sampled=sampled)
        # capacity for the deepest tree the options allow, not this step's (a row's last tokens cap it):
        # one size of node buffers, so captured levels keep their addresses (and graphs) to the end
        capacity = self.builder_capacity(self.cur_d0 if self.phase < 2 else self.d_max, free, sampled)
        builder = TreeBuilder(source, roots, ctx, keep_draft_probs=sampled, capacity=capacity, workspace=levels and levels.workspace)
        dev = roots.device
        log_tau = float("-inf") if free else _log(self.prune_tau)
        frontier, frontier_valid = builder.root, builder.root_valid  # [B, m] builder indices to expand (finished rows: nothing grows)
        logprobs = builder.root_logprobs[:, None, :]  # [B, m, V] children distributions of the frontier
        vocab = logprobs.shape[-1]
        tree_width = 1  # nodes of the largest row so far: exact after a read, an upper bound between reads
        k = min(proposed, vocab)  # children proposed per node (B(u) <= k masks the rest)
        predicts = self.phase >= 3 and self.history_rule == "predicted"
        self._predicted_sum = None
        calibrating = self._calibrating
        self._cells = [constants.full((roots.shape[0], 1), 0, torch.long, dev)] if calibrating else []  # the root's cell (never observed)
        if levels is not None:  # every level, the root's children's included, replays as a captured graph
            levels.begin(builder, step_slots=(limit - 1) * node_bucket(free), fixed_layout=True)
            last = self._captured_levels(levels, builder, limit, k, free, log_tau, sampled)
            levels.place(*fixed_place(last + 1, k, free))  # the selection after the last level's room: its key follows the depth alone
        for depth in range(limit if levels is None else 0):  # the frontier sits at `depth`, its children at depth + 1
            start = builder.num_nodes
            m = frontier.shape[1]
            room = None  # [B] bool: rows with budget left after this level (None: all, the budget cannot bind)
            # the node budget may cut this level; inside the free width it cannot (only the `free` best
            # nodes are verified, free <= max_nodes, and the builder has room for every level)
            budget_binds = not free and tree_width - 1 + m * k >= self.max_nodes
            if sampled or budget_binds:  # drawn children, or the node budget may cut this level
                nodes, room = self._add_level_with_budget(builder, frontier, frontier_valid, logprobs, k, level_cap, log_tau, sampled, depth + 1, budget_binds)
            else:  # top-k children; the budget cannot bind: one topk, the branching mask and one add
                nodes = self._add_top_level(builder, frontier, frontier_valid, logprobs, k, log_tau, depth + 1)
            tree_width += nodes.shape[1]  # an upper bound until the next read
            # p(u): cum_logq, or the node's score: its calibrated value, or for uncalibrated drawn nodes their Gumbel key
            valid = builder.last_valid
            grow = self._growing(depth + 1, valid, builder.score[:, start:], limit, rho_stop)  # [B, w] or None (no deeper level)
            if grow is not None and room is not None:
                grow = grow & room[:, None]
            last = grow is None
            if not last and free:  # the level's `free` best growing nodes by p, growing ones first
                assert grow is not None
                order, frontier_valid = self._free_frontier(builder, grow, start, free, valid)  # [B, cap] each
            elif not last:
                assert grow is not None
                growing, order = torch.sort(grow, dim=1, descending=True, stable=True)  # growing nodes first, in creation order
                # path probabilities bound how many nodes of a level can grow (no read); Gumbel keys and
                # calibrated rates do not, so their frontier is cut to the count read below
                cap = min(grow.shape[1], frontier_cap if not (sampled or calibrating) else grow.shape[1])
                frontier_valid, order = growing[:, :cap], order[:, :cap]  # [B, m']
            if free and (last or not self._growth_reads(depth + 1)):
                # inside the free width growth at depths before the gate's D_0 is every valid node (no early
                # stop), so the frontier is the static `free` best of them and nothing needs reading;
                # the tree is cut to `free` columns by `finish`, so its width is not needed either
                if last:
                    break
            elif last or depth > 0 or sampled or room is not None:
                # the level's one host read: the largest row's node count (the tree's width) and the largest
                # row's count of growing nodes (0: nothing grows). Skipped after the first level when no budget
                # binds (the root's children nearly always grow; if none does, the next level adds nothing and
                # its read stops the loop)
                counts = builder.valid.sum(dim=1) if grow is None else torch.stack([builder.valid.sum(dim=1), grow.sum(dim=1)])  # [B] or [2, B]
                head = counts.amax(dim=-1).reshape(-1).tolist()
                tree_width, n_growing = int(head[0]), 0 if last else int(head[1])
                if last or not n_growing:
                    break
                if free:  # a few static widths (forwards are bucketed anyway): padding columns are not growing
                    n_growing = min(node_bucket(n_growing), frontier_valid.shape[1])
                if n_growing < frontier_valid.shape[1]:
                    frontier_valid, order = frontier_valid[:, :n_growing], order[:, :n_growing]
            frontier = order + start
            logprobs = builder.expand(frontier, frontier_valid, depth=depth + 1)  # [B, m', V]: one draft forward per level
        keep = builder.top_by_score(None, free) if free else builder.valid  # [B, N]: the free width's best nodes by p, or every valid one
        if predicts:  # each row's predicted accepted tokens: the sum of p(u) over its kept nodes (-inf at invalid ones), read in `feedback`
            value = (builder.score if calibrating else builder.cum_logq)[:, 1:]
            self._predicted_sum = (value.masked_fill(~keep[:, 1:], float("-inf")) if free else value).exp().sum(dim=1)  # [B]
        # the kept nodes only (levels are padded to a static width): `tree_width` columns, or the free width's
        if levels is not None:  # replayed like a level, into fixed buffers (the keep mask read from one)
            kept = levels.buffer(("keep",), keep)
            drafted = levels.finish(lambda: builder.finish(kept, width=1 + free), width=1 + free, reads=(kept,))
        else:
            drafted = builder.finish(keep, width=1 + free if free else tree_width)
        if calibrating:
            tree = drafted.tree
            self._last_tree = (torch.cat(self._cells, dim=1).gather(1, drafted.builder_nodes), tree.parents, tree.valid)
        return drafted
