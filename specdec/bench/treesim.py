"""Tree policies on a synthetic draft: expected accepted tokens and step time, no models.

A what-if harness for the tree-shaping rules (static, EAGLE-2, DynaTree, CAST). A fake draft
source (`SimSource`) gives every tree node a children distribution whose top-1 probability
(its *confidence*) is a deterministic function of the node's path, so every policy sees the
same draft for the same path. A truth model (`Truth`) says how likely the target is to accept
a draft token given its parent was reached; from it `expected_accepted` computes the exact
expected accepted length of a tree (no sampling), and `sample_path` draws a verdict for the
policies' feedback (CAST's calibration, DynaTree's history). Step time comes from a
`CostTable`: the root's draft forward, one draft forward per drafted level over its width,
and one verification over the tree, plus optional host time per draft forward (a GPU's
synchronisations).

Used by tests/test_tree_rules.py (the rules keep at least the fixed trees' expected tokens per
unit time on GPU-like and CPU-like tables) and benchmarks/tree-rules/dump.py (per-step state).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.cost.table import CostTable
from specdec.drafting.builder import DraftContext
from specdec.sampling import SamplingParams
from specdec.sources.base import AcceptedPaths, NodeBatch
from specdec.stats import StepRecord

_MOD = 2_147_483_647  # 2^31 - 1


@dataclass(frozen=True)
class SyntheticDraft:
    """Draft distributions with controllable confidence.

    A node's confidence (top-1 probability) is lo + (hi - lo) * h**shape, h in [0, 1) a hash of
    the node's path and the step (so a path always gets the same distribution within a step,
    whichever policy asks). The remaining mass falls geometrically over the other ranks
    (rank r >= 2 gets (1 - c) * (1 - tail) * tail**(r - 2), the last rank the remainder).
    Token ids are ranks: the r-th most likely child of every node is token r - 1."""

    lo: float = 0.2
    hi: float = 0.98
    shape: float = 0.6
    tail: float = 0.5
    vocab: int = 64

    def confidence(self, h: torch.Tensor) -> torch.Tensor:
        return self.lo + (self.hi - self.lo) * h.pow(self.shape)

    def logprobs(self, conf: torch.Tensor) -> torch.Tensor:
        """[..., V] log-distributions with top-1 probability `conf` [...]."""
        ranks = torch.arange(1, self.vocab, dtype=torch.float64)
        rest = (1 - self.tail) * self.tail ** (ranks - 1)
        rest[-1] += self.tail ** (self.vocab - 1)  # the last rank takes the remainder: sums to 1
        c = conf.double()[..., None]
        probs = torch.cat([c, (1 - c) * rest], dim=-1)
        return probs.clamp(min=1e-30).log().float()


@dataclass(frozen=True)
class Truth:
    """P(a draft token is the target's choice | its parent was reached), from its draft
    probability q, its rank among its siblings and its parent's confidence q1.

    power = 1: the draft is calibrated (P = q). power < 1: an underconfident draft, as a small
    draft under greedy verification is (docs/cast.md: a draft favourite with q < 0.5 is the
    target's argmax 70-87% of the time): the favourite is accepted with q1**power and the other
    ranks share the rest in proportion to q."""

    power: float = 1.0

    def rate(self, q: torch.Tensor, rank: torch.Tensor, q1: torch.Tensor) -> torch.Tensor:
        if self.power == 1.0:
            return q
        top = q1.clamp(min=1e-12).pow(self.power)
        other = q * (1 - top) / (1 - q1).clamp(min=1e-12)
        return torch.where(rank <= 1, top, other)


class SimSource:
    """A DraftSource over a `SyntheticDraft` (see the module docstring); records the width of
    every draft forward."""

    def __init__(self, draft: SyntheticDraft, seed: int = 0) -> None:
        self.draft = draft
        self.seed = seed
        self.step = 0
        self.widths: list[int] = []
        """width (nodes per row, padded) of each draft forward of the current step, the root's first"""
        self._pw = torch.tensor([pow(1_000_003, d + 1, _MOD) for d in range(256)], dtype=torch.long)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[int] | None = None, prompts: Any = None) -> None:
        return None

    def keep_rows(self, rows: list[int], room: int | None = None) -> None:
        return None

    def _base(self, b: int) -> torch.Tensor:
        return torch.tensor([(self.seed * 7919 + self.step * 104_729 + r * 15_485_863) % _MOD for r in range(b)], dtype=torch.long)

    def _conf(self, h: torch.Tensor) -> torch.Tensor:
        mixed = (h * 48_271) % _MOD  # a Lehmer step spreads nearby hashes
        return self.draft.confidence(mixed.double() / _MOD)

    def begin_step(self, roots: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        self.widths = [1]
        return self.draft.logprobs(self._conf(self._base(roots.shape[0])))

    def defer(self, roots: torch.Tensor) -> bool:
        """A plain step (CAST's plain-steps check): no draft forward, so nothing to charge.
        A real source forwards the deferred roots with the next drafted step's root; that
        catch-up is not simulated (its forward's width is the root's anyway)."""
        self.widths = []
        return True

    def path_hash(self, tokens: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
        """[B, N] a hash of each node's path (its ancestors' tokens and depths) and the step."""
        w = ((tokens + 1) * self._pw[depths.clamp(max=255)]) % _MOD  # [B, N]
        h = (ancestors.long() * w[:, None, :]).sum(-1) % _MOD
        return (h + self._base(tokens.shape[0])[:, None]) % _MOD

    def expand(self, batch: NodeBatch, params: SamplingParams) -> torch.Tensor:
        self.widths.append(batch.nodes.shape[1])
        h = self.path_hash(batch.tokens, batch.depths, batch.ancestors).gather(1, batch.nodes)  # [B, k]
        return self.draft.logprobs(self._conf(h))

    def end_step(self, accepted: AcceptedPaths) -> None:
        return None

    def feedback(self, record: StepRecord) -> None:
        return None


@dataclass
class StepState:
    """One simulated step of one policy (batch-averaged where per row)."""

    nodes: float
    """draft tokens per row in the verified tree"""
    depth: float
    """deepest verified node per row"""
    levels: int
    """draft forwards after the root's"""
    widths: list[int]
    expected: float
    """expected accepted tokens per row (exact, under the truth model)"""
    draft_ms: float
    verify_ms: float
    accepted: list[int] = field(default_factory=list)
    """the sampled verdict's accepted length per row"""

    @property
    def step_ms(self) -> float:
        return self.draft_ms + self.verify_ms

    @property
    def rate(self) -> float:
        """expected tokens per row per ms (accepted + the bonus token)"""
        return (1.0 + self.expected) / self.step_ms


def _sibling_top(tree_logq: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per node: its rank among its tree siblings by logq (1 = best) and the best sibling's q."""
    b, n = parents.shape
    rank = torch.ones(b, n, dtype=torch.long)
    q1 = torch.zeros(b, n)
    for r in range(b):
        par = parents[r].tolist()
        lq = tree_logq[r].tolist()
        ok = valid[r].tolist()
        groups: dict[int, list[int]] = {}
        for i in range(1, n):
            if ok[i]:
                groups.setdefault(par[i], []).append(i)
        for kids in groups.values():
            kids.sort(key=lambda i: -lq[i])
            best = math.exp(lq[kids[0]])
            for pos, i in enumerate(kids, start=1):
                rank[r, i] = pos
                q1[r, i] = best
    return rank, q1


def node_rates(tree: Any, truth: Truth) -> torch.Tensor:
    """[B, N] P(node accepted | parent reached) for every node of a TokenTree (0 at padding and the root)."""
    rank, q1 = _sibling_top(tree.logq, tree.parents, tree.valid)
    rate = truth.rate(tree.logq.exp(), rank, q1)
    rate = rate.masked_fill(~tree.valid, 0.0)
    rate[:, 0] = 0.0
    return rate


def expected_accepted(tree: Any, truth: Truth) -> torch.Tensor:
    """[B] the exact expected accepted length of each row's tree under `truth`
    (sum over nodes of the probability that its whole path is accepted)."""
    rate = node_rates(tree, truth)
    b, n = rate.shape
    reach = torch.zeros(b, n, dtype=torch.float64)
    reach[:, 0] = 1.0
    parents = tree.parents
    for i in range(1, n):
        par = parents[:, i].clamp(min=0)
        reach[:, i] = reach.gather(1, par[:, None])[:, 0] * rate[:, i].double()
    reach[:, 0] = 0.0
    return reach.sum(dim=1).float()


def sample_path(tree: Any, truth: Truth, generator: torch.Generator) -> list[list[int]]:
    """Per row, the accepted path's node indices (root excluded), drawn under `truth`."""
    rate = node_rates(tree, truth)
    out: list[list[int]] = []
    for r in range(tree.tokens.shape[0]):
        par = tree.parents[r].tolist()
        ok = tree.valid[r].tolist()
        kids: dict[int, list[int]] = {}
        for i in range(1, len(par)):
            if ok[i]:
                kids.setdefault(par[i], []).append(i)
        node, path = 0, []
        while node in kids:
            u = float(torch.rand((), generator=generator))
            acc = 0.0
            nxt = -1
            for child in kids[node]:
                acc += float(rate[r, child])
                if u < acc:
                    nxt = child
                    break
            if nxt < 0:
                break
            path.append(nxt)
            node = nxt
        out.append(path)
    return out


def gpu_like_table(target_ms: float = 22.0, draft_ms: float = 1.2, flat_tokens: int = 64, slope: float = 0.25) -> CostTable:
    """A GPU-like cost table: a forward costs the same for any number of new tokens (B * n) up to
    `flat_tokens`, then grows by `slope` of a one-token forward per further `flat_tokens` tokens."""

    def curve(base: float) -> Callable[[int, int, int], float]:
        return lambda b, c, n: base * (1.0 + slope * max(0, b * n - flat_tokens) / flat_tokens) + c / 10_000

    return CostTable.synthetic(curve(target_ms), curve(draft_ms))


def cpu_like_table(target_ms: float = 6.0, target_per_token: float = 0.25, draft_ms: float = 0.8, draft_per_token: float = 0.04) -> CostTable:
    """A CPU-like cost table: every extra token costs (the bundled pair's shape: a 64-token
    target forward is ~3.5x a one-token one)."""
    return CostTable.synthetic(
        lambda b, c, n: target_ms + target_per_token * b * (n - 1) + c / 1000, lambda b, c, n: draft_ms + draft_per_token * b * (n - 1)
    )


@dataclass
class Simulation:
    """Runs a policy for `steps` steps on a `SimSource`, feeding back sampled verdicts."""

    draft: SyntheticDraft = field(default_factory=SyntheticDraft)
    truth: Truth = field(default_factory=Truth)
    table: CostTable = field(default_factory=gpu_like_table)
    batch: int = 1
    context: int = 300
    host_ms_per_forward: float = 0.0
    """host time charged per draft forward beyond the table (a GPU's sync per level)"""
    seed: int = 0

    def run(self, policy: Any, steps: int, feedback: bool = True) -> list[StepState]:
        source = SimSource(self.draft, self.seed)
        gen = torch.Generator().manual_seed(self.seed)
        b = self.batch
        out: list[StepState] = []
        for step in range(steps):
            source.step = step
            ctx = DraftContext(
                params=SamplingParams(),
                generator=None,
                max_depth=64,
                active=torch.ones(b, dtype=torch.bool),
                context_len=torch.full((b,), self.context, dtype=torch.long),
                host_active=[True] * b,
                host_context_len=[self.context] * b,
            )
            roots = torch.zeros(b, dtype=torch.long)
            tree = policy.draft(source, roots, ctx).tree
            widths = list(source.widths)
            draft_ms = sum(self.table.draft_cost(b, self.context + 1, w) + self.host_ms_per_forward for w in widths)
            verify_ms = self.table.target_cost(b, self.context, tree.num_nodes)
            exp = expected_accepted(tree, self.truth)
            valid = tree.valid.clone()
            valid[:, 0] = False
            depth = (tree.depths * valid).max(dim=1).values.float()
            state = StepState(
                nodes=float(valid.sum(dim=1).float().mean()),
                depth=float(depth.mean()),
                levels=max(len(widths) - 1, 0),  # a plain step (`defer`) drafts nothing
                widths=widths,
                expected=float(exp.mean()),
                draft_ms=draft_ms,
                verify_ms=verify_ms,
            )
            if feedback:
                paths = sample_path(tree, self.truth, gen)
                state.accepted = [len(p) for p in paths]
                drafted = valid.sum(dim=1).tolist()
                by_depth = [[int(((tree.depths[r] == d) & valid[r]).sum()) for d in range(1, int(depth.max()) + 1)] for r in range(b)]
                policy.feedback(
                    StepRecord(
                        step=step,
                        active=[True] * b,
                        drafted=drafted,
                        accepted_len=state.accepted,
                        committed=[a + 1 for a in state.accepted],
                        relaxed=[0] * b,
                        strict_fallbacks=[0] * b,
                        tree_depth=int(depth.max()),
                        draft_s=draft_ms / 1e3,
                        verify_s=verify_ms / 1e3,
                        drafted_by_depth=by_depth,
                        accepted_depth=state.accepted,
                        accepted_nodes=paths,
                        step_s=(draft_ms + verify_ms) / 1e3,
                    )
                )
            out.append(state)
        return out


def summary(states: list[StepState]) -> dict[str, float]:
    """Means over steps: nodes, depth, levels, expected accepted, step ms, and the rate
    (expected tokens per ms: the ratio of the means, as a long run is)."""
    n = max(len(states), 1)
    expected = sum(s.expected for s in states) / n
    step_ms = sum(s.step_ms for s in states) / n
    return {
        "nodes": sum(s.nodes for s in states) / n,
        "depth": sum(s.depth for s in states) / n,
        "levels": sum(s.levels for s in states) / n,
        "expected": expected,
        "draft_ms": sum(s.draft_ms for s in states) / n,
        "verify_ms": sum(s.verify_ms for s in states) / n,
        "step_ms": step_ms,
        "rate": (1.0 + expected) / step_ms if step_ms > 0 else 0.0,
    }
