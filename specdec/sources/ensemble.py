"""TABED: test-time adaptive batched ensemble drafting (Lee et al., 2025).

One draft model sees each prompt through m views (e.g. M: image + text, T: text only,
C: caption, P: pooled image). The views are m rows of the same draft forward (weights
shared, each row with its own prefix and KV cache), so an ensemble of m drafts costs one
batched draft step. At every tree node the ensemble distribution is the mixture

    q = sum_j w_j q^(j)        (after temperature/top-k/top-p, per view)

and q is what the tree policy drafts from and what the accept rule sees, so lossless
verification stays lossless whatever the weights.

Weights adapt at test time, per row, at the start of every draft block: candidates W_t
come from the weight policy; each is scored by the distance between the target's
distributions p (from past verifications) and the candidate's mixture over the last `h`
observed positions; the best one drafts the whole block. Observed positions are the
committed tokens whose parent the draft expanded (the root of every step and each
accepted node the draft expanded). Instead of keeping past distributions, each new
observation's distance to every candidate (and to every single view) is computed once,
on the support of the K most likely tokens of p + mean_j q^(j), and cached; a window is
then a sum over cached rows. Memory per row: `max_history` x (candidates + m) floats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from specdec.errors import SpecDecError
from specdec.models.vocab import VocabFit, fit_draft_inputs
from specdec.multimodal.views import PromptView, left_pad, merge_inputs
from specdec.sampling import SamplingParams
from specdec.sources.base import AcceptedPaths, NodeBatch
from specdec.sources.model import ModelDraftSource

if TYPE_CHECKING:
    from specdec.stats import StepRecord

WEIGHT_POLICIES = ("grid", "softmax", "static", "random", "fixed")
DISTANCES = ("kl", "tv", "hard")
_EPS = 1e-10


@dataclass
class EnsembleConfig:
    """How TABED picks the ensemble weights."""

    policy: str = "grid"
    """grid: best of all weights with w_j = a_j/n (sum a_j = n; for 2 views [1 - j/n, j/n]);
    softmax: w = softmax((1/e_1, ..., 1/e_m) / temperature) from each view's own error e_j;
    static: equal weights; random: Dirichlet(1) weights each block; fixed: one view only"""
    distance: str = "kl"
    """kl: KL(p || q); tv: total variation; hard: mismatches of a token sampled from q against
    argmax p (the paper's hard labels; one uniform per observation shared by all candidates)"""
    window: int | None = None
    """h: observed positions scored (None: all kept, up to max_history)"""
    grid_n: int = 10
    temperature: float = 1.0
    fixed_view: int = 0
    """the view `fixed` uses (index into the views)"""
    support: int = 64
    """K: tokens on which each observation's distances are computed"""
    max_history: int = 2048
    """observations kept per row (the oldest are dropped)"""
    seed: int = 0
    """seed of the `random` policy"""
    prior: bool = True
    """choose a row's first-block weights from evidence of earlier rows and prompts (an
    exponential average of past observations' distances, shared through `EnsemblePrior`)
    instead of equal weights; False is the paper's per-sample behaviour"""
    prior_decay: float = 0.98
    """weight of the running average per new observation"""

    def validate(self, m: int) -> None:
        if self.policy not in WEIGHT_POLICIES:
            raise SpecDecError(f"ensemble weight policy {self.policy!r} is not known; use one of {', '.join(WEIGHT_POLICIES)}")
        if self.distance not in DISTANCES:
            raise SpecDecError(f"ensemble distance {self.distance!r} is not known; use one of {', '.join(DISTANCES)}")
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1):
            raise SpecDecError(f"ensemble window h={self.window!r} must be a positive integer (or all)")
        if isinstance(self.grid_n, bool) or not isinstance(self.grid_n, int) or self.grid_n < 1:
            raise SpecDecError(f"grid_n={self.grid_n!r} must be a positive integer")
        def number(value: object) -> bool:
            return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

        def integer(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not number(self.temperature) or not self.temperature > 0:
            raise SpecDecError(f"ensemble temperature={self.temperature!r} must be a number > 0")
        if not integer(self.fixed_view) or not 0 <= self.fixed_view < m:
            raise SpecDecError(f"fixed_view={self.fixed_view!r} must be an integer indexing one of the {m} views")
        if not number(self.prior_decay) or not 0 < self.prior_decay < 1:
            raise SpecDecError(f"prior_decay={self.prior_decay!r} must be a number in (0, 1)")
        if not integer(self.support) or not integer(self.max_history) or self.support < 2 or self.max_history < 1:
            raise SpecDecError(f"support={self.support!r} must be an integer >= 2 and max_history={self.max_history!r} an integer >= 1")


MAX_GRID = 200_000
"""the most weight candidates the grid policy scores per observation"""


def grid_weights(m: int, n: int) -> torch.Tensor:
    """All weights w = a / n with non-negative integers a summing to n: [C, m], the most
    even first (ties in the selection then go to the most even candidate)."""
    count = math.comb(n + m - 1, m - 1)
    if count > MAX_GRID:
        raise SpecDecError(
            f"the grid policy with {m} views and grid_n={n} has {count} weight candidates (at most {MAX_GRID}); "
            "use fewer views, a smaller grid_n, or another policy (softmax)"
        )

    def compositions(parts: int, total: int) -> list[tuple[int, ...]]:  # non-negative `parts`-tuples summing to `total`
        if parts == 1:
            return [(total,)]
        return [(first, *rest) for first in range(total + 1) for rest in compositions(parts - 1, total - first)]

    weights = torch.tensor(compositions(m, n), dtype=torch.float32) / n
    spread = (weights - 1.0 / m).abs().sum(dim=1)
    return weights[torch.argsort(spread, stable=True)]


def mixture_logprobs(view_logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """log sum_j w_j q_j. view_logprobs: [B, m, ..., V]; weights: [B, m]. Returns [B, ..., V]."""
    shape = weights.shape + (1,) * (view_logprobs.dim() - 2)
    log_w = weights.clamp_min(0).log().reshape(shape)  # w_j = 0 -> -inf: that view drops out
    return torch.logsumexp(view_logprobs + log_w, dim=1)


def distances(p: torch.Tensor, q: torch.Tensor, label: torch.Tensor, kind: str, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """Distance of each candidate mixture to p at each observation.

    p: [P, K] target probabilities on the support; q: [C, P, K] candidate mixtures on the
    same support; label: [P] index of argmax p in the support. Returns [C, P].
    hard: 1 where the token drawn from q by inverse CDF at `uniform` ([P] in [0, 1), the same
    for every candidate so that they are compared on one draw) is not the label; a draw past
    the support (its tail mass) is a mismatch. Without `uniform`, q's argmax is the draw.
    """
    if kind == "kl":  # sum_k p log(p / q); tokens outside the support are left out
        terms = p * (p.clamp_min(_EPS).log() - q.clamp_min(_EPS).log())
        return terms.masked_fill(p <= 0, 0.0).sum(-1)
    if kind == "tv":  # the mass outside the support counts as one lump
        tail = ((1 - p.sum(-1)) - (1 - q.sum(-1))).abs()
        return 0.5 * ((p - q).abs().sum(-1) + tail)
    if uniform is None:
        return (q.argmax(-1) != label).float()
    drawn = (q.cumsum(-1) <= uniform.to(q.dtype)[None, :, None]).sum(-1)  # [C, P]; K: past the support
    return (drawn != label).float()


class EnsemblePrior:
    """Evidence that outlives a row: exponential averages of the observations' distances to
    each candidate (grid) and to each single view (softmax). Share one between the sources
    of successive runs (SpeculativeDecoder does) so that a new prompt's first block starts
    from what earlier prompts showed, not from equal weights."""

    def __init__(self) -> None:
        self.cand_err: torch.Tensor | None = None  # [C]
        self.view_err: torch.Tensor | None = None  # [m]
        self.observations = 0

    def update(self, cand_err: torch.Tensor | None, view_err: torch.Tensor | None, decay: float) -> None:
        def ema(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
            if new is None:
                return old
            new = new.detach().cpu()
            return new.clone() if old is None or old.shape != new.shape else decay * old + (1 - decay) * new

        self.cand_err = ema(self.cand_err, cand_err)
        self.view_err = ema(self.view_err, view_err)
        self.observations += 1


def _repeat_rows(t: torch.Tensor, m: int) -> torch.Tensor:
    """Each row repeated m times in place (row r -> rows r*m .. r*m + m - 1)."""
    return t.repeat_interleave(m, dim=0)


class EnsembleDraftSource:
    """m drafting views of one draft model, batched, mixed with test-time adaptive weights."""

    always_proposes = True
    """a mixture of a model's distributions always has mass (`DraftSource.always_proposes`)"""

    def __init__(
        self, model: PreTrainedModel, views: Sequence[PromptView], config: EnsembleConfig | None = None, prior: EnsemblePrior | None = None,
        vocab: VocabFit | None = None,
        static_shapes: bool = False,
        cuda_graphs: bool = False,
    ) -> None:
        if len(views) < 1:
            raise SpecDecError("the ensemble needs at least one view")
        self.views = list(views)
        self.m = len(self.views)
        self.config = config or EnsembleConfig()
        self.config.validate(self.m)
        self.inner = ModelDraftSource(model, vocab=vocab, static_shapes=static_shapes, cuda_graphs=cuda_graphs)  # vocab: the draft's logits at the target's width
        self.device = self.inner.runner.device
        self.prior = prior if prior is not None else EnsemblePrior()
        # [C, m] weight candidates (the grid policy only)
        self.candidates = grid_weights(self.m, self.config.grid_n).to(self.device) if self.config.policy == "grid" else torch.zeros(0, self.m)
        self.generator = torch.Generator(device="cpu").manual_seed(self.config.seed)
        self._hard_draws = torch.Generator(device="cpu").manual_seed(self.config.seed + 1)
        """the `hard` distance's draws from the candidate mixtures (apart from `generator`, so
        the random policy's weights do not depend on the distance)"""
        self.weights = torch.zeros(0, self.m, device=self.device)  # [B, m] of the current block
        self._cand_err: list[list[torch.Tensor]] = []  # per row: observations' [C] distances
        self._view_err: list[list[torch.Tensor]] = []  # per row: observations' [m] distances
        self.traces: list[list[list[float]]] = []
        """per row: the weights chosen at each step (for plots of the adaptation)"""
        self._root_q = torch.zeros(0)
        self._expanded: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._deferring = False  # this step drafted nothing (`defer`)

    @property
    def view_names(self) -> list[str]:
        return [v.name for v in self.views]

    # ----- batch management --------------------------------------------------------
    def _rows(self, rows: Sequence[int]) -> list[int]:
        return [r * self.m + j for r in rows for j in range(self.m)]

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[int] | None = None, prompts: Sequence[Sequence[int]] | None = None) -> None:
        if prompts is None:  # token ids only: every view sees them as they are
            prompts = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)]
        view_prompts = [(view, prompt) for prompt in prompts for view in self.views]  # row i*m + j: prompt i, view j
        encoded = [view.encode(prompt) for view, prompt in view_prompts]
        ids, mask = left_pad([enc_ids for enc_ids, _ in encoded], self.device)
        ids = fit_draft_inputs(ids, self.inner.vocab)  # ids beyond a narrower draft's rows
        extra = merge_inputs([enc_extra for _, enc_extra in encoded], self.device, self.inner.runner.model)
        if rows is None:
            self.inner.prefill_rows(ids, mask, None, extra)
            b = len(prompts)
            self._cand_err = [[] for _ in range(b)]
            self._view_err = [[] for _ in range(b)]
            self.traces = [[] for _ in range(b)]
            self.weights = torch.full((b, self.m), 1.0 / self.m, device=self.device)
            return
        self.inner.prefill_rows(ids, mask, self._rows(rows), extra)
        for r in rows:
            self._cand_err[r], self._view_err[r], self.traces[r] = [], [], []

    def keep_rows(self, rows: list[int], room: int | None = None) -> None:
        self.inner.keep_rows(self._rows(rows), room=None if room is None else room * self.m)  # (the inner source runs m views a row)
        self._cand_err = [self._cand_err[r] for r in rows]
        self._view_err = [self._view_err[r] for r in rows]
        self.traces = [self.traces[r] for r in rows]
        self.weights = self.weights[torch.tensor(rows, dtype=torch.long, device=self.device)]

    # ----- drafting ----------------------------------------------------------------
    def begin_step(self, roots: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        self._deferring = False
        self.weights = torch.stack([self._choose(r) for r in range(roots.shape[0])])  # [B, m]
        for r in range(roots.shape[0]):
            self.traces[r].append(self.weights[r].tolist())
        view_logprobs = self.inner.begin_step(roots.repeat_interleave(self.m), params)  # [B*m, V]
        self._root_q = view_logprobs.reshape(roots.shape[0], self.m, -1)  # [B, m, V]
        self._expanded = []
        return mixture_logprobs(self._root_q, self.weights)

    def expand(self, batch: NodeBatch, params: SamplingParams) -> torch.Tensor:
        nodes, valid = batch.nodes, batch.valid
        b, k = nodes.shape
        m = self.m
        repeated = NodeBatch(*(_repeat_rows(t, m) for t in (batch.nodes, batch.valid, batch.tokens, batch.depths, batch.ancestors)), depth=batch.depth, chain=batch.chain)
        view_logprobs = self.inner.expand(repeated, params)
        view_logprobs = view_logprobs.reshape(b, self.m, k, -1)  # [B, m, k, V]
        self._expanded.append((nodes, valid, view_logprobs))
        return mixture_logprobs(view_logprobs, self.weights)

    def defer(self, roots: torch.Tensor) -> bool:
        """A step that drafts nothing: the views' draft owes the root (`ModelDraftSource.defer`);
        its verdict teaches the weights nothing."""
        self._deferring = self.inner.defer(roots.repeat_interleave(self.m))
        return self._deferring

    def end_step(self, accepted: AcceptedPaths) -> None:
        self.inner.end_step(accepted.repeat_rows(self.m))
        if self._deferring:  # no view drafted: nothing to compare with the target's distributions
            self._deferring = False
            return
        p_logs = accepted.target.logprobs()  # [B, 1 + D, V]
        for row, tokens in enumerate(accepted.host_tokens):
            if not accepted.host_active[row]:
                continue
            # the distributions that decided each committed token: the root's, then each accepted node's
            for i in range(1 + len(tokens)):
                q_log = self._root_q[row] if i == 0 else self._node_q(row, accepted.nodes[row, i - 1])
                if q_log is not None:
                    self._observe(row, p_logs[row, i], q_log)

    def _node_q(self, row: int, node: torch.Tensor) -> torch.Tensor | None:
        """The views' [m, V] children distributions of builder node `node` (a 0-d int64 tensor,
        compared on the device), if it was expanded."""
        for nodes, valid, view_logprobs in self._expanded:
            hit = ((nodes[row] == node) & valid[row]).nonzero()
            if hit.numel():
                return view_logprobs[row, :, int(hit[0, 0])]
        return None

    # ----- adaptation --------------------------------------------------------------
    @torch.inference_mode()
    def _observe(self, row: int, p_log: torch.Tensor, q_log: torch.Tensor) -> None:
        """Cache one position's distance to every candidate mixture and every single view.
        p_log: [V] target log-probs; q_log: [m, V] per-view draft log-probs."""
        cfg = self.config
        p = p_log.exp()
        q = q_log.exp()  # [m, V]
        k = min(cfg.support, p.shape[0])
        support = torch.topk(p + q.mean(0), k).indices  # [K]
        top = p.argmax()
        if not bool((support == top).any()):
            support[-1] = top
        p_s, q_s = p[support], q[:, support]  # [K], [m, K]
        label = (support == top).nonzero()[0]  # [1]
        cand_err = view_err = None
        uniform = torch.rand(1, generator=self._hard_draws).to(p_s.device) if cfg.distance == "hard" else None
        if cfg.policy == "grid":
            mixed = self.candidates @ q_s  # [C, K]
            cand_err = distances(p_s[None], mixed[:, None], label, cfg.distance, uniform)[:, 0]
            self._cand_err[row].append(cand_err)
        if cfg.policy == "softmax":
            view_err = distances(p_s[None], q_s[:, None], label, cfg.distance, uniform)[:, 0]
            self._view_err[row].append(view_err)
        if cfg.prior:
            self.prior.update(cand_err, view_err, cfg.prior_decay)
        for errs in (self._cand_err[row], self._view_err[row]):
            if len(errs) > cfg.max_history:
                del errs[0]

    def _choose(self, row: int) -> torch.Tensor:
        cfg, m = self.config, self.m
        uniform = torch.full((m,), 1.0 / m, device=self.device)
        if cfg.policy == "static":
            return uniform
        if cfg.policy == "fixed":
            return torch.nn.functional.one_hot(torch.tensor(cfg.fixed_view), m).float().to(self.device)
        if cfg.policy == "random":
            draws = -torch.rand(m, generator=self.generator).clamp_min(_EPS).log()  # Dirichlet(1)
            return (draws / draws.sum()).to(self.device)
        h = cfg.window or cfg.max_history
        if cfg.policy == "grid":
            history = self._cand_err[row][-h:]
            if not history:
                prior = self.prior.cand_err if cfg.prior else None
                if prior is None or prior.shape[0] != self.candidates.shape[0]:
                    return self.candidates[0]  # the most even candidate
                history = [prior.to(self.device)]
            err = torch.stack(history).sum(0)  # [C]
            best = err.min()
            near = (err <= best + 1e-5 * (1 + best.abs())).nonzero()  # ties up to float noise: the most even wins
            return self.candidates[int(near[0, 0])]
        history = self._view_err[row][-h:]  # softmax of inverse errors
        if not history:
            prior = self.prior.view_err if cfg.prior else None
            if prior is None or prior.shape[0] != m:
                return uniform
            history = [prior.to(self.device)]
        err = torch.stack(history).mean(0).clamp_min(1e-6)
        return torch.softmax((1.0 / err) / cfg.temperature, dim=0)

    def feedback(self, record: StepRecord) -> None:
        return None

    @property
    def forward_s(self) -> float:
        return self.inner.forward_s

    @property
    def runner(self):
        return self.inner.runner

    def describe(self) -> dict[str, Any]:
        cfg = self.config
        return {"views": self.view_names, "policy": cfg.policy, "distance": cfg.distance, "window": cfg.window or "all", "grid_n": cfg.grid_n, "prior": cfg.prior}


def estimated_speedup(tau: float, gamma: float, cost_ratio: float) -> float:
    """TABED's Eq. (1): tau / (gamma * T_q / T_p + 1), the walltime speedup over AR of
    drafting gamma tokens at relative cost T_q/T_p and accepting tau tokens per step."""
    if gamma < 0 or cost_ratio < 0 or not math.isfinite(tau):
        raise SpecDecError(f"estimated_speedup needs gamma >= 0 and T_q/T_p >= 0 (got {gamma}, {cost_ratio})")
    return tau / (gamma * cost_ratio + 1.0)
