"""The adaptive tree rules against the fixed trees, on a synthetic draft with controllable
confidences and synthetic cost tables (specdec.bench.treesim; no models).

A GPU-like table (a forward costs the same for up to 64 new tokens, then rises) and a CPU-like
one (every token costs): CAST's expected tokens per unit time must be at least EAGLE-2's and
DynaTree's for the same draft, and where extra nodes cost nothing CAST must keep at least
EAGLE-2's expected accepted tokens. DynaTree's history rule must not shrink its trees on a draft
that is exactly as good as its probabilities say."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specdec.bench.treesim import Simulation, SyntheticDraft, Truth, cpu_like_table, gpu_like_table, summary
from specdec.cost.profile import SHIPPED_PROFILE
from specdec.cost.table import CostTable
from specdec.drafting.cast import StepPlan
from specdec.drafting.dynatree import MIN_MEASURED_FREE, cost_knee
from specdec.hostwork import HostWorkCounter
from specdec.methods import make_policy

STEPS, WARMUP = 40, 10
"""simulated steps per policy, and the first ones left out (calibration and history warm up)"""

DRAFTS = {
    "calibrated": (SyntheticDraft(), Truth(1.0)),
    "underconfident": (SyntheticDraft(lo=0.05, hi=0.9, shape=1.5), Truth(0.5)),
}
"""a draft whose probabilities are its acceptance rates, and one whose favourite is accepted far
more often than its probability says (a small draft under greedy verification)"""


SEEDS = (0, 1, 2)
"""simulations whose rates `mean_rate` averages: one 40-step simulation's verdicts are few
enough that a learned table's noise moves a rate by up to 10% (CAST, calibrated draft, B = 1:
0.145-0.172 over 8 seeds)"""


def run(method: str, sim: Simulation, **options: object) -> dict[str, float]:
    if method == "cast":
        options = {"cost_table": sim.table, "deterministic": True, **options}
    return summary(sim.run(make_policy(method, **options), STEPS)[WARMUP:])


def mean_rate(method: str, draft: str, device: str, batch: int, **options: object) -> float:
    """`method`'s expected accepted tokens per ms averaged over the simulations of `SEEDS`."""
    table = gpu_like_table() if device == "gpu" else cpu_like_table()
    rates = [run(method, Simulation(*DRAFTS[draft], table, batch=batch, seed=seed), **options)["rate"] for seed in SEEDS]
    return sum(rates) / len(rates)


@pytest.mark.parametrize("draft", sorted(DRAFTS))
@pytest.mark.parametrize(("device", "batch"), [("gpu", 1), ("gpu", 4), ("cpu", 1), ("cpu", 4)])
def test_cast_rate_is_at_least_eagle2_and_dynatree(device, batch, draft):
    """CAST against EAGLE-2 and DynaTree with the paper's rules (DynaTree's default off CUDA; the
    simulator runs on the CPU). DynaTree inside its free width, CUDA's default, is the next test."""
    cast, eagle2, dynatree = (mean_rate(m, draft, device, batch) for m in ("cast", "eagle2", "dynatree"))
    assert cast >= eagle2, (cast, eagle2)
    assert cast >= dynatree, (cast, dynatree)


@pytest.mark.parametrize("draft", sorted(DRAFTS))
@pytest.mark.parametrize("batch", [8, 16])
def test_cast_leads_eagle2_by_5_percent_at_large_batches_on_a_gpu_like_table(batch, draft):
    """Issue 18: CAST >= 1.05x EAGLE-2 at B >= 8. On the GPU-like table a batch of 8 rows of
    EAGLE-2's 33 tokens is past the flat region (4x the tokens of 64), so its fixed 32-token trees
    cost several forwards, and CAST shrinks its trees to what still pays (about 8 nodes at B = 8,
    4 at B = 16); it must also stay ahead of DynaTree and of batched AR (one token per row per
    one-token forward)."""
    cast, eagle2, dynatree = (mean_rate(m, draft, "gpu", batch) for m in ("cast", "eagle2", "dynatree"))
    assert cast >= 1.05 * eagle2, (cast, eagle2)
    assert cast >= dynatree, (cast, dynatree)
    table = gpu_like_table()
    assert cast >= 1.0 / table.target_cost(batch, 300, 1), cast  # AR: a one-token forward per token (the simulation's context, 300)


@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_cast_rate_is_at_least_dynatree_free_width_at_batch_1(draft):
    """Issue 18 asks CAST >= DynaTree; DynaTree inside its free width (CUDA's default) is the
    strong one on the GPU-like table. With the calibrated draft CAST lost to it (0.158 against
    0.163, one simulation) while CAST *without* calibration was ahead: the calibration table's
    resolution (10 linear q bins, ranks 3-12 pooled, a sparse bin's prior at the rank's pooled rate)
    valued children of very different q alike. Log-spaced low-q bins, one row per proposed rank and
    a prior that keeps each bin's q (the rank's power law) fixed it."""
    assert mean_rate("cast", draft, "gpu", 1) >= mean_rate("dynatree", draft, "gpu", 1, free_tokens=64)


@pytest.mark.xfail(strict=True, reason="known gap (issue 18): CAST 0.5% below EAGLE-2 here (0.1542 against 0.1550)")
def test_cast_rate_is_at_least_eagle2_at_batch_2_with_a_calibrated_draft():
    """Issue 18 asks CAST >= EAGLE-2 at B = 2 too: on the GPU-like table with the calibrated draft
    CAST is 0.5% below over these 40-step simulations (it was 6% below before the calibration
    table's change, 1% before its bins were pooled with their law; over 120 steps and 4 seeds
    0.1557 against 0.1554, ahead); CAST without calibration ties EAGLE-2 there.
    With the underconfident draft CAST is ahead. Strict: when CAST catches up this passes and fails
    the suite, so the mark gets removed."""
    assert mean_rate("cast", "calibrated", "gpu", 2) >= mean_rate("eagle2", "calibrated", "gpu", 2)


@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_cast_keeps_eagle2_expected_tokens_when_nodes_are_free(draft):
    """Verification flat up to 64 tokens and a draft forward at 1/400 of a target one: width and
    depth are nearly free, so the cost-aware tree must accept at least what EAGLE-2's does."""
    sim = Simulation(*DRAFTS[draft], gpu_like_table(draft_ms=0.05), batch=1)
    cast, eagle2 = run("cast", sim), run("eagle2", sim)
    assert cast["expected"] >= eagle2["expected"], (cast, eagle2)
    assert cast["nodes"] > eagle2["nodes"]  # it uses the free verification slots


def test_a_strong_layer_replaces_weak_nodes_in_a_full_plan():
    """Verification is free up to 4 draft tokens, then each costs a plain step. The pool's 4 weak
    nodes fill every free slot; a next layer whose best node is worth 0.5 pays by replacing one of
    them, though verifying it on top of the 4 would not."""
    verify = [10.0, 10.0, 10.0, 10.0, 10.0, 20.0, 30.0]
    plan = StepPlan(utility=0.4, verified=4, drafted=2.0, verify_cost=verify, values=(0.1, 0.1, 0.1, 0.1))
    assert plan.rate == pytest.approx(1.4 / 12.0)
    assert plan.gains([0.5], 0.5)  # (1 + 0.5 + 0.3) / (2 + 0.5 + 10) > 1.4 / 12
    additive = StepPlan(utility=0.4, verified=4, drafted=2.0, verify_cost=verify)
    assert not additive.gains([0.5], 0.5)  # the old view: (1.9) / (2.5 + 20) < 1.4 / 12


def test_cast_calibrates_top_k_children_by_their_own_q():
    """CAST's feedback gives the calibrator each verified node's own local log q (`tree.logq`),
    the value its table cell was looked up by: every observed cell's mean q lies inside its bin
    (a path's cumulative log q, or the parent's, would fall below it)."""
    sim = Simulation(*DRAFTS["calibrated"], gpu_like_table(), batch=2)
    policy = make_policy("cast", cost_table=sim.table, deterministic=True)
    sim.run(policy, 20)
    cal = policy._calibrators[False]
    seen = cal.seen >= 1.0
    assert seen.sum() >= 5
    mean_q = np.exp(cal.mean_logq())[seen]
    bins = np.broadcast_to(np.arange(cal.bins), seen.shape)[seen]
    lo, hi = np.concatenate([[0.0], cal.edges])[bins], np.concatenate([cal.edges, [1.0]])[bins]
    assert ((mean_q >= lo * 0.9) & (mean_q <= hi)).all(), (mean_q, lo, hi)


def test_cast_drafts_with_few_reads():
    """Break-even CAST decides its layers from the previous step's plan and reads once at the end
    (more only while a confident step keeps paying for another layer)."""
    sim = Simulation(*DRAFTS["calibrated"], gpu_like_table(), batch=2)
    policy = make_policy("cast", cost_table=sim.table, deterministic=True)
    reads = []
    draft = policy.draft

    def counted(*args, **kwargs):
        with HostWorkCounter() as counter:
            out = draft(*args, **kwargs)
        reads.append(counter.host_reads)
        return out

    policy.draft = counted  # type: ignore[method-assign]
    states = sim.run(policy, STEPS)
    assert sum(reads[WARMUP:]) / len(reads[WARMUP:]) <= 1.5, reads
    assert sum(s.levels for s in states[WARMUP:]) / (STEPS - WARMUP) >= 3  # deep trees all the same


def test_dynatree_history_does_not_shrink_a_calibrated_draft_tree():
    """The paper's history signal (accepted / drafted) falls as a tree grows, so against fixed
    bounds it drives D_0 to its floor and the trees to a few nodes even for a draft whose
    probabilities are exact; accepted against the tree's own prediction does not."""
    sim = Simulation(*DRAFTS["calibrated"], gpu_like_table(), batch=1)
    # the raw probabilities (calibrate off): the signals are compared on a draft whose probabilities
    # are exact; calibration's online estimates would add their own noise to both
    drafted = make_policy("dynatree", history_rule="drafted", calibrate=False)
    predicted = make_policy("dynatree", history_rule="predicted", calibrate=False)
    by_drafted = summary(sim.run(drafted, STEPS)[WARMUP:])
    by_predicted = summary(sim.run(predicted, STEPS)[WARMUP:])
    assert drafted.cur_d0 < drafted.d0  # the paper's signal went conservative, and stays there
    assert predicted.cur_d0 >= predicted.d0
    assert by_predicted["expected"] > by_drafted["expected"] and by_predicted["depth"] > by_drafted["depth"]
    ratio = predicted.windowed_acceptance()
    assert ratio is not None and 0.6 < ratio < 1.4  # a calibrated draft: about what the tree predicts


@pytest.mark.parametrize("draft", sorted(DRAFTS))
@pytest.mark.parametrize("batch", [1, 2, 4, 16])
def test_dynatree_fills_a_free_verification_width(draft, batch):
    """Where verifying 64 tokens costs one token's (a GPU), DynaTree's pruning and early stop save
    nothing: inside the free width (free_tokens // B - 1 draft tokens a row) it keeps its best
    nodes by p instead, and beats both its own paper rules and the static tree per unit time
    (the paper's rules lost to the static tree at B = 1 on an H100, issue 18)."""
    sim = Simulation(*DRAFTS[draft], gpu_like_table(), batch=batch)
    free, paper, static = run("dynatree", sim, free_tokens=64), run("dynatree", sim, free_tokens=0), run("static", sim)
    assert free["rate"] > paper["rate"], (free, paper)
    assert free["rate"] >= static["rate"], (free, static)
    assert free["nodes"] <= 64 // batch - 1


@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_dynatree_free_width_reaches_eagle2_at_batch_1(draft):
    """Inside the free width every node proposes b_max children and the rerank by p keeps the best:
    confidence branching's cap (1 child for a confident node) saves nodes that cost nothing there.
    With it capped, DynaTree's best 63 nodes came from a narrower pool and stayed below EAGLE-2's
    tree at B = 1 (0.139 against 0.156, calibrated draft)."""
    sim = Simulation(*DRAFTS[draft], gpu_like_table(), batch=1)
    free, eagle2 = run("dynatree", sim, free_tokens=64), run("eagle2", sim)
    assert free["rate"] >= eagle2["rate"], (free, eagle2)


def test_dynatree_free_width_costs_where_every_token_costs():
    """Why the free width is off on a CPU (the default there): where every verified token costs,
    the paper's pruning is the better rule."""
    sim = Simulation(*DRAFTS["calibrated"], cpu_like_table(), batch=1)
    assert run("dynatree", sim, free_tokens=0)["rate"] > run("dynatree", sim, free_tokens=64)["rate"]


def test_dynatree_free_width_per_device_and_batch():
    policy = make_policy("dynatree")  # free_tokens None: the device's default
    assert policy.free_width(1, torch.device("cpu")) == 0
    assert policy.free_width(1, torch.device("cuda")) == 63
    assert policy.free_width(16, torch.device("cuda")) == 3
    assert policy.free_width(64, torch.device("cuda")) == 0  # one token a row: nothing is free
    assert make_policy("dynatree", free_tokens=20).free_width(2, torch.device("cpu")) == 9
    assert make_policy("dynatree", free_tokens=64, phase=0).free_width(1, torch.device("cuda")) == 0  # the fixed tree stays fixed
    assert make_policy("dynatree", free_tokens=10**6, max_nodes=40).free_width(1, torch.device("cpu")) == 40  # the node budget caps it


@pytest.mark.parametrize("flat_tokens", [40, 64])
def test_dynatree_measured_free_width_is_the_knee_of_the_costs(flat_tokens):
    """With a cost table (on CUDA the pair's, found or measured; here injected) the free width is
    the knee of the target's costs per batch size, not a constant: a table flat to `flat_tokens`
    tokens over the batch gives flat_tokens // B tokens a row (minus the root), a CPU-like one,
    whose every token costs, none, and neither does the bundled pair's own CPU profile."""
    policy = make_policy("dynatree", cost_table=gpu_like_table(flat_tokens=flat_tokens))
    for batch in (1, 2, 4, 8):
        expected = flat_tokens // batch - 1 if flat_tokens // batch >= MIN_MEASURED_FREE else 0
        assert policy.free_width(batch, torch.device("cpu"), 300) == expected, batch
    assert make_policy("dynatree", cost_table=cpu_like_table()).free_width(1, torch.device("cpu"), 300) == 0
    assert make_policy("dynatree", cost_profile=str(SHIPPED_PROFILE)).free_width(1, torch.device("cpu"), 300) == 0
    assert make_policy("dynatree", cost_table=gpu_like_table(), free_tokens=20).free_width(1, torch.device("cpu")) == 19  # given wins
    assert make_policy("dynatree", cost_table=gpu_like_table(), phase=0).free_width(1, torch.device("cpu")) == 0  # the fixed tree stays fixed


def test_cost_knee_holds_under_measurement_noise():
    """±3% noise on every measured point moves the knee of a table flat to 64 tokens by a few
    tokens, where a threshold between neighbouring points could move it anywhere."""
    base, rng = gpu_like_table(), random.Random(0)
    noisy = CostTable.synthetic(lambda b, c, n: base.target_cost(b, c, n) * (1 + rng.uniform(-0.03, 0.03)), base.draft_cost)
    policy = make_policy("dynatree", cost_table=noisy)
    assert 48 <= policy.free_width(1, torch.device("cpu"), 300) <= 70
    assert 24 <= policy.free_width(2, torch.device("cpu"), 300) <= 40
    assert cost_knee([1, 2, 4, 8, 16, 32, 64, 128], [10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 20.0], 128) == 64  # between 64 and 128: the last point measured flat
    assert cost_knee([1, 2, 4, 8, 16], [1.0, 2.0, 4.0, 8.0, 16.0], 16) == 1  # every token costs


H200_TARGET_MS = {  # a synthetic 3B Llama pair's quick profile on an H200 (bf16, CUDA graphs, context 256; 2026-11-25)
    1: [5.47, 5.64, 5.75, 5.91, 6.16, 6.27, 6.35, 6.56],
    4: [6.40, 6.62, 6.88, 6.96, 6.98, 7.39, 8.24, 9.90],
    16: [9.88, 10.13, 10.17, 10.64, 11.48, 14.19, 20.42, 27.69],
}
"""ms per target forward at n = 1, 2, 4, 8, 16, 32, 64, 96 tokens a row"""


def _measured_gpu_table() -> CostTable:
    grid = (1, 2, 4, 8, 16, 32, 64, 96)

    def target(b: int, c: int, n: int) -> float:
        row = H200_TARGET_MS[min(H200_TARGET_MS, key=lambda k: abs(k - b))]
        for i in range(1, len(grid)):
            if n <= grid[i]:
                return row[i - 1] + (row[i] - row[i - 1]) * (n - grid[i - 1]) / (grid[i] - grid[i - 1])
        return row[-1]

    return CostTable.synthetic(target, lambda b, c, n: 0.6 + 0.03 * n * b, batch_sizes=(1, 4, 16), num_contexts=2, n_grid=grid)


H100_B1_TARGET_MS = [6.14, 6.40, 6.40, 6.59, 6.86, 6.86, 7.03, 7.14]
"""the same shape's quick profile on an H100 at batch 1 (2026-11-26, `benchmarks/gpu/2026-11-26`), n as above"""


def test_dynatree_free_width_on_a_gently_rising_gpu_curve():
    """A GPU's forward cost at small batches rises slowly from the first token (about with log n),
    with no flat-then-linear hinge: the knee fit alone put the width at 1-2 tokens there, so
    DynaTree ran the paper's rules on an H100 and an H200 at batch 1. The tolerance sets the width
    instead, as a share of the step's least cost (the target's forward plus D_0 draft forwards):
    a verification of 64 tokens costs 16% more than one of one token on the H200, but only 0.9 ms
    of a 15 ms step, and DynaTree was 1.2x faster with 64 tokens than with the 12 that a share of
    the forward alone allowed (H100). Where the costs rise steeply (batch 16 past 16 tokens), the
    knee still cuts the width."""
    table = _measured_gpu_table()
    assert cost_knee([1, 2, 4, 8, 16, 32, 64, 96], H200_TARGET_MS[1], 128) < MIN_MEASURED_FREE  # no hinge
    policy = make_policy("dynatree", cost_table=table)
    widths = {b: policy.free_width(b, torch.device("cuda"), 256) for b in (1, 4, 16)}
    # batch 1: the limit is 5.47 + 0.1 * (5.47 + 5 * 0.63) = 6.33 ms, between the 32-token (6.27) and
    # 64-token (6.35) points; a share of the forward alone (6.02 ms) stopped at 13 tokens
    assert 32 <= widths[1] < 64 and 16 <= widths[4] <= 32, widths
    assert 0 < widths[16] <= 16, widths  # the knee: 11.48 ms at 16 tokens, 14.19 at 32
    grid = (1, 2, 4, 8, 16, 32, 64, 96)

    def h100(b: int, c: int, n: int) -> float:
        return float(np.interp(n, grid, H100_B1_TARGET_MS))

    h100_policy = make_policy("dynatree", cost_table=CostTable.synthetic(h100, lambda b, c, n: 0.65, batch_sizes=(1,), num_contexts=1, n_grid=grid))
    # 6.14 + 0.1 * (6.14 + 5 * 0.65) = 7.08 ms: past 64 tokens (7.03), short of 96 (7.14)
    assert 64 <= h100_policy.free_width(1, torch.device("cuda"), 256) < 96


def test_dynatree_free_width_needs_a_gentle_start():
    """Costs that rise from the first token as a CPU's do (4% of a forward a token) leave no free
    width, even with a draft as slow as the target, whose D_0 forwards make a step's least cost
    large beside a few tokens' price: a forward over MIN_MEASURED_FREE tokens must itself be
    within the tolerance of a one-token one."""
    slow_draft = CostTable.synthetic(lambda b, c, n: 6.0 + 0.25 * b * (n - 1), lambda b, c, n: 6.0, batch_sizes=(1, 2), num_contexts=1)
    assert make_policy("dynatree", cost_table=slow_draft).free_width(1, torch.device("cuda"), 256) == 0
    gentle = CostTable.synthetic(lambda b, c, n: 6.0 + 0.0625 * b * (n - 1), lambda b, c, n: 6.0, batch_sizes=(1, 2), num_contexts=1)
    # the same draft over a gentle curve: 6.0 + 0.1 * (6.0 + 5 * 6.0) = 9.6 ms, 58 tokens at 0.0625 ms a token
    assert make_policy("dynatree", cost_table=gentle).free_width(1, torch.device("cuda"), 256) == 57


@pytest.mark.parametrize("flat_tokens", [40, 100])
def test_dynatree_measured_free_width_is_not_below_a_fixed_one(flat_tokens):
    """Where the knee is not at the fixed 64 tokens (a smaller or larger model, another GPU), the
    measured width's trees deliver at least the fixed width's expected tokens per ms (within the
    simulation's noise)."""
    table = gpu_like_table(flat_tokens=flat_tokens)
    for batch in (1, 2):
        sim = Simulation(*DRAFTS["calibrated"], table, batch=batch)
        measured, fixed = run("dynatree", sim, cost_table=table)["rate"], run("dynatree", sim, free_tokens=64)["rate"]
        assert measured >= 0.98 * fixed, (batch, measured, fixed)


def test_dynatree_measures_costs_only_where_its_width_is_measured():
    """On a CPU with no cost profile DynaTree needs no cost table: the decoder registers none
    (nothing is loaded or measured), while CAST's is; with a cost_profile DynaTree wants one."""
    policy = make_policy("dynatree")
    assert not policy.wants_cost_table(torch.device("cpu")) and policy.wants_cost_table(torch.device("cuda"))
    assert make_policy("dynatree", cost_profile=str(SHIPPED_PROFILE)).wants_cost_table(torch.device("cpu"))
    assert not make_policy("dynatree", free_tokens=0).wants_cost_table(torch.device("cuda"))
    assert not make_policy("dynatree", cost_table=gpu_like_table()).wants_cost_table(torch.device("cuda"))  # given: nothing to find


def test_dynatree_free_width_predicts_from_the_verified_nodes():
    """Inside the free width the tree keeps the best nodes of a larger drafted set: the history
    rule's prediction is the sum of p(u) over the verified nodes only (the dropped ones would make
    the draft look overconfident and walk the parameters to their conservative bounds)."""
    sim = Simulation(*DRAFTS["calibrated"], gpu_like_table(), batch=2)
    policy = make_policy("dynatree", free_tokens=24, calibrate=False)  # p(u) = exp(cum_logq): readable from the tree
    predicted = []
    draft = policy.draft

    def recorded(source, roots, ctx):
        out = draft(source, roots, ctx)
        tree = out.tree
        kept = tree.cum_logq.masked_fill(~tree.valid, float("-inf"))[:, 1:].exp().sum(dim=1)  # [B]
        predicted.append((policy._predicted_sum.clone(), kept, tree.valid.sum(dim=1)))
        return out

    policy.draft = recorded  # type: ignore[method-assign]
    sim.run(policy, 6)
    for got, kept, nodes in predicted:
        assert torch.allclose(got, kept), (got, kept)
        assert bool((nodes <= 24 // 2).all())  # the root and at most 11 draft tokens a row


def test_cast_goes_plain_in_the_simulation_where_drafting_cannot_pay():
    """A CPU-like table whose draft forward costs more than a target one, and a draft the target
    rarely agrees with: CAST's plain-steps check (the simulated source defers the root) must run
    most steps plain, near AR's rate, where drafting every step loses a fifth of it. (Near: the
    check still probes two drafted steps every 16 plain ones, and it times steps by the
    simulated ms plus its own feedback's wall time, which a loaded machine stretches: 0.94-0.98x
    AR's rate over repeated runs.)"""
    table = cpu_like_table(draft_ms=8.0, draft_per_token=0.5)
    runs = {}
    for name, options in (("plain", {}), ("always", {"plain_steps": False})):
        sim = Simulation(SyntheticDraft(lo=0.02, hi=0.1), Truth(1.0), table, batch=1)
        runs[name] = sim.run(make_policy("cast", cost_table=table, **options), 80)[20:]
    ar_rate = 1.0 / table.target_cost(1, 300, 1)  # one token per one-token forward (the simulation's context, 300)
    plain_steps = sum(1 for s in runs["plain"] if s.draft_ms == 0.0 and s.levels == 0)
    assert plain_steps >= 0.8 * len(runs["plain"]), plain_steps
    assert not any(s.draft_ms == 0.0 for s in runs["always"])
    plain, always = summary(runs["plain"])["rate"], summary(runs["always"])["rate"]
    assert plain >= 0.9 * ar_rate, (plain, ar_rate)
    assert plain > 1.1 * always, (plain, always)
