"""DynaTree (`--method dynatree`): each drafting rule on hand-built draft distributions, the
history rule, validation, CLI wiring, and greedy equivalence with the target's own
`generate` for every phase and parameter extremes."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable

import pytest
import torch
from conftest import EOS, sharpen, tiny_model

from specdec.cli import build_parser, collect_method_options, main
from specdec.drafting import ChainPolicy
from specdec.drafting.builder import DraftContext
from specdec.drafting.dynatree import (
    DynaTreePolicy,
    compact,
    confidence_branching,
    dynamic_depth_expandable,
    keep_within_budget,
    significant_difference,
    t_critical,
)
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import POLICY_CLASSES, make_policy, method_options
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.sources.base import AcceptedPaths, NodeBatch
from specdec.stats import StepRecord
from specdec.verification import GreedyRule, make_rule

V = 50
"""vocabulary of the hand-built draft distributions"""

DistFn = Callable[[int, tuple[int, ...]], dict[int, float]]
"""dist(row, path) -> {token: prob} for the children of the node whose draft tokens (root excluded) are `path`"""


def spread(probs: dict[int, float]) -> torch.Tensor:
    """A [V] distribution: the given probabilities, the remaining mass spread evenly over the other tokens."""
    out = torch.zeros(V)
    for tok, p in probs.items():
        out[tok] = p
    rest = [t for t in range(V) if t not in probs]
    out[rest] = max(0.0, 1.0 - sum(probs.values())) / len(rest)
    return out


class TableSource:
    """A fake DraftSource: each node's children distribution is `dist(row, path)`; records every expand call."""

    def __init__(self, dist: DistFn) -> None:
        self.dist = dist
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []  # (nodes [B, k], valid [B, k]) per expand

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        return None

    def begin_step(self, roots: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return torch.stack([spread(self.dist(row, ())) for row in range(roots.shape[0])]).log()  # [B, V]

    def expand(self, batch: NodeBatch, params: SamplingParams) -> torch.Tensor:
        nodes, valid = batch.nodes, batch.valid
        self.calls.append((nodes.clone(), valid.clone()))
        b, k = nodes.shape
        out = torch.full((b, k, V), 1.0 / V)
        for row in range(b):
            for col in range(k):
                if valid[row, col]:
                    path = tuple(int(batch.tokens[row, i]) for i in _path(batch, row, int(nodes[row, col])))
                    out[row, col] = spread(self.dist(row, path))
        return out.log()  # [B, k, V]

    def end_step(self, accepted: AcceptedPaths) -> None:
        return None

    def feedback(self, record: StepRecord) -> None:
        return None


def _path(batch: NodeBatch, row: int, node: int) -> list[int]:
    """Builder indices from the root's first child down to `node`."""
    return [i for i in range(1, batch.tokens.shape[1]) if batch.ancestors[row, node, i]]


def draft(policy: DynaTreePolicy, dist: DistFn, rows: int = 1, max_depth: int = 50, active: list[bool] | None = None):
    """Run one drafting step on the fake source; returns (tree, source)."""
    src = TableSource(dist)
    act = torch.tensor(active if active is not None else [True] * rows)
    ctx = DraftContext(params=SamplingParams(), generator=None, max_depth=max_depth, active=act)
    drafted = policy.draft(src, torch.full((rows,), 3, dtype=torch.long), ctx)
    tree, builder, builder_nodes = drafted.tree, drafted.builder, drafted.builder_nodes
    assert builder_nodes.shape == tree.tokens.shape
    assert builder.draft_forwards == 1 + len(src.calls)
    return tree, src


def paper_policy(**options) -> DynaTreePolicy:
    """DynaTree with the paper's raw draft probabilities as p(u) and c(u) (calibration off): the
    rules below are checked on hand-built probabilities, which calibration would replace."""
    return DynaTreePolicy(calibrate=False, **options)


def nodes_of(tree, row: int = 0) -> dict[tuple[int, ...], float]:
    """{path of tokens (root excluded): p} of every drafted node of a row."""
    out = {}
    for i in range(1, tree.num_nodes):
        if tree.valid[row, i]:
            path = tuple(int(tree.tokens[row, j]) for j in tree.path_to(row, i)[1:])
            out[path] = float(tree.cum_logq[row, i].exp())
    return out


# ----- the rules on hand-built distributions -------------------------------------------------


def test_confidence_branching_rule():
    conf = torch.tensor([0.95, 0.9001, 0.85, 0.4001, 0.3999, 0.1])
    logprobs = torch.stack([spread({0: c}) for c in conf.tolist()]).log()  # [6, V]
    got = confidence_branching(logprobs, tau_high=0.9, tau_low=0.4, b_min=1, b_mid=2, b_max=3)
    assert got.tolist() == [1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize(("b_min", "b_mid", "b_max"), [(1, 2, 3), (1, 1, 4), (2, 2, 2), (1, 3, 3)])
def test_rank_table_keeps_the_first_b_u_children(b_min, b_mid, b_max):
    """The policy's one-comparison rank table (both level paths use it) keeps exactly the first
    B(u) children, B(u) from `confidence_branching` (the paper's rule), at every confidence (off the
    exact thresholds, where float32 log-probs and probabilities round differently)."""
    conf = torch.tensor([0.99, 0.9001, 0.8999, 0.6, 0.4001, 0.3999, 0.05])
    logprobs = torch.stack([spread({0: c}) for c in conf.tolist()]).log()[None]  # [1, 7, V]
    pol = DynaTreePolicy(b_min=b_min, b_mid=b_mid, b_max=b_max, calibrate=False)
    k = b_max + 1
    allowed = pol._allowed_children(logprobs.amax(dim=-1, keepdim=True), k, torch.device("cpu"))  # [1, 7, k]
    expected = confidence_branching(logprobs, pol.cur_tau_high, pol.tau_low, b_min, b_mid, b_max)  # [1, 7]
    assert allowed.sum(dim=-1).tolist() == expected.tolist()
    assert (allowed == (torch.arange(k) < expected[..., None])).all()  # the first B(u), by rank


def test_branching_from_draft_confidence_one_level():
    """Three rows, one level: confident -> B_min, middling -> B_mid, uncertain -> B_max best children."""
    roots = [{7: 0.95, 8: 0.03}, {7: 0.6, 8: 0.3, 9: 0.05}, {7: 0.3, 8: 0.25, 9: 0.2, 10: 0.15}]
    tree, src = draft(paper_policy(), lambda row, path: roots[row], rows=3, max_depth=1)
    assert tree.drafted_per_row().tolist() == [1, 2, 3]
    assert set(nodes_of(tree, 0)) == {(7,)}
    assert set(nodes_of(tree, 1)) == {(7,), (8,)}
    assert set(nodes_of(tree, 2)) == {(7,), (8,), (9,)}
    assert src.calls == []  # max_depth 1: only the root's distribution is needed


def test_free_width_proposes_b_max_children_and_keeps_the_best_by_p():
    """Inside the free width the confident row's node proposes b_max children too (B(u) saves nodes
    that cost nothing there) and the width keeps the best by p: with room for 4 draft tokens the
    confident row's tree is its 4 best nodes by p over 3 children a node, not a chain of one child a node."""
    roots = [{7: 0.95, 8: 0.03, 9: 0.01}, {7: 0.6, 8: 0.3, 9: 0.05}]
    dist = lambda row, path: roots[row] if len(path) == 0 else {7: 0.95, 8: 0.03, 9: 0.01}  # noqa: E731
    tree, _ = draft(paper_policy(free_tokens=10), dist, rows=2, max_depth=2)  # 10 // 2 - 1 = 4 a row
    assert set(nodes_of(tree, 0)) == {(7,), (8,), (7, 7), (7, 8)}  # p 0.95, 0.03, 0.9025, 0.0285 (9: 0.01)
    assert set(nodes_of(tree, 1)) == {(7,), (8,), (7, 7), (8, 7)}  # 0.6, 0.3, 0.57, 0.285 (9: 0.05)
    capped, _ = draft(paper_policy(), dist, rows=2, max_depth=2)  # the paper's rules: B(u) = 1 for c >= tau_h
    assert set(nodes_of(capped, 0)) == {(7,), (7, 7)}


def test_dynamic_depth_gate_function():
    logp = torch.tensor([0.9, 0.6, 0.4, 0.09]).log()
    gate = dict(d0=5, d_max=8, rho_stop=0.1, rho_deep=0.5)
    assert dynamic_depth_expandable(2, logp, **gate).tolist() == [True, True, True, False]  # early stop below rho_stop
    assert dynamic_depth_expandable(5, logp, **gate).tolist() == [True, True, False, False]  # beyond D_0: needs rho_deep
    assert dynamic_depth_expandable(8, logp, **gate).tolist() == [False] * 4  # hard limit D_max
    assert not dynamic_depth_expandable(1, torch.tensor([float("-inf")]), **gate).item()


def confident_chain(q: float, side: float = 0.0) -> DistFn:
    """Along the all-1 path: token 1 with prob q (and token 2 with `side`); elsewhere flat."""
    return lambda row, path: ({1: q, 2: side} if side else {1: q}) if all(t == 1 for t in path) else {}


def test_deep_expansion_along_a_likely_path():
    """p = 0.95^d stays >= rho_deep, so the chain (c >= tau_h -> one child) grows past D_0 up to D_max."""
    tree, src = draft(paper_policy(), confident_chain(0.95))
    assert tree.max_depth() == 8 and tree.drafted_per_row().item() == 8
    assert len(src.calls) == 7  # one draft forward per level below the root


def test_depth_gate_stops_beyond_d0_and_early_stops_unlikely_siblings():
    """Main path p = 0.88^d: at depth 5 p = 0.53 >= 0.5 expands, at depth 6 p = 0.46 stops.
    The siblings (token 2, p <= 0.08 < rho_stop) are added (>= tau) but never expanded."""
    tree, src = draft(paper_policy(), confident_chain(0.88, side=0.08))
    got = nodes_of(tree)
    main_path = [(1,) * d for d in range(1, 7)]
    siblings = [(1,) * d + (2,) for d in range(0, 6)]
    assert set(got) == set(main_path) | set(siblings)
    assert tree.max_depth() == 6
    assert math.isclose(got[(1,) * 6], 0.88**6, rel_tol=1e-4)
    # every expand call carries exactly the one main-path node
    assert [int(v.sum()) for _, v in src.calls] == [1] * 5


def test_early_stop_before_d0():
    """A path whose p falls below rho_stop stops even at depth < D_0."""
    tree, _ = draft(paper_policy(rho_stop=0.3, prune_tau=0.01), confident_chain(0.6, side=0.35))
    # depth 1: 0.6 and 0.35 (both >= 0.3, expandable); depth 2: 0.36 (expandable), 0.21, 0.21, 0.12; depth 3: 0.216, 0.126
    assert tree.max_depth() == 3
    assert set(nodes_of(tree)) == {(1,), (2,), (1, 1), (1, 2), (1, 1, 1), (1, 1, 2)}


def test_probability_threshold_pruning():
    """A child with p < tau is never added (not even as a leaf)."""
    dist = lambda row, path: {(): {1: 0.6, 2: 0.3}, (1,): {3: 0.5, 4: 0.45}}.get(path, {})  # noqa: E731
    tree, _ = draft(paper_policy(prune_tau=0.28), dist)
    got = nodes_of(tree)
    assert set(got) == {(1,), (2,), (1, 3)}  # (1, 4): 0.27 < 0.28 pruned
    tree, _ = draft(paper_policy(prune_tau=0.35), dist)
    assert set(nodes_of(tree)) == {(1,)}  # (2,) pruned, (1, 3) = 0.3 pruned


def budget_dist(row: int, path: tuple[int, ...]) -> dict[int, float]:
    return {
        (): {1: 0.35, 2: 0.3, 3: 0.25},  # c < tau_l: 3 children
        (1,): {4: 0.5, 5: 0.4},  # p: 0.175, 0.14
        (2,): {6: 0.35, 7: 0.33, 8: 0.3},  # p: 0.105, 0.099, 0.09
        (3,): {9: 0.95},  # p: 0.2375
    }.get(path, {})


def test_node_budget_keeps_the_most_likely_candidates_of_a_level():
    tree, src = draft(paper_policy(max_nodes=6, rho_stop=0.05, prune_tau=0.01), budget_dist)
    got = nodes_of(tree)
    assert len(got) == 6
    assert {p for p in got if len(p) == 2} == {(3, 9), (1, 4), (1, 5)}
    assert len(src.calls) == 1  # budget spent: the depth-2 nodes are not expanded
    # without the budget every candidate survives
    tree, _ = draft(paper_policy(max_nodes=256, rho_stop=0.05, prune_tau=0.01), budget_dist)
    assert len(nodes_of(tree)) == 9


def test_budget_of_one_and_budget_cut_function():
    tree, src = draft(paper_policy(max_nodes=1), budget_dist)
    assert set(nodes_of(tree)) == {(1,)} and src.calls == []
    score = torch.tensor([[-0.1, -2.0, -0.5, -0.5], [-1.0, -1.0, -1.0, -1.0]])
    valid = torch.tensor([[True, True, True, True], [True, False, True, True]])
    keep = keep_within_budget(score, valid, torch.tensor([2, 2]))
    assert keep.tolist() == [[True, False, True, False], [True, False, True, False]]  # ties -> earlier column
    order, kept = compact(torch.tensor([[False, True, False, True]]), 3)
    assert order.tolist() == [[1, 3, 0]] and kept.tolist() == [[True, True, False]]


def test_one_batched_forward_per_level_with_padding():
    """Rows with different frontier sizes share one expand call per level; short rows are padded invalid."""
    dists = [confident_chain(0.95), budget_dist]
    policy = paper_policy(rho_stop=0.05, prune_tau=0.01, d0=3, d_max=4)
    tree, src = draft(policy, lambda row, path: dists[row](row, path), rows=2)
    assert tree.depths[0].max().item() == 4
    assert len(src.calls) == 3  # levels 1, 2, 3 expanded; depth 4 = D_max
    nodes, valid = src.calls[0]
    assert nodes.shape[0] == 2 and valid.sum(dim=1).tolist() == [1, 3]
    for nodes, valid in src.calls:  # padding never duplicates a real entry of the same row
        for row in range(2):
            real = nodes[row][valid[row]].tolist()
            assert len(set(nodes[row].tolist())) == nodes.shape[1] and len(real) == len(set(real))


def test_free_width_reads_only_where_the_depth_gate_decides():
    """Inside the free width nothing stops early above D_0, so those levels grow every valid node
    with no host read; only levels from D_0 on (the rho_deep gate) read. Here D_0 = 4 and no
    depth-4 node reaches rho_deep: one read in all (the paper's rules read once per level from
    depth 1: 3)."""
    from specdec.hostwork import HostWorkCounter, uncounted

    class Uncounted(TableSource):  # the fake source reads its tables on the host: not the policy's reads
        def begin_step(self, roots, params):
            with uncounted():
                return super().begin_step(roots, params)

        def expand(self, batch, params):
            with uncounted():
                return super().expand(batch, params)

    middling = lambda row, path: {1: 0.5, 2: 0.3, 3: 0.1}  # noqa: E731  every node: b_mid = 2 children
    policy = paper_policy(free_tokens=30, d0=4, d_max=6)
    src = Uncounted(middling)
    ctx = DraftContext(params=SamplingParams(), generator=None, max_depth=50, active=torch.tensor([True]))
    with HostWorkCounter() as counter:
        drafted = policy.draft(src, torch.full((1,), 3, dtype=torch.long), ctx)
    assert counter.host_reads == 1
    tree = drafted.tree
    assert int(tree.valid.sum()) == 1 + 29  # the root and the free width's 29 best of 2 + 4 + 8 + 16 nodes
    assert tree.depths[0].max().item() == 4  # p <= 0.5^4 at depth 4 < rho_deep: nothing deeper
    assert len(src.calls) == 3  # levels 1-3 expanded without reads; depth 4 read and stopped


def test_respects_ctx_max_depth_and_inactive_rows():
    tree, src = draft(paper_policy(), confident_chain(0.95), rows=2, max_depth=3, active=[True, False])
    assert tree.max_depth() == 3 and len(src.calls) == 2
    assert tree.drafted_per_row().tolist() == [3, 0]
    assert all(not v[1].any() for _, v in src.calls)
    tree, src = draft(paper_policy(), confident_chain(0.95), max_depth=0)
    assert tree.drafted_per_row().tolist() == [0] and src.calls == []


def test_node_buffers_do_not_shrink_at_a_rows_last_tokens():
    """A row's last tokens cap the tree's depth (`ctx.max_depth`), not the builder's node buffers:
    one size for every step, so captured levels keep their buffers' addresses and their graphs
    (sized by the depth cap, the bundled pair's emulated level graphs were captured 43 times over
    12 prompts, 19 with one size)."""
    for options in ({}, {"free_tokens": 16}, "chain"):
        policy = ChainPolicy(k=5) if options == "chain" else paper_policy(**options)  # (the chain's the same way: 14 -> 8 level graphs)
        capacities = []
        for max_depth in (50, 3, 1):
            drafted = policy.draft(TableSource(confident_chain(0.95)), torch.full((1,), 3, dtype=torch.long), DraftContext(params=SamplingParams(), generator=None, max_depth=max_depth, active=torch.tensor([True])))
            assert drafted.tree.max_depth() <= max_depth
            capacities.append(drafted.builder.capacity)
        assert capacities[0] == capacities[1] == capacities[2], (options, capacities)


def test_phases_change_the_shape():
    """Phase 0 gives every node B_mid children to D_0; phase 1 branches by confidence (still D_0);
    phase 2 adds the depth gate (deeper along likely paths)."""
    dist = lambda row, path: {1: 0.95, 2: 0.04}  # noqa: E731  confident everywhere
    kw = dict(d0=2, prune_tau=0.01)
    t0, _ = draft(paper_policy(phase=0, **kw), dist)
    assert set(nodes_of(t0)) == {(1,), (2,), (1, 1), (1, 2), (2, 1)}  # (2, 2) = 0.0016 pruned
    t1, _ = draft(paper_policy(phase=1, **kw), dist)
    assert set(nodes_of(t1)) == {(1,), (1, 1)}
    t2, _ = draft(paper_policy(phase=2, **kw), dist)
    assert set(nodes_of(t2)) == {(1,) * d for d in range(1, 9)}
    # phase 1 ignores rho_stop: nodes with p < rho_stop still expand up to D_0
    low = lambda row, path: {1: 0.3, 2: 0.28, 3: 0.27}  # noqa: E731
    t1, _ = draft(paper_policy(phase=1, d0=2, prune_tau=0.05, rho_stop=0.35), low)
    t2, _ = draft(paper_policy(phase=2, d0=2, prune_tau=0.05, rho_stop=0.35), low)
    assert t1.max_depth() == 2 and t2.max_depth() == 1


# ----- the history rule ----------------------------------------------------------------------


def record(drafted: list[int], accepted: list[int], active: list[bool] | None = None, step: int = 0) -> StepRecord:
    n = len(drafted)
    return StepRecord(
        step=step,
        active=active if active is not None else [True] * n,
        drafted=drafted,
        accepted_len=accepted,
        committed=[a + 1 for a in accepted],
        relaxed=[0] * n,
        strict_fallbacks=[0] * n,
        tree_depth=0,
        draft_s=0.0,
        verify_s=0.0,
        drafted_by_depth=[[] for _ in range(n)],
        accepted_depth=accepted,
    )


def test_history_rule_moves_every_step_and_stays_in_bounds():
    pol = paper_policy(history_rule="drafted")
    assert (pol.cur_d0, pol.cur_tau_high, pol.cur_rho_deep) == (5, 0.9, 0.5)
    pol.feedback(record([10], [8]))  # a = 0.8 > a_high: more aggressive at once
    assert (pol.cur_d0, pol.cur_tau_high, pol.cur_rho_deep) == (6, 0.85, 0.45)
    for _ in range(30):
        pol.feedback(record([10], [8]))
    lo_hi = pol.bounds()
    assert lo_hi == {"d0": (2, 8), "tau_high": (0.45, 0.99), "rho_deep": (0.1, 0.9)}
    assert (pol.cur_d0, pol.cur_tau_high, pol.cur_rho_deep) == (8, 0.45, 0.1)  # aggressive bounds
    assert pol.cur_tau_high > pol.tau_low and pol.cur_rho_deep >= pol.rho_stop
    for _ in range(60):
        pol.feedback(record([10], [0]))
    assert (pol.cur_d0, pol.cur_tau_high, pol.cur_rho_deep) == (2, 0.99, 0.9)  # conservative bounds
    pol.reset_history()
    assert (pol.cur_d0, pol.cur_tau_high, pol.cur_rho_deep, len(pol.history)) == (5, 0.9, 0.5, 0)


def test_history_window_and_batch_average():
    pol = paper_policy(history_window=3, history_rule="drafted")
    for _ in range(3):
        pol.feedback(record([4], [4]))  # a = 1
    assert pol.cur_d0 == 8 and pol.adjustments == 3
    pol.feedback(record([4], [0]))  # window (1, 1, 0): 0.67 > a_high, still aggressive
    assert pol.adjustments == 4 and pol.cur_tau_high == pytest.approx(0.7)
    pol.feedback(record([4], [0]))  # window (1, 0, 0): 0.33 in [a_low, a_high]: unchanged
    assert pol.adjustments == 4 and pol.cur_d0 == 8 and pol.windowed_acceptance() == pytest.approx(1 / 3)
    pol.feedback(record([4], [0]))  # window (0, 0, 0): conservative
    assert pol.cur_d0 == 7 and pol.cur_tau_high == pytest.approx(0.75)
    # batch average over active rows with drafted > 0: (1.0 + 0.5) / 2; inactive and empty rows ignored
    pol.reset_history()
    pol.feedback(record([4, 4, 0, 9], [4, 2, 0, 9], active=[True, True, True, False]))
    assert list(pol.history) == [0.75]
    pol.feedback(record([0, 5], [0, 5], active=[True, False]))  # nothing drafted by an active row: skipped
    assert list(pol.history) == [0.75]


def test_history_bounds_contain_the_start_values_and_phases_below_3_do_not_adapt():
    pol = paper_policy(d0=1, d_max=3, tau_high=0.42, tau_low=0.4, rho_stop=0.2, rho_deep=0.95, history_rule="drafted")
    assert pol.bounds() == {"d0": (1, 3), "tau_high": (0.42, 0.99), "rho_deep": (0.2, 0.95)}
    for _ in range(40):
        pol.feedback(record([2], [0]))
    assert (pol.cur_d0, pol.cur_tau_high, pol.cur_rho_deep) == (1, 0.99, 0.95)
    for _ in range(80):
        pol.feedback(record([2], [2]))
    assert (pol.cur_d0, pol.cur_tau_high, pol.cur_rho_deep) == (3, 0.42, 0.2)
    for phase in (0, 1, 2):
        pol = paper_policy(phase=phase, history_rule="drafted")
        pol.feedback(record([10], [10]))
        assert (pol.cur_d0, pol.cur_tau_high, pol.cur_rho_deep, len(pol.history)) == (5, 0.9, 0.5, 0)


def test_adapted_values_drive_the_next_draft():
    """After aggressive adjustment tau_h drops: a node with c = 0.88 now gets one child, not two."""
    dist = lambda row, path: {1: 0.88, 2: 0.1} if len(path) == 0 else {}  # noqa: E731
    pol = paper_policy(history_rule="drafted")
    tree, _ = draft(pol, dist, max_depth=1)
    assert tree.drafted_per_row().item() == 2
    pol.feedback(record([10], [10]))
    tree, _ = draft(pol, dist, max_depth=1)
    assert pol.cur_tau_high == pytest.approx(0.85) and tree.drafted_per_row().item() == 1


def test_predicted_history_decides_once_per_full_window():
    """history_rule 'predicted': the tree's predicted tokens (its nodes' summed path
    probabilities: 0.88 + 0.1 here) against the accepted ones, one decision per full window."""
    dist = lambda row, path: {1: 0.88, 2: 0.1} if len(path) == 0 else {}  # noqa: E731
    pol = paper_policy(history_window=3)
    for step in range(3):
        draft(pol, dist, max_depth=1)
        assert pol._predicted_sum.tolist() == pytest.approx([0.98], abs=1e-4)
        pol.feedback(record([2], [1]))  # accepted 1 where 0.98 were predicted: within 10%
        assert pol.adjustments == 0 and len(pol.history) == step + 1
    assert pol.windowed_acceptance() == pytest.approx(1 / 0.98, abs=1e-4)
    for step in range(3):
        draft(pol, dist, max_depth=1)
        pol.feedback(record([2], [2]))  # twice what the tree predicts: an underconfident draft
        assert pol.adjustments == (1 if step == 2 else 0)  # only once the window is full
    assert (pol.cur_d0, pol.cur_tau_high) == (6, pytest.approx(0.85))
    before = list(pol.history)
    pol.feedback(record([2], [2]))  # no tree drafted since: nothing to compare with
    assert list(pol.history) == before  # (history keeps the last history_window steps)


def test_predicted_history_reads_its_window_once():
    """The tree's predictions stay on the device until the window is full: feedback reads them
    all at once (one host read per window, not one per step), and the decision is the one the
    per-step values give (rows that drafted nothing or are inactive do not count)."""
    from specdec.hostwork import HostWorkCounter

    dist = lambda row, path: {1: 0.88, 2: 0.1} if len(path) == 0 else {}  # noqa: E731
    pol = paper_policy(history_window=4)
    reads = []
    for step in range(4):
        draft(pol, dist, rows=3, max_depth=1)
        with HostWorkCounter() as counter:
            pol.feedback(record([2, 2, 0], [2, 2, 2], active=[True, True, True], step=step))  # row 2 drafted nothing
        reads.append(counter.host_reads)
    assert reads == [0, 0, 0, 1]
    assert pol.adjustments == 1 and pol.cur_d0 == 6  # 4 accepted against 2 x 0.98 predicted per step: aggressive
    assert list(pol.history) == pytest.approx([4 / 1.96] * 4, abs=1e-4)


def test_significant_difference_needs_more_than_noise():
    steady = [(2.0 + 0.1 * (i % 2), 1.0) for i in range(10)]  # twice the prediction, little spread
    assert significant_difference(steady)
    assert significant_difference([(0.0, 1.0)] * 10)  # nothing accepted, no spread at all
    noisy = [(a, 2.5) for a in (0, 5, 1, 4, 2, 3, 6, 0, 2, 3)]  # mean 2.6 against 2.5: inside the noise
    assert not significant_difference(noisy)
    assert significant_difference([(1.0, 0.0), (1.0, 0.0)])  # too short to tell: the ratio band decides
    assert t_critical(9) == pytest.approx(2.262, abs=1e-3) and t_critical(29) == pytest.approx(2.045, abs=1e-3)


def test_predicted_history_holds_still_on_noise_and_moves_on_a_real_bias():
    """history_rule 'predicted' moves only on windows whose deviation is outside their own noise.
    Accepted tokens that scatter around the prediction (0, 1 or 2 against 0.98 predicted, ratio
    0.94 overall, single windows 0.6-1.4) leave D_0 near its start over 40 windows; the ±10% band
    alone moved on most windows and walked D_0 to its floor. A draft the target accepts twice as
    often as predicted still moves every window."""
    dist = lambda row, path: {1: 0.88, 2: 0.1} if len(path) == 0 else {}  # noqa: E731
    rng = random.Random(0)
    pol = paper_policy(history_window=10)
    for _ in range(400):
        draft(pol, dist, max_depth=1)  # predicts 0.98 tokens
        pol.feedback(record([2], [rng.choices([0, 1, 2], weights=[0.3, 0.48, 0.22])[0]]))
    assert pol.cur_d0 >= pol.d0 - 1 and pol.adjustments <= 6, (pol.cur_d0, pol.adjustments)
    pol = paper_policy(history_window=10)
    for _ in range(40):
        draft(pol, dist, max_depth=1)
        pol.feedback(record([2], [2 if rng.random() < 0.97 else 1]))
    assert pol.adjustments == 4 and pol.cur_d0 == pol.d0 + 3  # the fourth move is clamped at D_max


def test_calibration_learns_from_verdicts_and_values_nodes_by_calibrated_rates():
    """Calibrated DynaTree (the default): p(u) is the product of the calibrated local rates along
    u's path. An underconfident draft (its best child at q = 0.6, raw p = 0.6^d below rho_stop =
    0.3 from depth 3 on) whose chains the target always accepts learns rates near 1 for its
    rank-1 tokens at q = 0.6 and drafts deeper; the uncalibrated rule keeps the shallow tree."""
    dist = confident_chain(0.6, side=0.35)
    options = {"rho_stop": 0.3, "prune_tau": 0.01, "phase": 2}
    raw, _ = draft(paper_policy(**options), dist)
    pol = DynaTreePolicy(**options)
    first, _ = draft(pol, dist)
    assert first.max_depth() <= raw.max_depth() + 1  # before any verdict the rates are the identity prior's bins

    def drafted_and_scores() -> tuple:
        src = TableSource(dist)
        ctx = DraftContext(params=SamplingParams(), generator=None, max_depth=50, active=torch.tensor([True]))
        drafted = pol.draft(src, torch.full((1,), 3, dtype=torch.long), ctx)
        return drafted.tree, drafted.builder.score.gather(1, drafted.builder_nodes)

    for step in range(40):  # the target accepts the whole all-1 chain every step
        tree, _ = drafted_and_scores()
        path = [i for i in range(1, tree.num_nodes) if tree.valid[0, i] and all(int(tree.tokens[0, j]) == 1 for j in tree.path_to(0, i)[1:])]
        rec = record([tree.drafted_per_row().item()], [len(path)], step=step)
        rec.accepted_nodes = [path]
        pol.feedback(rec)
    rates = pol._calibrator.rates()
    assert rates[0, pol._calibrator.bin_of(0.6)] > 0.9 and pol._calibrator.observations > 0  # rank 1, q in [0.6, 0.7): learned, not the prior's 0.65
    tree, score = drafted_and_scores()
    assert tree.max_depth() >= raw.max_depth() + 3
    table = pol._calibrator._log_rate  # [ranks, bins] the log rates in use (as of the last refit)
    for i in range(1, tree.num_nodes):  # each node's value: the sum of its path's calibrated local log-rates
        if tree.valid[0, i]:
            tokens = [int(tree.tokens[0, j]) for j in tree.path_to(0, i)[1:]]
            local = [(1, 0.6) if tok == 1 else (2, 0.35) for tok in tokens]  # (rank, q) of each step along the path
            expected = sum(float(table[rank - 1, pol._calibrator.bin_of(q)]) for rank, q in local)
            assert float(score[0, i]) == pytest.approx(expected, abs=1e-4)


def test_calibrated_history_predicts_with_calibrated_values():
    """History rule 'predicted' with calibration: the prediction is the tree's summed calibrated p(u)."""
    dist = lambda row, path: {1: 0.88, 2: 0.1} if len(path) == 0 else {}  # noqa: E731
    pol = DynaTreePolicy(history_window=3)
    draft(pol, dist, max_depth=1)
    rates = pol._calibrator.rates()  # the identity prior: bin centres
    cal = pol._calibrator
    assert pol._predicted_sum.tolist() == pytest.approx([float(rates[0, cal.bin_of(0.88)] + rates[1, cal.bin_of(0.1)])], abs=1e-4)


# ----- validation, registry, CLI -------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"d0": 0}, "d0=0"),
        ({"d0": 9}, "d0=9 exceeds d_max=8"),
        ({"d_max": 2.5}, "d_max=2.5"),
        ({"b_min": 3, "b_mid": 2}, "b_min <= b_mid <= b_max"),
        ({"b_max": 1}, "b_mid=2, b_max=1"),
        ({"tau_low": 0.9, "tau_high": 0.9}, "0 < tau_low < tau_high < 1"),
        ({"tau_high": 1.0}, "tau_high=1.0"),
        ({"prune_tau": 1.0}, "prune_tau=1.0"),
        ({"rho_stop": 0.6}, "rho_stop < rho_deep"),
        ({"max_nodes": 0}, "max_nodes=0"),
        ({"history_window": True}, "history_window=True"),
        ({"phase": 4}, "phase=4"),
        ({"accept_low": 0.5, "accept_high": 0.4}, "accept_low < accept_high"),
        ({"adjust_step": 0}, "adjust_step=0"),
        ({"rho_deep": "0.5"}, "rho_deep='0.5' must be a number"),
        ({"free_tokens": -1}, "free_tokens=-1"),
        ({"free_tokens": 1.5}, "free_tokens=1.5"),
        ({"cost_profile": 3}, "cost_profile=3 must be a file path"),  # a TypeError inside pathlib at the first step
    ],
)
def test_validation_names_value_and_fix(options, needle):
    with pytest.raises(SpecDecError) as err:
        make_policy("dynatree", **options)
    assert needle in str(err.value)
    assert " --" in str(err.value)  # names the flag to fix


def test_cost_table_of_the_wrong_kind_is_named():
    """It had been an AttributeError ('str' object has no attribute 'select') at the first step."""
    with pytest.raises(SpecDecError, match="dynatree cost_table must be a specdec.cost.CostTable, got str; pass a file path as cost_profile"):
        make_policy("dynatree", cost_table="cost_profile.json")


def test_registered_with_every_field_as_option():
    assert POLICY_CLASSES["dynatree"] is DynaTreePolicy
    opts = method_options("dynatree")
    assert set(opts) == {
        "d0", "d_max", "b_min", "b_mid", "b_max", "tau_high", "tau_low", "prune_tau", "rho_stop", "rho_deep",
        "max_nodes", "history_window", "accept_high", "accept_low", "adjust_step", "phase", "tree_sampling", "history_rule", "calibrate", "free_sampled_children", "free_tokens",
        "cost_profile", "cost_table",
    }  # fmt: skip
    pol = make_policy("dynatree", d0=3, phase=1)
    assert (pol.d0, pol.phase, pol.d_max, pol.max_nodes, pol.prune_tau) == (3, 1, 8, 256, 0.03)


def test_cli_flags_map_to_fields():
    parser = build_parser()
    flags = [
        "--d0", "3", "--d-max", "6", "--b-min", "1", "--b-mid", "2", "--b-max", "4", "--tau-high", "0.8", "--tau-low", "0.3",
        "--prune-tau", "0.05", "--rho-stop", "0.05", "--rho-deep", "0.6", "--max-nodes", "32", "--history-window", "4",
        "--accept-high", "0.6", "--accept-low", "0.1", "--adjust-step", "0.1", "--dynatree-phase", "2",
    ]  # fmt: skip
    args = parser.parse_args(["generate", "--method", "dynatree", "--prompt", "x", *flags])
    opts = collect_method_options(args, "dynatree")
    assert opts == {
        "d0": 3, "d_max": 6, "b_min": 1, "b_mid": 2, "b_max": 4, "tau_high": 0.8, "tau_low": 0.3, "prune_tau": 0.05,
        "rho_stop": 0.05, "rho_deep": 0.6, "max_nodes": 32, "history_window": 4, "accept_high": 0.6, "accept_low": 0.1,
        "adjust_step": 0.1, "phase": 2,
    }  # fmt: skip
    make_policy("dynatree", **opts)
    # existing flags keep working, and dynatree flags are refused by other methods
    args = parser.parse_args(["generate", "--method", "static", "--prompt", "x", "--max-nodes", "16", "--depth", "3"])
    assert collect_method_options(args, "static") == {"max_nodes": 16, "depth": 3}
    args = parser.parse_args(["generate", "--method", "chain", "--prompt", "x", "--dynatree-phase", "1"])
    with pytest.raises(SpecDecError, match="--dynatree-phase does not apply to --method chain"):
        collect_method_options(args, "chain")


def test_cli_generate_dynatree(capsys, tiny_pair_dir):
    code = main(
        ["generate", "--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"), "--method", "dynatree",
         "--dynatree-phase", "3", "--max-nodes", "24", "--prompt", "def add(a, b):", "--max-new-tokens", "10", "--json"]
    )  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    line = json.loads(out.out.strip().splitlines()[-1])
    assert 1 <= len(line["token_ids"]) <= 10
    code = main(["generate", "--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"), "--method", "dynatree",
                 "--b-min", "3", "--prompt", "x"])  # fmt: skip
    assert code == 2 and "b_min <= b_mid <= b_max" in capsys.readouterr().err


# ----- greedy equivalence on tiny models -----------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]]
MAX_NEW = 24
CONFIGS = [
    {"phase": 0},
    {"phase": 1},
    {"phase": 2},
    {"phase": 3},
    {"phase": 3, "history_window": 1},
    {"b_min": 1, "b_mid": 1, "b_max": 1},  # degenerates to a chain
    {"max_nodes": 1},
    {"prune_tau": 0.99},
    {"d0": 1, "d_max": 1},
    {"b_min": 3, "b_mid": 3, "b_max": 3, "prune_tau": 0.0, "rho_stop": 0.0, "max_nodes": 40},  # wide, unpruned
    {"phase": 0, "d0": 8, "d_max": 8, "b_mid": 2, "prune_tau": 0.0, "max_nodes": 64},
]


@pytest.fixture(scope="module", params=["llama", "gpt_neox"])
def models(request):
    """(arch, target, {draft kind: draft}, {prompt index: reference greedy tokens})."""
    arch = request.param
    target = sharpen(tiny_model(arch, seed=0), 40.0)  # peaked enough for trees to grow (confidences 0.2-1)
    close = sharpen(tiny_model(arch, seed=0), 40.0)
    with torch.no_grad():
        for p in close.parameters():
            p.add_(0.01 * torch.randn_like(p))
    refs = {}
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            out = target.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS, pad_token_id=0)
            refs[i] = out[0, len(prompt) :].tolist()
    return arch, target, {"self": target, "close": close}, refs


@pytest.mark.parametrize("draft_kind", ["self", "close"])
def test_greedy_equals_target_generate(models, draft_kind):
    arch, target, drafts, refs = models
    accepted = 0
    for options in CONFIGS:
        policy = make_policy("dynatree", **options)
        engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(drafts[draft_kind]), eos_token_ids=[EOS])
        outs = engine.generate(PROMPTS, MAX_NEW)  # one batch: rows have different trees per level
        for i, out in enumerate(outs):
            assert out.token_ids == refs[i], f"{arch}/{draft_kind}/{options}/prompt {i}"
            accepted += out.stats.accepted_tokens
            if options.get("max_nodes") == 1:
                assert out.stats.drafted_tokens <= out.stats.steps
    assert accepted > 0


def test_feedback_adapts_within_one_generation(models):
    """The engine calls feedback after every step: the history grows by one per step that drafted."""
    arch, target, drafts, refs = models
    for rule in ("drafted", "predicted"):
        policy = make_policy("dynatree", history_window=1000, history_rule=rule)
        engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(drafts["close"]), eos_token_ids=[EOS])
        out = engine.generate([PROMPTS[0]], MAX_NEW, keep_steps=True)[0]
        assert out.token_ids == refs[0]
        drafted_steps = sum(1 for s in out.steps if s.active[0] and s.drafted[0] > 0)
        assert len(policy.history) == drafted_steps > 1
        if rule == "drafted":
            expected = [s.accepted_len[0] / s.drafted[0] for s in out.steps if s.drafted[0] > 0]
            assert list(policy.history) == pytest.approx(expected)
        else:  # accepted over the tree's predicted tokens, a sum of path probabilities, so at least accepted / drafted
            steps = [s for s in out.steps if s.drafted[0] > 0]
            assert all(h >= s.accepted_len[0] / s.drafted[0] - 1e-6 for s, h in zip(steps, policy.history, strict=True))
        lo, hi = policy.bounds()["d0"]
        assert lo <= policy.cur_d0 <= hi


def test_sampling_verification_runs(models):
    arch, target, drafts, refs = models
    engine = SpeculativeEngine(target, make_policy("dynatree"), make_rule("sampling"), ModelDraftSource(drafts["close"]), eos_token_ids=[])
    outs = engine.generate(PROMPTS[:2], 12, params=SamplingParams(temperature=1.0), seed=0)
    assert [len(o.token_ids) for o in outs] == [12, 12]


def sampled_draft(policy: DynaTreePolicy, dist: DistFn, seed: int):
    """One drafting step at temperature 1 (children drawn from the draft) on the fake source."""
    ctx = DraftContext(params=SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(seed), max_depth=50, active=torch.tensor([True]))
    drafted = policy.draft(TableSource(dist), torch.full((1,), 3, dtype=torch.long), ctx)
    return drafted.tree, drafted.builder.score.gather(1, drafted.builder_nodes)


def sibling_rank(tree, node: int) -> int:
    """1-based draw rank of a drawn node among its parent's kept children (they keep draw order)."""
    siblings = [c for c in range(1, tree.num_nodes) if tree.valid[0, c] and int(tree.parents[0, c]) == int(tree.parents[0, node])]
    return siblings.index(node) + 1


def test_drawn_children_are_valued_by_draw_rank_not_by_their_token():
    """Calibrated drawn children: p(u) = the parent's value x the calibrated rate of the draw rank
    given the parent's collision mass, never the drawn token's own probability (that would bias
    sampling). With the same distribution at every node, different seeds draw different tokens
    but build the same tree shape with the same values, each the sum of the drawn table's
    log-rates of the draw ranks along the path."""
    probs = {1: 0.5, 2: 0.3, 3: 0.2}  # collision mass 0.38: bin 3
    pol = DynaTreePolicy(phase=2, prune_tau=0.01, rho_stop=0.05)
    shapes, tokens = set(), set()
    for seed in range(6):
        tree, score = sampled_draft(pol, lambda row, path: probs, seed)
        valid = tree.valid[0]
        shapes.add((tuple(tree.parents[0][valid].tolist()), tuple(round(float(v), 5) for v in score[0][valid])))
        tokens.add(tuple(tree.tokens[0][valid].tolist()))
        table = pol._calibrators[True]._log_rate  # [ranks, bins]: the drawn children's table
        for i in range(1, tree.num_nodes):
            if valid[i]:
                expected = sum(float(table[min(sibling_rank(tree, j), 3) - 1, 3]) for j in tree.path_to(0, i)[1:])
                assert float(score[0, i]) == pytest.approx(expected, abs=1e-5)
    assert len(shapes) == 1  # the tree and its values do not depend on the tokens drawn ...
    assert len(tokens) > 1  # ... which differ between seeds
    assert pol._calibrators[False].observations == 0


def test_drawn_and_top_k_children_keep_separate_calibration_tables():
    """Greedy and sampled steps can alternate on one policy (a server's requests): each step's
    verdicts go to its own kind's table. Verdicts that accept every first draw raise the drawn
    table's rank-1 rate above its prior and the sampled trees grow deeper; the top-k table does
    not move. A greedy step then feeds the top-k table only."""
    probs = {1: 0.5, 2: 0.3, 3: 0.2}
    pol = DynaTreePolicy(phase=2)
    first, _ = sampled_draft(pol, lambda row, path: probs, 0)
    greedy_rates = pol._calibrators[False].rates().copy()
    column = pol._calibrators[True].bin_of(0.38)  # rank 1 at collision mass 0.38
    prior = float(pol._calibrators[True].rates()[0, column])
    for step in range(40):  # the target accepts the chain of first draws whole
        tree, _ = sampled_draft(pol, lambda row, path: probs, step)
        path, node = [], 0
        while children := [c for c in range(1, tree.num_nodes) if tree.valid[0, c] and int(tree.parents[0, c]) == node]:
            node = children[0]  # the first draw
            path.append(node)
        rec = record([tree.drafted_per_row().item()], [len(path)], step=step)
        rec.accepted_nodes = [path]
        pol.feedback(rec)
    assert pol._calibrators[True].rates()[0, column] > max(0.9, prior + 0.3)  # learned
    assert (pol._calibrators[False].rates() == greedy_rates).all() and pol._calibrators[False].observations == 0
    last, _ = sampled_draft(pol, lambda row, path: probs, 99)
    assert last.max_depth() >= first.max_depth() + 2
    tree, _ = draft(pol, confident_chain(0.6, side=0.35))  # greedy: top-k children
    rec = record([tree.drafted_per_row().item()], [0])
    rec.accepted_nodes = [[]]
    drawn_seen = pol._calibrators[True].observations
    pol.feedback(rec)
    assert pol._calibrators[False].observations > 0 and pol._calibrators[True].observations == drawn_seen
