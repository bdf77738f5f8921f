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

With all three switched off (or thresholds 0) CAST is exactly `Eagle2Policy`. The rules
are module-level functions so tests check each on hand-built numbers. docs/cast.md lists
every place where the paper is vague and the choice made here.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdec.cost.table import CostTable
from specdec.drafting.builder import DraftContext, TreeBuilder
from specdec.errors import SpecDecError
from specdec.tree import TokenTree

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
    if n == 0 or not bool(rows.any()):
        return [0.0] * n
    picked = score[rows]
    top = (picked[:, :n] if presorted else torch.topk(picked, n, dim=1).values).exp()  # [B', n] descending
    return top.double().mean(dim=0).cumsum(dim=0).tolist()


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
    measurement on first use.
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
    cost_profile: str | None = None
    """path of a cost profile JSON (see `specdec profile`)"""
    cost_table: CostTable | None = field(default=None, repr=False)
    """an in-memory CostTable (takes precedence; no identity check)"""
    name: str = "cast"
    uses_draft: bool = True
    last_widths: list[int] = field(default_factory=list, init=False, repr=False)
    """n_i of each drafted layer at the last step"""
    last_verified: int = field(default=0, init=False, repr=False)
    """draft tokens per row kept for verification at the last step (before per-row validity)"""
    _buffers: DepthBuffers = field(init=False, repr=False)
    _resolver: CostTableResolver | None = field(default=None, init=False, repr=False)
    _loaded: CostTable | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("top_k", "total_tokens", "buffer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecDecError(f"{name}={value!r} must be a positive integer")
        if self.depth is not None and (isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1):
            raise SpecDecError(f"depth={self.depth!r} must be a positive integer (or None for the batch preset)")
        for name in ("c1", "c2", "c3"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            ):
                raise SpecDecError(f"{name}={value!r} must be a finite number >= 0 (or None for the batch preset)")
        if self.rerank_rule not in ("threshold", "break-even"):
            raise SpecDecError(f"rerank_rule={self.rerank_rule!r} must be 'threshold' (the paper's C3) or 'break-even'")
        for name in ("breadth_pruning", "depth_pruning", "dynamic_rerank"):
            if not isinstance(getattr(self, name), bool):
                raise SpecDecError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.cost_table is not None and not isinstance(self.cost_table, CostTable):
            raise SpecDecError(
                f"cost_table must be a specdec.cost.CostTable, got {type(self.cost_table).__name__}; pass a file path as cost_profile"
            )
        if self.cost_profile is not None and not isinstance(self.cost_profile, str):
            raise SpecDecError(f"cost_profile={self.cost_profile!r} must be a file path")
        if self.cost_table is not None and self.cost_profile is not None:
            raise SpecDecError("give either cost_table or cost_profile, not both")
        self._buffers = DepthBuffers(self.buffer)

    # ----- settings ----------------------------------------------------------------------
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
    def bind_models(self, target: torch.nn.Module, draft: torch.nn.Module | None) -> None:
        """Give the policy its target and draft models, so it can find (or measure) their
        cost profile. Without an injected `cost_table` this is required unless `cost_profile`
        names a file. The batch-1 table is resolved now (a quick measurement when no profile
        fits), so that cost is paid when the decoder is built, not inside a timed generation;
        other batch sizes are resolved on first use."""
        if draft is None or self.cost_table is not None:
            return
        from specdec.cost.profile import CostTableResolver

        self._resolver = CostTableResolver(target, draft, self.cost_profile)
        self._resolver.table_for(1)

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

    # ----- drafting ----------------------------------------------------------------------
    def draft(self, source: DraftSource, roots: torch.Tensor, ctx: DraftContext) -> tuple[TokenTree, TreeBuilder, torch.Tensor]:
        builder = TreeBuilder(source, roots, ctx, keep_draft_probs=False)
        b = roots.shape[0]
        dev = roots.device
        rows = ctx.active.to(dev).bool()  # [B] rows whose utilities count
        depth = min(self.depth_for(b), ctx.max_depth)
        self.last_widths = []
        self.last_verified = 0
        if depth == 0 or not bool(rows.any()):
            tree, origin = builder.finish()
            return tree, builder, origin
        table = self.table_for(b)
        c1, c2, c3 = self.thresholds_for(b)
        lens = ctx.context_len.to(dev)
        n0 = int(lens[rows].max().item()) if lens.numel() == b else 0  # padded context of the batch
        k = min(self.top_k, builder.root_logprobs.shape[-1])

        root = torch.zeros(b, 1, dtype=torch.long, device=dev)
        parents, tokens, logq, valid = builder.top_children(
            root, builder.root_logprobs[:, None, :], k, torch.ones(b, 1, dtype=torch.bool, device=dev)
        )
        candidates = builder.add(parents, tokens, logq, valid)  # [B, k], sorted by confidence (topk order)
        kept_before = 0  # sum_{j<i} n_j
        prev_utility: float | None = None
        t_root = max(table.target_cost(b, n0 + 1, 1), 1e-9)
        drafted = table.draft_costs(b, n0 + 1, 1)[1] / t_root  # the draft time spent, in plain-step units: the root's forward
        for level in range(1, depth + 1):
            # candidates come from topk, so each row is already sorted by confidence (invalid ones last)
            cand_valid = builder.valid.gather(1, candidates)  # [B, m]
            score = builder.cum_logq.gather(1, candidates).masked_fill(~cand_valid, float("-inf"))  # [B, m]
            utility = batch_utility(score, rows, presorted=True)  # u_1..u_m
            ctx_i = n0 + 1 + kept_before  # the draft cache: committed tokens, the root, kept layers
            t_one = max(table.target_cost(b, ctx_i, 1), 1e-9)  # a plain decoding step (ms)
            d_ms = table.draft_costs(b, ctx_i, len(utility))
            cost = [d_ms[j] / t_one for j in range(1, len(utility) + 1)]  # c_1..c_m
            width = len(utility)
            if self.breadth_pruning:
                most = max(1, int(cand_valid[rows].sum(dim=1).max().item()))
                width = breadth_count(utility[:most], cost[:most], c1)
            if prev_utility is not None and prev_utility > 0:
                self._buffers.push(level - 1, utility[width - 1] / prev_utility)
            self.last_widths.append(width)
            if level == depth:
                break
            if self.depth_pruning and not grow_decision(self._buffers.alpha(level), utility[width - 1], cost[width - 1], c2):
                break
            frontier = candidates[:, :width]  # [B, n_i]
            drafted += cost[width - 1]
            frontier_valid = builder.valid.gather(1, frontier)
            logprobs = builder.expand(frontier, frontier_valid)  # [B, n_i, V]
            parents, tokens, logq, valid = builder.top_children(frontier, logprobs, k, frontier_valid)
            children = builder.add(parents, tokens, logq, valid)  # [B, n_i * k]
            child_score = builder.cum_logq.gather(1, children).masked_fill(~builder.valid.gather(1, children), float("-inf"))
            best = torch.topk(child_score, min(k, children.shape[1]), dim=1).indices  # [B, <=k]
            candidates = children.gather(1, best)
            kept_before += width
            prev_utility = utility[width - 1]

        keep = builder.top_by_score(builder.cum_logq, self._verify_count(builder, rows, table, b, n0, c3, drafted))
        tree, origin = builder.finish(keep)
        return tree, builder, origin

    def _verify_count(self, builder: TreeBuilder, rows: torch.Tensor, table: CostTable, batch: int, n0: int, c3: float, drafted: float = 0.0) -> int:
        """Draft tokens per row to verify: dynamic reranking, or `total_tokens` when it is off."""
        if not self.dynamic_rerank:
            self.last_verified = self.total_tokens
            return self.total_tokens
        pool = builder.valid.clone()
        pool[:, 0] = False  # the root is always verified
        available = int(pool[rows].sum(dim=1).max().item())
        n = min(available, self.total_tokens)
        if n == 0:
            self.last_verified = 0
            return 0
        utility = batch_utility(builder.cum_logq.masked_fill(~pool, float("-inf")), rows, n)  # u_1..u_N
        t_ms = table.target_costs(batch, n0, n + 1)  # f_T(n0, tokens) for tokens = 0..N+1
        cost = [t_ms[j + 1] / max(t_ms[1], 1e-9) for j in range(n + 1)]  # c_0..c_N
        if self.rerank_rule == "break-even":
            self.last_verified = break_even_count(utility, cost, drafted)
        else:
            self.last_verified = rerank_count(utility, cost, c3)
        return self.last_verified

    def feedback(self, record: StepRecord) -> None:
        """CAST adapts inside `draft` (the depth buffers); verification results are not used."""
        return None

    def state(self) -> dict[str, Any]:
        """Introspection: the last step's layer widths and verified count, and the buffers."""
        return {
            "widths": list(self.last_widths),
            "verified": self.last_verified,
            "buffers": {i: self._buffers.values(i) for i in sorted(self._buffers._buffers)},
        }
