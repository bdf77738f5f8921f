"""CAST: cost tables, Algorithm 1, breadth/depth pruning, reranking, Theorem 4.1, and greedy
equivalence of `--method cast` with the target's own greedy output."""

from __future__ import annotations

import json
import logging
import math
import random
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import EOS, close_pair, sharpen, tiny_model

from specdec.cli import main
from specdec.cost import CostTable, ProfileGrid, forget_measured, profile_models, select_context
from specdec.drafting.builder import DraftContext
from specdec.drafting.calibration import AcceptanceCalibrator, isotonic
from specdec.drafting.cast import (
    CastPolicy,
    DepthBuffers,
    PlainDecodingCheck,
    StepOverheads,
    StepPlan,
    _ModeTimes,
    batch_bucket,
    batch_utility,
    breadth_count,
    break_even_count,
    grow_decision,
    max_valid_index,
    rerank_count,
)
from specdec.drafting.policies import Eagle2Policy
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.hostwork import HostWorkCounter
from specdec.methods import make_policy
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.stats import StepRecord
from specdec.verification import GreedyRule, make_rule

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]]


def linear_table(t_fixed: float = 10.0, t_per_token: float = 0.05, d_fixed: float = 1.0, d_per_token: float = 0.01) -> CostTable:
    """f_T = t_fixed + t_per_token * B * n (ms), f_D likewise: overhead-dominated small forwards."""
    return CostTable.synthetic(lambda b, c, n: t_fixed + t_per_token * b * n + c / 1000, lambda b, c, n: d_fixed + d_per_token * b * n)


def reference(target, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def draft_once(policy, draft_model, prompts=PROMPTS, roots=(3, 4, 5), params: SamplingParams | None = None):
    """One drafting step of `policy` after prefilling `prompts` into a fresh draft source
    (greedy, or `params` with a seeded generator)."""
    source = ModelDraftSource(draft_model)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    source.prefill(ids, mask)
    generator = None if params is None else torch.Generator().manual_seed(0)
    ctx = DraftContext(params or SamplingParams(), generator, max_depth=30, active=torch.ones(len(prompts), dtype=torch.bool), context_len=mask.sum(dim=1))
    tree = policy.draft(source, torch.tensor(roots[: len(prompts)]), ctx).tree
    return tree


# ----- cost tables ----------------------------------------------------------------------------


def test_select_buckets_up_and_caps():
    # the paper prints max(...) where min(...) is meant
    assert [select_context(c, 256, 4) for c in (0, 1, 255, 256, 700, 1023, 1024, 5000)] == [256, 256, 256, 512, 768, 1024, 1024, 1024]
    table = linear_table()
    assert table.contexts == [256, 512, 768, 1024] and table.select(300) == 512


def test_interpolation_over_n_and_batch():
    table = CostTable.synthetic(lambda b, c, n: 10 * b + n + c / 256, lambda b, c, n: b * n, batch_sizes=(1, 2, 4), n_grid=(1, 2, 4, 8))
    # grid points are exact; n between grid points is linear; beyond the grid it is extrapolated
    assert table.target_cost(1, 100, 4) == pytest.approx(10 + 4 + 1)
    assert table.target_cost(1, 100, 3) == pytest.approx(10 + 3 + 1)
    assert table.target_cost(1, 100, 20) == pytest.approx(10 + 20 + 1)
    assert table.target_cost(2, 600, 6) == pytest.approx(20 + 6 + 3)
    assert table.target_cost(1, 100, 0) == 0.0
    # batch 3 lies between 2 and 4; batch 8 is extrapolated from 2 and 4; batch 0.. clamps to 1
    assert table.draft_cost(3, 10, 4) == pytest.approx(12)
    assert table.draft_cost(8, 10, 4) == pytest.approx(32)
    assert table.target_costs(1, 100, 5) == pytest.approx([0, 12, 13, 14, 15, 16])


def test_costs_made_monotone_in_n():
    table = CostTable.synthetic(
        lambda b, c, n: {1: 5.0, 2: 4.0, 4: 6.0, 8: 5.5}[n], lambda b, c, n: 1.0, batch_sizes=(1,), n_grid=(1, 2, 4, 8)
    )
    assert table.target_ms[1][0] == pytest.approx([4.5, 4.5, 5.75, 5.75])  # least-squares non-decreasing fit
    spike = CostTable.synthetic(
        lambda b, c, n: {1: 50.0, 2: 1.0, 4: 1.2, 8: 2.0}[n], lambda b, c, n: 1.0, batch_sizes=(1,), n_grid=(1, 2, 4, 8)
    )
    assert spike.target_ms[1][0][-1] < 50.0  # one slow outlier does not lift every later point


def test_table_roundtrip_and_malformed(tmp_path):
    table = linear_table()
    table.meta.update({"dtype": "float32", "device": {"type": "cpu", "name": "x"}})
    path = table.save(tmp_path / "p.json")
    back = CostTable.load(path)
    assert back.target_ms == table.target_ms and back.draft_ms == table.draft_ms and back.meta["dtype"] == "float32"
    assert back.n_grid == table.n_grid and (back.context_step, back.num_contexts) == (256, 4)
    with pytest.raises(SpecDecError, match="does not exist"):
        CostTable.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(SpecDecError, match="not a specdec cost profile"):
        CostTable.load(tmp_path / "bad.json")
    data = table.to_json()
    data["target_ms"]["1"] = [[1.0]]
    (tmp_path / "short.json").write_text(json.dumps(data))
    with pytest.raises(SpecDecError, match="re-run `specdec profile`"):
        CostTable.load(tmp_path / "short.json")
    for odd in ("12.5", True, None):  # a hand-edited latency that is not a number is named, not read as 12.5 or 1.0
        data = table.to_json()
        data["draft_ms"]["2"][1][0] = odd
        (tmp_path / "odd.json").write_text(json.dumps(data))
        with pytest.raises(SpecDecError, match=rf"draft entry for batch 2 holds {re.escape(repr(odd))}, not a number of milliseconds"):
            CostTable.load(tmp_path / "odd.json")


TINY_GRID = ProfileGrid(batch_sizes=(1, 2), context_step=16, num_contexts=2, n_grid=(1, 4), warmup=0, repeats=1, min_time_ms=0.0)


def test_profile_identity_and_mismatch():
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1, layers=1)
    table = profile_models(target, draft, TINY_GRID)
    assert table.batch_sizes == [1, 2] and len(table.target_ms[2]) == 2 and len(table.target_ms[2][0]) == 2
    assert table.meta["target"]["params"] == sum(p.numel() for p in target.parameters())
    assert table.meta["dtype"] == "float32" and table.meta["device"]["type"] == "cpu"
    assert table.mismatch(target, draft) is None
    assert table.mismatch(tiny_model("llama", seed=5), draft) is None  # other weights, same shape: same costs
    other = tiny_model("llama", seed=0, hidden=64)
    assert "target hidden size: profile 32, here 64" in table.mismatch(other, draft)
    assert "draft hidden size: profile 32, here 64" in table.mismatch(target, other)
    table.meta["dtype"] = "bfloat16"
    assert "dtype: profile 'bfloat16', here 'float32'" in table.mismatch(target, draft)
    table.meta["device"] = {"type": "cuda", "name": "H100"}
    assert "device type: profile 'cuda', here 'cpu'" in table.mismatch(target, draft)


def test_profile_cli_writes_valid_json(tiny_pair_dir, tmp_path, capsys):
    out = tmp_path / "prof" / "cost.json"
    argv = ["profile", "--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"), "--batch-sizes", "1,2"]
    argv += ["--context-step", "16", "--contexts", "2", "--n-grid", "1,4", "--warmup", "0", "--repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["format"] == "specdec-cost-profile" and data["batch_sizes"] == [1, 2] and data["contexts"] == [16, 32]
    assert len(data["target_ms"]["2"]) == 2 and len(data["draft_ms"]["1"][0]) == 2
    assert all(v > 0 for rows in data["target_ms"].values() for row in rows for v in row)
    for key in ("device", "dtype", "torch", "transformers", "target", "draft", "grid"):
        assert key in data
    assert {"config_hash", "params", "path"} <= set(data["target"])
    assert CostTable.load(out).batch_sizes == [1, 2]
    assert "cost profile:" in capsys.readouterr().out
    assert main([*argv[:-2], "--n-grid", "0,2", "--out", str(out)]) == 2  # not a token count (points in any order are sorted: test_cost_grid.py)
    assert main(["profile", "--target", str(tiny_pair_dir / "target"), "--out", str(out)]) == 2  # --draft needed with --target


# ----- Algorithm 1 and the pruning rules --------------------------------------------------------


def paper_algorithm1(u, c, threshold):
    """Algorithm 1 exactly as printed (strictly increasing c)."""
    mark = [1] * len(u)
    for i in range(len(u)):
        for j in range(i + 1, len(u)):
            if (u[j] - u[i]) / (c[j] - c[i]) < threshold:
                mark[j] = 0
    return max(j + 1 for j in range(len(u)) if mark[j])


def test_algorithm1_hand_built():
    assert max_valid_index([1, 1.5, 1.6], [1, 2, 3], 0.3) == 2
    assert max_valid_index([1, 1.5, 1.6], [1, 2, 3], 0.05) == 3
    assert max_valid_index([1, 1.5, 1.6], [1, 2, 3], 0.6) == 1
    # not concave: item 2 is not worth it alone, but items 2+3 together are (robust selection)
    assert max_valid_index([1, 1.1, 2.5], [1, 2, 3], 0.5) == 3
    # a gain at no extra cost is always taken
    assert max_valid_index([1, 2, 3], [1, 1, 1], 100.0) == 3
    # non-monotone costs take the pairwise path
    assert max_valid_index([1, 2, 2.1], [1, 3, 2], 0.2) == paper_algorithm1([1, 2, 2.1], [1, 3, 2], 0.2)


def test_algorithm1_fast_path_equals_paper():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 12)
        u = [0.0]
        c = [rng.random()]
        for _ in range(n - 1):
            u.append(u[-1] + rng.random() ** 3)
            c.append(c[-1] + rng.random() + 1e-3)
        u = u[1:] + [u[-1] + rng.random()]
        u = u[:n]
        threshold = rng.choice([0.0, 0.1, 0.5, 1.0, 3.0])
        assert max_valid_index(u, c, threshold, rtol=0.0) == paper_algorithm1(u, c, threshold)


def test_rerank_count_can_go_root_only():
    # u_k = cumulative confidence, c_k = f_T(k + 1) / f_T(1)
    assert rerank_count([0.1, 0.15], [1.0, 2.0, 3.0], 1.0) == 0  # 0.1 expected tokens for a doubled step: no
    assert rerank_count([0.9, 1.7, 1.8], [1.0, 1.1, 1.2, 1.3], 3.0) == 2  # the third adds 0.1 for 0.1 of cost: < 3
    assert rerank_count([0.9, 1.7, 1.8], [1.0, 1.0, 1.0, 1.0], 3.0) == 3  # flat costs: take everything
    assert breadth_count([0.5, 0.9, 1.0], [0.1, 0.2, 0.3], 2.0) == 2


def test_break_even_count_maximises_the_rate():
    # rates (1 + u_k) / (d + c_k) with d = 0.2: k=0 1/1.2, k=1 1.9/1.3, k=2 2.7/1.4, k=3 2.8/1.5 -> k = 2
    assert break_even_count([0.9, 1.7, 1.8], [1.0, 1.1, 1.2, 1.3], 0.2) == 2
    # verifying costs as much as a step per token: nothing pays
    assert break_even_count([0.5, 0.8], [1.0, 2.0, 3.0], 0.1) == 0
    # free verification: take everything that adds anything
    assert break_even_count([0.5, 0.8, 0.9], [1.0, 1.0, 1.0, 1.0], 0.3) == 3
    # the rule is Algorithm 1 with the current rate as threshold: C3 = the chosen rate reproduces it
    u, c, d = [0.9, 1.7, 1.8], [1.0, 1.1, 1.2, 1.3], 0.2
    k = break_even_count(u, c, d)
    assert k == 2 and (1 + u[2]) / (d + c[3]) < (1 + u[1]) / (d + c[2])
    with pytest.raises(ValueError):
        break_even_count([0.5], [1.0], 0.0)


def test_batch_utility_averages_by_rank():
    score = torch.log(torch.tensor([[0.5, 0.1, 0.3], [0.2, 0.6, 0.0], [0.9, 0.9, 0.9]]))
    u = batch_utility(score, torch.tensor([True, True, False]))
    assert u == pytest.approx([0.55, 0.55 + 0.25, 0.55 + 0.25 + 0.05])


def test_depth_buffers_fifo_and_decision():
    bufs = DepthBuffers(3)
    assert bufs.alpha(1) == 1.0 and bufs.values(2) == [1.0]
    bufs.push(1, 0.5)
    assert bufs.alpha(1) == pytest.approx(0.75)
    bufs.push(1, 0.2)
    bufs.push(1, 0.3)  # the initial 1 falls out
    assert bufs.values(1) == [0.5, 0.2, 0.3] and bufs.alpha(1) == pytest.approx(1 / 3)
    assert grow_decision(0.5, 1.0, 0.1, 5.0) and not grow_decision(0.5, 1.0, 0.1, 5.1)


@pytest.mark.parametrize("batch", [1, 4])
def test_theorem_4_1_linear_cost_gives_eagle_top_k(batch):
    """c_j = lambda * j + delta and C1 = sum_rows v(K) / (B * lambda): Algorithm 1 keeps exactly K."""
    gen = torch.Generator().manual_seed(batch)
    for k in (1, 3, 8, 12):
        for lam, delta in ((0.01, 0.0), (0.3, 2.0), (5.0, 0.7)):
            v = torch.rand(batch, 20, generator=gen, dtype=torch.float64).sort(dim=1, descending=True).values  # [B, N] per-row sorted
            u = batch_utility(v.log(), torch.ones(batch, dtype=torch.bool))
            costs = [lam * j + delta for j in range(1, 21)]
            c1 = float(v[:, k - 1].sum()) / (batch * lam)
            assert breadth_count(u, costs, c1) == k


# ----- the policy -------------------------------------------------------------------------------


def test_switched_off_cast_is_eagle2():
    target, draft = close_pair("llama")
    eagle = Eagle2Policy(depth=4, top_k=3, total_tokens=10)
    ref = draft_once(eagle, draft)
    off = CastPolicy(
        depth=4, top_k=3, total_tokens=10, breadth_pruning=False, depth_pruning=False, dynamic_rerank=False, calibrate=False,
        cost_table=linear_table(),
    )
    zero = CastPolicy(
        depth=4, top_k=3, total_tokens=10, c1=0.0, c2=0.0, c3=0.0, rerank_rule="threshold", prune_rule="threshold", calibrate=False,
        cost_table=linear_table(),
    )
    for policy in (off, zero):
        tree = draft_once(policy, draft)
        assert torch.equal(tree.valid, ref.valid)
        assert torch.equal(tree.tokens[tree.valid], ref.tokens[ref.valid])
        assert torch.equal(tree.parents, ref.parents)


def test_expensive_draft_stops_growth_and_buffers_update():
    _, draft = close_pair("llama")
    cheap = CastPolicy(depth=5, top_k=3, total_tokens=60, dynamic_rerank=False, c1=0.0, c2=1e-9, prune_rule="threshold", cost_table=linear_table())
    tree = draft_once(cheap, draft)
    assert tree.max_depth() == 5 and cheap.last_widths == [3, 3, 3, 3, 3]
    assert all(len(cheap.buffers.values(i)) == 2 for i in range(1, 5))  # {1} + this step's phi_i
    costly = CastPolicy(depth=5, top_k=3, total_tokens=60, dynamic_rerank=False, prune_rule="threshold", cost_table=linear_table(d_fixed=1e4))
    tree = draft_once(costly, draft)
    assert tree.max_depth() == 1 and len(costly.last_widths) == 1
    no_dp = CastPolicy(depth=5, top_k=3, total_tokens=60, dynamic_rerank=False, depth_pruning=False, cost_table=linear_table(d_fixed=1e4))
    assert draft_once(no_dp, draft).max_depth() == 5


def test_breadth_pruning_narrows_costly_layers():
    _, draft = close_pair("llama")
    steep = CostTable.synthetic(lambda b, c, n: 10.0, lambda b, c, n: 1.0 + 50.0 * n)  # every extra draft node costs 5 target steps
    policy = CastPolicy(depth=3, top_k=4, total_tokens=60, c1=1.0, prune_rule="threshold", depth_pruning=False, dynamic_rerank=False, cost_table=steep)
    draft_once(policy, draft)
    assert policy.last_widths == [1, 1, 1]


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_greedy_cast_matches_generate_batch_1_and_3(arch):
    target, draft = close_pair(arch)
    refs = [reference(target, p, 20) for p in PROMPTS]
    accepted, deepest = 0, 0
    variants = (
        {},  # break-even rules, calibrated values
        {"c1": 0.5, "c2": 0.5, "c3": 0.5, "prune_rule": "threshold", "rerank_rule": "threshold", "depth": 5, "top_k": 4, "total_tokens": 16},
        {"c1": 0.1, "c2": 0.0, "prune_rule": "threshold", "dynamic_rerank": False, "depth": 4, "top_k": 3, "total_tokens": 12},  # deep trees
        {"calibrate": False, "depth": 5, "top_k": 4, "total_tokens": 16},
        {"prune_rule": "threshold", "rerank_rule": "threshold", "calibrate": False},  # the paper's rules and presets
        {"reads_while_drafting": False},  # the plan's layers and predicted count, values read after the verification's launch
        {"reads_while_drafting": False, "calibrate": False, "depth": 5, "top_k": 4, "total_tokens": 16},
    )
    for options in variants:
        policy = make_policy("cast", cost_table=linear_table(), **options)
        engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
        for prompt, ref in zip(PROMPTS, refs, strict=True):
            out = engine.generate([prompt], 20, keep_steps=True)[0]
            assert out.token_ids == ref, (arch, options, prompt)
            accepted += out.stats.accepted_tokens
            deepest = max([deepest] + [r.tree_depth for r in out.steps])
        batched = engine.generate(PROMPTS, 20)
        assert [o.token_ids for o in batched] == refs, (arch, options)
    assert accepted > 0 and deepest >= 2


def test_next_plan_is_made_while_verifying_and_equals_the_deferred_one():
    """Break-even CAST makes the next step's plan in `plan_ahead`, which the engine calls after the
    verification forward is launched and before the verdict is read (so a GPU verifies while the
    host plans). Called or not (the next draft then makes it), the plans and so the trees are the
    same; greedy output stays the target's."""
    target, draft = close_pair("llama")
    prompts = [PROMPTS[0], PROMPTS[2]]
    refs = [reference(target, p, 24) for p in prompts]

    def run(engine_calls_plan_ahead: bool) -> tuple[list[list[int]], list[str]]:
        cheap_layers = linear_table(d_fixed=0.2, d_per_token=0.001, t_per_token=0.005)  # deeper plans
        policy = make_policy("cast", cost_table=cheap_layers, deterministic=True, calibrate=True, depth=6, top_k=4, total_tokens=24)
        events: list[str] = []
        widths: list[list[int]] = []
        feedback, draft_step, settle = policy.feedback, policy.draft, policy._settle_plan

        def traced_draft(*args, **kwargs):
            events.append("draft")
            return draft_step(*args, **kwargs)

        def traced_plan_ahead() -> None:
            events.append("plan_ahead:" + ("pending" if policy._pending_plan is not None else "none"))
            if engine_calls_plan_ahead:
                settle()

        def traced_feedback(record):
            events.append("feedback")
            widths.append(list(policy.last_widths))
            feedback(record)

        policy.draft, policy.plan_ahead, policy.feedback = traced_draft, traced_plan_ahead, traced_feedback
        engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
        for prompt, ref in zip(prompts, refs, strict=True):
            assert engine.generate([prompt], 24)[0].token_ids == ref
        return widths, events

    widths, events = run(True)
    assert events[:3] == ["draft", "plan_ahead:pending", "feedback"]  # between the tree and the verdict's feedback
    assert sum(e.startswith("plan_ahead") for e in events) == events.count("draft")  # once a step
    assert events.count("plan_ahead:pending") > events.count("draft") / 2  # (a last token's step drafts nothing to plan from)
    assert any(len(w) > 2 for w in widths)  # plans of several layers were made and followed
    deferred, deferred_events = run(False)
    assert deferred == widths  # the same plans, made at the next draft instead
    assert len(deferred_events) == len(events)


@pytest.mark.parametrize("reads_while_drafting", [False, True])
def test_cast_drafts_its_plan_without_reads(reads_while_drafting):
    """With `reads_while_drafting=False` (the CUDA default) a step that has a plan drafts its
    layers and keeps the plan's predicted count without one host read (each a GPU stall); its
    values reach the host after the verification is launched (`plan_ahead`), in time for the
    plain check's expected tokens and the next plan. Greedy output stays the target's. With
    reads (the CPU default) the same steps read while drafting, which is what makes this
    test's zero meaningful."""
    target, draft = close_pair("llama")
    prompts = [PROMPTS[0], PROMPTS[2]]
    refs = [reference(target, p, 24) for p in prompts]
    cheap_layers = linear_table(d_fixed=0.2, d_per_token=0.001, t_per_token=0.005)  # deep plans
    policy = make_policy("cast", cost_table=cheap_layers, deterministic=True, depth=6, top_k=4, total_tokens=24, reads_while_drafting=reads_while_drafting)
    draft_step, feedback = policy.draft, policy.feedback
    planned: list[tuple[int, int, int, int]] = []  # per step with a plan: reads while drafting, planned count, kept count, tree columns
    expected: list[float | None] = []

    def counted_draft(source, roots, ctx):
        plan = policy._plan_verified
        before = counter.host_reads
        drafted = draft_step(source, roots, ctx)
        if plan is not None and ctx.max_depth > 1:
            planned.append((counter.host_reads - before, plan, policy.last_verified, drafted.tree.tokens.shape[1]))
        return drafted

    def traced_feedback(record):
        feedback(record)
        expected.append(policy._expected_tokens)

    policy.draft, policy.feedback = counted_draft, traced_feedback
    engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
    with HostWorkCounter() as counter:
        outs = [engine.generate([p], 24)[0].token_ids for p in prompts]
    assert outs == refs
    assert len(planned) > 10
    reads = [r for r, *_ in planned]
    if reads_while_drafting:
        assert min(reads) >= 1
        return
    assert reads == [0] * len(planned)
    assert all(kept == min(plan, 24) for _, plan, kept, _ in planned)  # the plan's count, decided before drafting
    assert any(kept > 4 for _, _, kept, _ in planned)  # (deep trees: more than the root's children)
    assert all(cols <= 1 + kept for _, _, kept, cols in planned)
    assert sum(e is not None for e in expected) >= len(planned)  # the values were read before each feedback


def test_tree_that_cannot_pay_is_root_only():
    target, draft = close_pair("llama")
    table = CostTable.synthetic(lambda b, c, n: 10.0 * n, lambda b, c, n: 50.0 * n)  # verifying k tokens costs k steps
    policy = make_policy("cast", cost_table=table, rerank_rule="threshold", prune_rule="threshold")
    engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
    outs = engine.generate(PROMPTS, 16, keep_steps=True)
    assert [o.token_ids for o in outs] == [reference(target, p, 16) for p in PROMPTS]
    assert all(d == 0 for rec in outs[0].steps for d in rec.drafted)
    # break-even counts the root's draft forward as spent: it verifies a layer-1 token when that
    # beats root-only for the step, and stops drafting deeper (depth pruning)
    policy = make_policy("cast", cost_table=table)
    engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
    outs = engine.generate(PROMPTS, 16, keep_steps=True)
    assert [o.token_ids for o in outs] == [reference(target, p, 16) for p in PROMPTS]
    assert all(rec.tree_depth <= 1 for rec in outs[0].steps)


def test_missing_profile_is_measured_when_bound(tmp_path, caplog):
    forget_measured()  # measurements of these shapes by earlier tests would be reused
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1, layers=1)
    path = tmp_path / "cost.json"
    policy = make_policy("cast", cost_profile=str(path), depth=3, top_k=3, total_tokens=8)
    with caplog.at_level(logging.WARNING, logger="specdec.cost"):
        policy.bind_models(target, draft)  # resolves batch 1 now: the file is missing, so it is measured
        engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
        assert engine.generate([PROMPTS[0]], 4)[0].token_ids == reference(target, PROMPTS[0], 4)
    assert "does not exist" in caplog.text and "measuring a quick cost profile" in caplog.text
    saved = CostTable.load(path)
    assert saved.batch_sizes == [1] and saved.meta["grid"]["quick"] and saved.mismatch(target, draft) is None
    # a larger batch extends the quick profile before decoding (a lookup never measures); a second
    # policy reuses the file without measuring batch 1 again
    again = make_policy("cast", cost_profile=str(path), depth=3, top_k=3, total_tokens=8)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec.cost"):
        again.bind_models(target, draft)
        assert again.table_for(1).batch_sizes == [1] and caplog.text == ""
        assert again.table_for(2).batch_sizes == [1]  # interpolated, not measured
        again.prepare_costs(2)
        assert again.table_for(2).batch_sizes == [1, 2]
    assert CostTable.load(path).batch_sizes == [1, 2]
    # a profile of other models is not used (and not overwritten)
    other = tiny_model("llama", seed=0, hidden=64)
    third = make_policy("cast", cost_profile=str(path))
    third.bind_models(other, draft)
    with caplog.at_level(logging.WARNING, logger="specdec.cost"):
        assert third.table_for(1).mismatch(other, draft) is None
    assert "does not fit these models" in caplog.text
    assert CostTable.load(path).mismatch(target, draft) is None


def test_option_errors():
    for bad in ({"c1": -1.0, "prune_rule": "threshold"}, {"depth": 0}, {"buffer": 0}, {"breadth_pruning": "no"}, {"top_k": 1.5}, {"calibrate": "yes"}):
        with pytest.raises(SpecDecError):
            make_policy("cast", **bad)
    with pytest.raises(SpecDecError, match="either cost_table or cost_profile"):
        make_policy("cast", cost_table=linear_table(), cost_profile="x.json")
    _, draft = close_pair("llama")
    with pytest.raises(SpecDecError, match="needs forward-cost tables"):
        draft_once(make_policy("cast"), draft)
    policy = make_policy("cast")
    assert policy.depth_for(1) == 13 and policy.depth_for(8) == 9 and policy.depth_for(32) == 9
    assert policy.thresholds_for(1) == (3.0, 3.0, 3.0) and policy.thresholds_for(16) == (2.5, 2.5, 2.5)


def test_cli_cast_options(capsys):
    from specdec.cli import build_parser, collect_method_options

    args = build_parser().parse_args(
        [
            "generate",
            "--method",
            "cast",
            "--cast-c1",
            "1.5",
            "--cast-c3",
            "2",
            "--depth-pruning",
            "off",
            "--cost-profile",
            "p.json",
            "--depth",
            "7",
        ]
    )
    assert collect_method_options(args, "cast") == {"c1": 1.5, "c3": 2.0, "depth_pruning": False, "cost_profile": "p.json", "depth": 7}
    ours = build_parser().parse_args(["generate", "--method", "cast", "--prune-rule", "threshold", "--calibrate", "off", "--cast-lookahead", "2"])
    assert collect_method_options(ours, "cast") == {"prune_rule": "threshold", "calibrate": False, "lookahead": 2}
    make_policy("cast", cost_table=linear_table(), **collect_method_options(ours, "cast"))
    with pytest.raises(SpecDecError, match="--cast-c1 does not apply to --method eagle2"):
        collect_method_options(build_parser().parse_args(["generate", "--method", "eagle2", "--cast-c1", "1"]), "eagle2")
    with pytest.raises(SystemExit) as err:
        build_parser().parse_args(["generate", "--breadth-pruning", "maybe"])
    assert err.value.code == 2
    capsys.readouterr()


def test_decoder_binds_models_for_cast(tiny_pair_dir, tmp_path):
    from specdec.api import SpeculativeDecoder

    path = tmp_path / "pair_cost.json"
    decoder = SpeculativeDecoder.from_pretrained(
        str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), method="cast", cost_profile=str(path), depth=3, top_k=3, total_tokens=8
    )
    result = decoder.generate("def add(a, b):", max_new_tokens=6)
    ar = SpeculativeDecoder(decoder.target, decoder.tokenizer, None, method="ar").generate("def add(a, b):", max_new_tokens=6)
    assert result.token_ids == ar.token_ids
    assert path.is_file()
    # every CAST engine built over the decoder (a server lane per sampling setting) shares its
    # cost tables instead of re-measuring them
    lanes = [decoder.make_engine("cast"), decoder.make_engine("cast", verify="sampling")]
    assert all(engine.policy._resolver is decoder.policy._resolver for engine in lanes)
    with pytest.raises(ValueError, match="other models"):
        make_policy("cast").bind_models(decoder.target, decoder.draft, resolver=decoder.policy._resolver)  # another cost_profile


def test_sampling_runs_with_cast_trees():
    """CAST's children are deterministic top-k picks, which lossless sampling verifies as point masses."""
    from specdec.verification import SamplingRule

    target, draft = close_pair("llama")
    policy = make_policy(
        "cast", cost_table=linear_table(), c1=0.1, c2=0.0, c3=0.1, prune_rule="threshold", rerank_rule="threshold", depth=4, top_k=3, total_tokens=12
    )
    engine = SpeculativeEngine(target, policy, SamplingRule(), ModelDraftSource(draft), eos_token_ids=[])
    outs = engine.generate(PROMPTS, 12, SamplingParams(temperature=1.0), seed=0)
    assert [len(o.token_ids) for o in outs] == [12, 12, 12]


def test_rerank_rule_is_checked():
    with pytest.raises(SpecDecError, match="rerank_rule='best'"):
        make_policy("cast", cost_table=linear_table(), rerank_rule="best")


# ----- our additions: calibrated values, learned overheads, break-even pruning -------------------


def step_record(paths: list[list[int]], active: list[bool], draft_s: float = 0.0, verify_s: float = 0.0) -> StepRecord:
    n = len(paths)
    return StepRecord(
        step=0, active=active, drafted=[0] * n, accepted_len=[len(p) for p in paths], committed=[len(p) + 1 for p in paths],
        relaxed=[0] * n, strict_fallbacks=[0] * n, tree_depth=0, draft_s=draft_s, verify_s=verify_s,
        drafted_by_depth=[[] for _ in range(n)], accepted_depth=[len(p) for p in paths], accepted_nodes=paths,
    )


def test_calibrator_starts_at_identity_then_learns_per_rank():
    cal = AcceptanceCalibrator(ranks=3)
    q = torch.tensor([0.35, 0.05, 0.95])
    centres = torch.tensor([cal.centers[cal.bin_of(float(v))] for v in q], dtype=torch.float32)
    assert centres.tolist() == pytest.approx([0.35, (0.03 * 0.1) ** 0.5, 0.95])  # log-spaced below 0.1: the geometric centre
    # before evidence the identity, exactly: a token's own q, not its bin's centre (the rate's line in log q)
    assert torch.allclose(cal.local_logprob(q.log(), torch.tensor([1, 2, 3])).exp(), q, atol=1e-6)
    assert cal.local_logprob(torch.tensor([float("-inf")]), torch.tensor([1])).item() == float("-inf")
    # greedy verification: the draft's favourite is accepted 90% of the time even at q = 0.25
    rng = random.Random(0)
    for _ in range(100):
        hits = torch.tensor([rng.random() < 0.9 for _ in range(4)])
        cal.observe(torch.full((4,), 0.25).log(), torch.ones(4, dtype=torch.long), hits)
    rate = cal.local_logprob(torch.tensor([0.25]).log(), torch.tensor([1])).exp().item()
    assert abs(rate - 0.9) < 0.06
    # a sparse bin of the same rank borrows the rank's evidence (its power law q^γ, γ ~ 0.08) instead of staying at q ...
    assert cal.rank_exponents()[0] < 0.2 and cal.local_logprob(torch.tensor([0.05]).log(), torch.tensor([1])).exp().item() > 0.7
    # ... and keeps its own q: a q = 0.002 token is valued far below a q = 0.05 one
    assert cal.local_logprob(torch.tensor([0.002]).log(), torch.tensor([1])).exp().item() < 0.65
    # ranks without evidence keep the identity; every rank stays monotone in q
    assert abs(cal.local_logprob(torch.tensor([0.35]).log(), torch.tensor([3])).exp().item() - 0.35) < 1e-5
    rates = cal.rates()
    assert (rates[:, 1:] >= rates[:, :-1] - 1e-12).all()
    assert abs(cal.child_rate() - 0.9) < 0.06


def bernoulli_verdicts(cal: AcceptanceCalibrator, rate, steps: int, seed: int = 0, n: int = 64) -> None:
    """`steps` updates of `n` rank-1 tokens, q uniform in (0.02, 0.99), each accepted with
    probability rate(q)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        q = 0.02 + 0.97 * torch.rand(n, generator=gen, dtype=torch.float64)
        hits = torch.rand(n, generator=gen, dtype=torch.float64) < rate(q)
        cal.observe(q.log().float(), torch.ones(n, dtype=torch.long), hits)


def test_calibrator_pools_a_calibrated_draft_with_its_law():
    """A draft whose q is its acceptance rate: its bins scatter about the law by their binomial
    noise only, so they are pooled with it (many pseudo-observations) and the table is within 0.03 of q
    everywhere, where bins left at `prior` pseudo-observations stray further from the law."""
    cal = AcceptanceCalibrator.top_k(3)
    bernoulli_verdicts(cal, lambda q: q, steps=6)  # ~380 verdicts over 11 bins
    gamma = cal.rank_exponents()
    prior_mean = np.exp(cal.mean_logq() * gamma[:, None])
    assert cal.prior_strength(prior_mean)[0].min() > 5 * cal.prior
    q = torch.tensor([0.04, 0.15, 0.45, 0.75, 0.97])
    pooled = cal.local_logprob(q.log(), torch.ones(5, dtype=torch.long)).exp()
    assert torch.allclose(pooled, q, atol=0.03), pooled
    loose = (cal.hits[0] + cal.prior * prior_mean[0]) / (cal.seen[0] + cal.prior)  # the bins at `prior` only
    assert np.abs(cal.rates()[0] - prior_mean[0]).max() < np.abs(loose - prior_mean[0]).max()


def test_calibrator_keeps_a_bin_that_contradicts_the_law():
    """A draft calibrated except that its tokens with q < 0.2 are never accepted: those bins'
    evidence beats the law (which the other bins fit), so q = 0.15 is valued near 0, not near q
    (bins at the bottom: the table stays monotone without pooling them with their neighbours)."""
    cal = AcceptanceCalibrator.top_k(3)
    bernoulli_verdicts(cal, lambda q: torch.where(q < 0.2, 0.0, q), steps=10)
    inside = cal.local_logprob(torch.tensor([0.15]).log(), torch.tensor([1])).exp().item()
    outside = cal.local_logprob(torch.tensor([0.75]).log(), torch.tensor([1])).exp().item()
    assert inside < 0.05 and outside == pytest.approx(0.75, rel=0.1)


def test_calibrator_values_tokens_of_one_bin_by_their_own_q():
    """Two favourites in the top bin (q 0.91 and 0.99) of a calibrated draft: valued apart, about
    their own q (the bin's line in log q), and the bin's mean q is what the draft proposed there."""
    cal = AcceptanceCalibrator.top_k(3)
    bernoulli_verdicts(cal, lambda q: q, steps=10)
    low, high = cal.local_logprob(torch.tensor([0.91, 0.99]).log(), torch.ones(2, dtype=torch.long)).exp().tolist()
    assert high - low > 0.05 and high == pytest.approx(0.99, abs=0.04)
    assert np.exp(cal.mean_logq()[0, cal.bin_of(0.95)]) == pytest.approx(0.945, abs=0.01)  # uniform q in [0.9, 0.99)
    # CAST's per-level lookup gives the same values as local_logprob
    _, child = cal.child_rates(torch.tensor([[0.91, 0.5]]).log(), 2)
    assert child[0, 0].exp().item() == pytest.approx(low, rel=1e-5)


def test_cast_top_k_table_has_a_row_per_proposed_rank():
    """CAST proposes top_k children a node; its top-k table keeps one row per rank, so verdicts on
    3rd children do not set the value of 12th children of the same q (they shared a row before),
    and an unobserved rank keeps the identity at its own q. Drawn children keep the pooled table."""
    pol = CastPolicy(top_k=12)
    cal = pol._calibrators[False]
    assert cal.ranks == 12 and pol._calibrators[True].ranks == 3
    q = torch.full((40,), 0.05).log()
    for _ in range(20):  # rank-3 children at q = 0.05 are accepted half the time
        cal.observe(q, torch.full((40,), 3), torch.arange(40) % 2 == 0)
    rank3, rank12 = (cal.local_logprob(q[:1], torch.tensor([r])).exp().item() for r in (3, 12))
    assert rank3 > 0.4 and rank12 == pytest.approx(0.05, abs=1e-4)  # the identity at its own q


def test_calibrator_forgets_old_verdicts():
    cal = AcceptanceCalibrator(decay=0.998)
    q, rank = torch.full((50,), 0.6).log(), torch.ones(50, dtype=torch.long)
    for _ in range(10):
        cal.observe(q, rank, torch.ones(50, dtype=torch.bool))
    assert cal.child_rate() > 0.95
    for _ in range(32):  # updates 11..42: the table is refitted at update 42 (calibration.REFIT_EVERY)
        cal.observe(q, rank, torch.zeros(50, dtype=torch.bool))
    assert cal.child_rate() < 0.1 and cal.local_logprob(q[:1], rank[:1]).exp().item() < 0.1


def test_isotonic_pools_violators():
    import numpy as np

    fit = isotonic(np.array([0.1, 0.5, 0.3, 0.9]), np.array([1.0, 1.0, 1.0, 1.0]))
    assert np.allclose(fit, [0.1, 0.4, 0.4, 0.9])


def test_step_overheads_learn_the_gap_to_the_tables():
    over = StepOverheads(weight=0.5)
    over.observe(10.0, 10.0)  # no prediction yet: ignored
    assert over.draft_step_ms == over.verify_ms == 0.0
    # the engine spends 1 ms per step, 0.5 ms per drafted layer, 0.05 ms per expanded node and
    # 0.8 + 0.1 ms per verified node beyond the tables' forwards
    rng = random.Random(0)
    for _ in range(200):
        layers, width, tree_nodes = rng.randint(0, 5), rng.randint(1, 12), rng.randint(1, 40)
        nodes = layers * width
        over.expect(2.0 + layers, layers, nodes, 6.0, tree_nodes)
        over.observe(2.0 + layers + 1.0 + 0.5 * layers + 0.05 * nodes, 6.0 + 0.8 + 0.1 * tree_nodes)
        over.observe(99.0, 99.0)  # each prediction is used once
    assert over.draft_step_ms == pytest.approx(1.0, abs=0.06) and over.draft_ms == pytest.approx(0.5, abs=0.06)
    assert over.draft_node_ms == pytest.approx(0.05, abs=0.01)
    assert over.verify_ms == pytest.approx(0.8, abs=0.05) and over.verify_node_ms == pytest.approx(0.1, abs=0.01)
    # one stalled step moves the fit by a bounded amount
    over.expect(3.0, 1, 6, 6.0, 10)
    over.observe(500.0, 500.0)
    assert over.draft_step_ms < 20.0 and over.verify_ms < 20.0  # unclipped, the 494 ms residuals would move them by ~100 ms


def test_step_plan_counts_the_path_a_layer_starts():
    plan = StepPlan(utility=0.9, verified=1, drafted=2.0, verify_cost=[6.0, 6.5, 7.0, 7.5, 8.0, 8.5])
    assert plan.rate == pytest.approx(1.9 / 8.5)
    # one more layer alone: (1.9 + 0.6) / (2 + 3 + 7.0) < 1.9 / 8.5
    assert not plan.gains([0.6], 3.0)
    # ... but with the next layer on the best path: (1.9 + 0.6 + 0.55) / (2 + 3 + 1 + 7.5) > 1.9 / 8.5
    assert plan.gains([0.6], 3.0, [0.55, 0.5, 0.45], 1.0)
    assert not plan.gains([0.05], 3.0, [0.04, 0.03], 1.0)
    # several nodes of the next layer can pay where the best one alone does not
    assert not plan.gains([0.2], 1.0) and plan.gains([0.2, 0.55], 1.0)


def test_feedback_observes_children_of_reached_nodes():
    _, draft = close_pair("llama")
    policy = CastPolicy(depth=3, top_k=3, total_tokens=12, dynamic_rerank=False, prune_rule="threshold", c1=0.0, c2=0.0, cost_table=linear_table())
    tree = draft_once(policy, draft)
    first = tree.children(0, 0)[0]
    record = step_record([[first], [], [tree.children(2, 0)[0]]], active=[True, True, False])
    expected = len(tree.children(0, 0)) + len(tree.children(0, first)) + len(tree.children(1, 0))  # row 2 is inactive
    policy.feedback(record)
    cal = policy.state()["calibration"]
    assert cal["observations"] == expected
    assert policy._calibrator.hits.sum() == pytest.approx(1.0)  # the one accepted node
    policy.feedback(record)  # a verdict pairs with its own tree only once
    assert policy.state()["calibration"]["observations"] == expected


def test_drawn_and_top_k_children_feed_separate_calibration_tables():
    """A sampled step's verdicts (drawn children, valued from the parent's collision mass) go to
    the drawn children's table, a greedy step's to the top-k table: one policy serving greedy and
    sampled requests does not mix what the two kinds of values mean."""
    _, draft = close_pair("llama")
    policy = CastPolicy(depth=3, top_k=3, total_tokens=12, dynamic_rerank=False, prune_rule="threshold", c1=0.0, c2=0.0, cost_table=linear_table())
    tree = draft_once(policy, draft, params=SamplingParams(temperature=1.0))
    policy.feedback(step_record([[tree.children(0, 0)[0]], [], []], active=[True] * 3))
    drawn, top_k = policy._calibrators[True].observations, policy._calibrators[False].observations
    assert drawn == len(tree.children(0, 0)) + len(tree.children(0, tree.children(0, 0)[0])) + len(tree.children(1, 0)) + len(tree.children(2, 0))
    assert top_k == 0
    tree = draft_once(policy, draft)
    policy.feedback(step_record([[], [], []], active=[True] * 3))
    assert policy._calibrators[True].observations == drawn
    assert policy._calibrators[False].observations == sum(len(tree.children(r, 0)) for r in range(3))


def test_break_even_pruning_refreshes_a_stale_depth_buffer():
    """Uncalibrated break-even pruning predicts a layer from the paper's buffers A_i; a buffer only
    learns when its next layer is drafted, so a layer skipped `buffer` steps in a row is drafted
    once to refresh it (the paper's rule would stay stuck). Decisions are planned at the end of
    a step for the next one, so the refresh lands one step after the skip count is reached."""
    _, draft = close_pair("llama")
    policy = CastPolicy(depth=4, top_k=3, total_tokens=10, buffer=3, calibrate=False, cost_table=linear_table())
    for _ in range(3):
        policy.buffers.push(1, 0.0)  # alpha_1 = 0: layer 2 is never predicted to pay
    widths = []
    for _ in range(6):
        draft_once(policy, draft)
        widths.append(len(policy.last_widths))
    # the 4th step's plan (made from its own numbers, for the next step) drafts layer 2 again
    assert widths[:4] == [1, 1, 1, 1] and widths[4] >= 2
    assert policy.buffers.values(1)[-1] > 0  # the refresh observed a real ratio


def test_threshold_options_need_the_threshold_rules(capsys):
    for name in ("c1", "c2"):
        with pytest.raises(SpecDecError, match=f"{name}=1.0 is a threshold.*prune_rule='threshold'"):
            make_policy("cast", cost_table=linear_table(), **{name: 1.0})
    with pytest.raises(SpecDecError, match="c3=1.0 is a threshold.*rerank_rule='threshold'"):
        make_policy("cast", cost_table=linear_table(), c3=1.0)
    with pytest.raises(SpecDecError, match="lookahead=-1"):
        make_policy("cast", cost_table=linear_table(), lookahead=-1)
    with pytest.raises(SpecDecError, match="prune_rule='max'"):
        make_policy("cast", cost_table=linear_table(), prune_rule="max")
    assert main(["generate", "--method", "cast", "--cast-c1", "2", "--prompt", "x", "--max-new-tokens", "1"]) != 0
    assert "--prune-rule threshold" in capsys.readouterr().err


def test_break_even_breadth_counts_the_verification_of_the_children():
    """Break-even breadth pruning expands j nodes when their children's predicted utility beats
    the step's rate over drafting them and verifying j more nodes: with verification that costs
    nothing per token every candidate is expanded; when each verified token costs a plain step,
    no second node pays (drafting is nearly free in both tables)."""
    _, draft = close_pair("llama")
    flat = CostTable.synthetic(lambda b, c, n: 10.0, lambda b, c, n: 1.0 + 1e-4 * n)
    steep = CostTable.synthetic(lambda b, c, n: 10.0 * n, lambda b, c, n: 1.0 + 1e-4 * n)
    widths = {}
    for name, table in (("flat", flat), ("steep", steep)):
        policy = CastPolicy(depth=2, top_k=4, total_tokens=60, calibrate=False, depth_pruning=False, dynamic_rerank=False, cost_table=table)
        draft_once(policy, draft)
        widths[name] = policy.last_widths
    assert widths["flat"][0] == 4 and widths["steep"][0] == 1


def test_step_time_outside_drafting_and_verification_is_learned():
    over = StepOverheads(weight=0.2)
    for _ in range(100):
        over.observe_other(0.8)
    assert over.other_ms == pytest.approx(0.8, abs=1e-3)
    over.observe_other(500.0)  # a prompt admitted mid-batch: clipped to 2 * mean + 2 ms
    assert over.other_ms < 0.8 + 0.2 * (2 * 0.8 + 2.0) + 1e-9
    over.observe_other(-3.0)  # clock noise: clipped at 0
    assert over.other_ms >= 0.0
    # the policy feeds it the record's step time minus drafting and verification (plus its own feedback)
    _, draft = close_pair("llama")
    policy = CastPolicy(depth=2, top_k=3, total_tokens=8, cost_table=linear_table())
    draft_once(policy, draft)
    record = step_record([[], [], []], active=[True, True, True], draft_s=0.002, verify_s=0.006)
    record.step_s = 0.0105
    policy.feedback(record)
    assert policy.overheads.other_ms == pytest.approx(0.1 * 2.0)  # 2.5 ms, clipped to 2 ms at the first step
    assert policy.state()["overheads_ms"]["step_other"] == policy.overheads.other_ms


def test_trimmed_utilities_drop_missing_candidates():
    from specdec.drafting.cast import _trim_flat

    assert _trim_flat([0.5, 0.8, 0.8, 0.8]) == [0.5, 0.8]
    assert _trim_flat([0.0]) == [0.0] and _trim_flat([0.3, 0.3]) == [0.3]
    score = torch.tensor([[0.0, -1.0, float("-inf")], [-0.5, float("-inf"), float("-inf")]])
    assert _trim_flat(batch_utility(score, torch.tensor([True, True]))) == pytest.approx([(1 + math.exp(-0.5)) / 2, (1 + math.exp(-0.5) + math.exp(-1)) / 2])


def test_shared_isotonic_matches_brute_force():
    """The one pool-adjacent-violators (specdec.isotonic, used by the calibrator and the cost
    tables) against the known example and a brute-force least-squares search over a grid."""
    import itertools
    import random

    from specdec.isotonic import isotonic as pava

    assert pava([5, 4, 6, 5.5]) == [4.5, 4.5, 5.75, 5.75]
    assert pava([]) == [] and pava([3.0]) == [3.0]
    assert pava([2.0, 1.0], [0.0, 0.0]) == [1.5, 1.5]  # zero weight: the plain mean
    rng = random.Random(0)
    grid = [i / 4 for i in range(9)]  # candidate levels 0, 0.25, ..., 2
    for _ in range(30):
        values = [rng.choice(grid) for _ in range(4)]
        weights = [rng.choice([0.5, 1.0, 2.0]) for _ in range(4)]
        fit = pava(values, weights)
        assert all(a <= b + 1e-12 for a, b in itertools.pairwise(fit))
        loss = sum(w * (f - v) ** 2 for f, v, w in zip(fit, values, weights, strict=True))
        best = min(
            sum(w * (f - v) ** 2 for f, v, w in zip(cand, values, weights, strict=True))
            for cand in itertools.combinations_with_replacement(grid, 4)  # every non-decreasing grid sequence
        )
        assert loss <= best + 1e-9, (values, weights, fit)


def test_deterministic_cast_gives_the_same_sampled_tokens_for_a_seed():
    """Same seed, same output at T = 1: with `deterministic` the break-even rules use the cost
    table alone (no wall-clock step times), so tree shapes, and so the random draws, repeat."""
    target = sharpen(tiny_model("llama", seed=0))
    draft = sharpen(tiny_model("llama", seed=1, layers=1))
    outputs = []
    for _ in range(2):
        engine = SpeculativeEngine(
            target, CastPolicy(deterministic=True, cost_table=linear_table()), make_rule("sampling"), ModelDraftSource(draft), eos_token_ids=[]
        )
        outs = engine.generate([[5, 6, 7, 8], [9, 10, 11]], 24, SamplingParams(temperature=1.0), seed=123)
        outputs.append([o.token_ids for o in outs])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("rows", [1, 3])
def test_layer_values_pool_every_node_drafted_up_to_each_layer(rows):
    """`_layer_values` (one masked top-k for all layers) equals the per-layer pools built one
    layer at a time: each layer's candidates, then the best m values of the nodes drafted up to
    it (root excluded), batch-averaged as confidences."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(0)
    policy = CastPolicy(top_k=3, total_tokens=5, cost_table=linear_table())
    score = -torch.rand(rows, 20, generator=gen) * 4  # [B, N] the builder's values in creation order
    score[:, 0] = 0.0
    score[score < -3.0] = float("-inf")  # invalid nodes
    ends = [4, 10, 20]  # the builder's node count after each layer
    values = [torch.sort(score[:, s:e], dim=1, descending=True).values[:, :3] for s, e in zip([1, 4, 10], ends, strict=True)]
    policy._weights = torch.full((rows, 1), 1.0 / rows) if rows > 1 else None
    got = policy._layer_values(SimpleNamespace(score=score, device=score.device), values, ends)  # [L, k + m']
    for i, end in enumerate(ends):
        pool = torch.topk(score[:, 1:end], min(5, end - 1), dim=1).values  # [B, m']
        expected = torch.cat([values[i], pool], dim=1).exp().mean(dim=0)  # every row active: a plain mean
        assert torch.allclose(got[i, : expected.shape[0]], expected)
        assert torch.all(got[i, expected.shape[0] :] == 0)  # columns past this layer's pool: nothing (exp(-inf))


def test_best_with_many_equals_best_with_one_by_one():
    """Break-even pruning weighs every width at once (`best_with_many`, array ops); it must give
    exactly the rates of `best_with` per candidate set, including empty sets and pools longer than
    the verification table."""
    rng = random.Random(0)
    for _ in range(300):
        top = rng.randint(1, 30)
        verify = sorted(rng.uniform(5, 30) for _ in range(top + 1))
        values = tuple(sorted((rng.random() for _ in range(rng.randint(1, 40))), reverse=True))
        plan = StepPlan(utility=0.5, verified=1, drafted=rng.uniform(0, 5), verify_cost=verify, values=values)
        news = [[rng.random() for _ in range(rng.randint(0, 8))] for _ in range(rng.randint(1, 6))]
        extras = [rng.uniform(0, 3) for _ in news]
        assert plan.best_with_many(news, extras) == pytest.approx([plan.best_with(n, e) for n, e in zip(news, extras, strict=True)], rel=1e-12)


# ----- plain steps: drafting against drafting nothing, timed -----------------------------------


def test_plain_check_warms_up_then_times_one_plain_step():
    check = PlainDecodingCheck(cold_steps=0, warm_up=4)
    decisions = []
    for _ in range(6):
        plain = check.plain_next(1)
        decisions.append(plain)
        check.observe(1, plain, 10.0, 1.0 if plain else 3.0)
    assert decisions[:4] == [False] * 4 and decisions[4] is True  # drafts first, then one plain step is timed
    assert decisions[5] is False  # drafting (3.3 ms/token) beats plain (10): back to drafting


def test_plain_check_times_a_plain_step_early_when_the_cost_model_predicts_it_faster():
    """A rolling batch's last rows reach a small batch bucket late, for a few steps: a plain step
    is timed there before `warm_up` drafted steps when the cost model says it is faster."""
    check = PlainDecodingCheck(cold_steps=0, warm_up=16, margin=0.1)
    check.observe(1, False, 40.0, 2.0)  # drafted: 20 ms per token
    asked = []

    def predicted(ms: float | None):
        return lambda: asked.append(ms) or ms

    assert check.plain_next(1, predicted(10.0)) is True  # 10 * 1.1 < 20: time a plain step now
    assert check.plain_next(1, predicted(19.0)) is False  # within the margin: drafting keeps the benefit of the doubt
    assert check.plain_next(1, predicted(None)) is False and check.plain_next(1) is False  # no prediction: warm up as before
    assert check.plain_next(2, predicted(1.0)) is False  # nothing drafted timed at this bucket yet: draft
    check.observe(1, True, 12.0, 1.0)  # once a plain step is timed, the times decide and the model is not asked
    n = len(asked)
    check.plain_next(1, predicted(1000.0))
    assert len(asked) == n


def test_plain_check_runs_the_faster_mode_and_probes_the_other():
    check = PlainDecodingCheck(cold_steps=0, warm_up=2, probe_every=5, margin=0.0)
    trace = []
    for _ in range(60):
        plain = check.plain_next(2)
        trace.append(plain)
        check.observe(2, plain, 10.0 if plain else 24.0, 1.0 if plain else 2.0)  # plain 10 ms/token, drafted 12
    tail = trace[20:]
    assert 0.6 < sum(tail) / len(tail) < 0.9  # mostly plain ...
    runs = "".join("p" if p else "d" for p in tail).split("p")
    assert {len(r) for r in runs if r} == {2}  # ... with drafted probes in pairs (the first pays the draft's catch-up)
    assert "p" * 5 + "dd" in "".join("p" if p else "d" for p in tail) and "p" * 6 not in "".join("p" if p else "d" for p in tail)
    # plain steps ahead by more than sure_lead: drafted pairs 4x less often
    check = PlainDecodingCheck(cold_steps=0, warm_up=2, probe_every=5, margin=0.0)
    trace = []
    for _ in range(100):
        plain = check.plain_next(2)
        trace.append(plain)
        check.observe(2, plain, 10.0 if plain else 40.0, 1.0 if plain else 2.0)  # drafted 20 ms/token
    assert "p" * 20 + "dd" in "".join("p" if p else "d" for p in trace[20:])
    # the other way round: drafting ahead by more than clear_lead probes plain once per 4 * probe_every
    check = PlainDecodingCheck(cold_steps=0, warm_up=2, probe_every=5)
    trace = []
    for _ in range(200):
        plain = check.plain_next(2)
        trace.append(plain)
        check.observe(2, plain, 10.0 if plain else 10.0, 1.0 if plain else 3.0)
    assert sum(trace[20:]) in (8, 9, 10)  # 180 steps, one plain step every 21


def test_plain_check_divides_sums_not_per_step_ratios():
    """Drafted steps that commit 1 token in 10 ms and 5 tokens in 12 ms run at 22 / 6 = 3.7 ms per
    token; the mean of per-step ratios (10 and 2.4: 6.2) would lose to plain steps at 5 ms."""
    check = PlainDecodingCheck(cold_steps=0, warm_up=2, probe_every=4, decay=1.0)
    for i in range(40):
        plain = check.plain_next(1)
        check.observe(1, plain, 5.0 if plain else (10.0 if i % 2 else 12.0), 1.0 if plain else (1.0 if i % 2 else 5.0))
    times = check.times(1)
    assert times.plain == pytest.approx(5.0)
    assert times.drafted is not None and times.drafted < 4.5
    assert check.plain_next(1) == (times.since_plain >= 16)  # drafting ahead by more than clear_lead: a plain step every 4 * 4


def test_plain_check_scales_steps_to_their_buckets_size():
    """A rolling batch of 16 rows drains through 15 ... 9 rows, one bucket. Drafted steps timed
    there (where fewer rows cost less) against plain steps timed at 16 rows: unscaled, drafting
    looks faster per token though at any one size it is 10% slower; scaled by each step's cost
    against the bucket's size (what the cost model says), plain steps are ahead."""
    rng = random.Random(0)
    cost = {b: 10.0 + 1.25 * b for b in range(1, 17)}  # a plain step's ms at b rows; 30 ms at 16

    def check_after(scaled: bool) -> PlainDecodingCheck:
        check = PlainDecodingCheck(cold_steps=0)
        for _ in range(60):
            rows = rng.choice((9, 10, 12, 14))  # drafted steps while the batch drains
            check.observe(rows, False, 2.2 * cost[rows] * rng.gauss(1.0, 0.02), 2.0, relative_cost=cost[rows] / cost[16] if scaled else 1.0)
            check.observe(16, True, cost[16] * rng.gauss(1.0, 0.02), 1.0)  # plain steps at the full batch
        return check

    scaled, unscaled = check_after(True), check_after(False)
    assert scaled.plain_ahead(scaled.times(16)) and scaled.times(16).drafted == pytest.approx(33.0, rel=0.03)
    assert not unscaled.plain_ahead(unscaled.times(16)) and unscaled.times(16).drafted < 25.0
    check = PlainDecodingCheck(cold_steps=0, warm_up=16, margin=0.1)
    check.observe(12, False, 40.0, 2.0, relative_cost=0.8)  # 25 ms per token at the bucket's size (16 rows)
    assert check.times(12).drafted == pytest.approx(25.0)
    assert check.plain_next(12, lambda: 18.0, relative_cost=0.8) is True  # 22.5 at the bucket's size * 1.1 < 25
    assert check.plain_next(12, lambda: 18.0, relative_cost=0.7) is False  # 25.7 at the bucket's size: not faster


def test_cast_scales_a_steps_time_to_its_bucket_by_the_cost_table():
    table = CostTable.synthetic(lambda b, c, n: 10.0 + 2.0 * b * n, lambda b, c, n: 1.0 + 0.1 * b * n)
    policy = CastPolicy(cost_table=table)

    def ctx(rows: int, host: bool = True) -> DraftContext:
        return DraftContext(
            SamplingParams(), None, max_depth=4, active=torch.ones(rows, dtype=torch.bool), host_active=[True] * rows, host_context_len=[100] * rows if host else None
        )

    assert policy._relative_cost(16, ctx(16)) == 1.0
    assert policy._relative_cost(12, ctx(12)) == pytest.approx((10.0 + 24.0) / (10.0 + 32.0))
    assert policy._relative_cost(3, ctx(3)) == pytest.approx(16.0 / 18.0)
    assert policy._relative_cost(12, ctx(12, host=False)) == 1.0  # the context is not known on the host: unscaled


def test_mode_times_standard_error_is_the_ratio_estimators():
    """Without decay the standard error is the delta method's for R = sum ms / sum tokens:
    sqrt(sum (ms - R * tokens)^2 / (n - 1)) * sqrt(n) / sum tokens; zero when every step has the
    same ms per token; unknown below MIN_NOISE_STEPS steps."""
    rng = random.Random(3)
    steps = [(rng.uniform(20, 40), float(rng.randint(1, 5))) for _ in range(30)]
    times = _ModeTimes()
    for ms, tokens in steps[:2]:
        times.add(False, ms, tokens, 1.0)
    assert times.standard_error(False) is None
    for ms, tokens in steps[2:]:
        times.add(False, ms, tokens, 1.0)
    n, total = len(steps), sum(t for _, t in steps)
    rate = sum(m for m, _ in steps) / total
    expected = math.sqrt(sum((m - rate * t) ** 2 for m, t in steps) / (n - 1)) * math.sqrt(n) / total
    assert times.standard_error(False) == pytest.approx(expected, rel=1e-9)
    steady = _ModeTimes()
    for tokens in (1.0, 3.0, 2.0, 5.0):
        steady.add(True, 7.0 * tokens, tokens, 0.95)
    assert steady.standard_error(True) == pytest.approx(0.0, abs=1e-6)


def _plain_share(check: PlainDecodingCheck, drafted: Callable[[], tuple[float, float]], plain: Callable[[], tuple[float, float]], steps: int = 300) -> float:
    """Runs the check on sampled (ms, tokens per row) steps; the share of plain steps in the last 200."""
    trace = []
    for _ in range(steps):
        go_plain = check.plain_next(8)
        trace.append(go_plain)
        check.observe(8, go_plain, *(plain() if go_plain else drafted()))
    return sum(trace[-200:]) / 200


def test_plain_check_goes_plain_on_a_steady_small_lead_but_not_on_noise():
    """Steady drafted steps (a large batch: each commits about the same tokens per row) 7% slower
    per token than plain steps: the lead is far outside the timings' noise and plain steps run,
    where a fixed 10% lead, the rule before, kept drafting. Noisy drafted steps (batch 1: they
    commit 1 to 5 tokens) 5% *faster* than plain ones: drafting runs, where a fixed 3% lead went
    plain on noise (as it did on the bundled pair at batch 1)."""
    rng = random.Random(0)

    def plain():
        return rng.gauss(12.0, 0.3), 1.0

    def steady():
        return rng.gauss(25.7, 0.5), rng.gauss(2.0, 0.04)  # 12.85 ms per token

    def noisy():
        return rng.gauss(34.2, 2.0), float(rng.randint(1, 5))  # 11.4 ms per token over many steps

    assert _plain_share(PlainDecodingCheck(cold_steps=0, warm_up=8), steady, plain) > 0.8
    assert _plain_share(PlainDecodingCheck(cold_steps=0, warm_up=8, margin=0.10, z=0.0), steady, plain) < 0.1  # the old fixed 10% lead
    assert _plain_share(PlainDecodingCheck(cold_steps=0, warm_up=8), noisy, plain) < 0.15  # plain probes only (one every probe_every)
    # a fixed 3% lead goes plain on noise (less often since a probe that beats plain steps is followed by more drafted steps)
    assert _plain_share(PlainDecodingCheck(cold_steps=0, warm_up=8, margin=0.03, z=0.0), noisy, plain) > 0.4


def test_plain_check_times_drafted_steps_by_their_expected_tokens():
    """Drafted steps whose committed tokens vary by 20% from step to step and whose ms vary by 8%
    (the bundled pair at batch 8): timed over the tokens the policy expected (here 20% too many:
    the long-window factor corrects the rate), the drafted rate's standard error is about half
    of what it is timed over the committed tokens alone, at the same rate. With that, a steady
    5% lead of plain steps sends the check plain in most steps (up to 16 plain ones per drafted pair)."""
    for seed in range(5):
        rng = random.Random(seed)
        with_expectation, without = _ModeTimes(), _ModeTimes()
        for _ in range(400):
            ms, tokens = rng.gauss(25.2, 2.0), max(0.5, rng.gauss(2.0, 0.4))  # 12.6 ms per committed token
            with_expectation.add(False, ms, tokens, 0.95, expected=2.4)
            without.add(False, ms, tokens, 0.95)
        assert with_expectation.drafted == pytest.approx(12.6, rel=0.05)  # committed, not expected, tokens set the rate
        assert with_expectation.standard_error(False) < 0.65 * without.standard_error(False)  # measured 0.45-0.62x

    def plain_share(seed: int) -> float:
        rng = random.Random(seed)
        check = PlainDecodingCheck(cold_steps=0, warm_up=8)
        trace = []
        for _ in range(2000):
            go_plain = check.plain_next(8)
            trace.append(go_plain)
            if go_plain:
                check.observe(8, True, rng.gauss(12.0, 0.3), 1.0)
            else:
                check.observe(8, False, rng.gauss(25.2, 2.0), max(0.5, rng.gauss(2.0, 0.4)), 2.4)
        return sum(trace[-1000:]) / 1000

    assert sum(plain_share(seed) for seed in range(16)) / 16 > 0.76  # measured 0.80 (0.67 without expectations)


def test_plain_check_a_bucket_reached_for_a_few_steps_borrows_the_other_buckets_acceptance():
    """A rolling batch of 4 ends with one row left for a few steps. Three of them commit one token
    each where the policy expected 2.4: on its own the batch-1 bucket's drafted speed is 20 ms a
    token, against plain steps at 14.5, with no spread to doubt it (three equal steps), and the
    row's last steps would run plain. Its committed-per-expected tokens are shrunk toward the
    ratio every bucket's drafted steps measured (about 1 here), so it drafts on; with pooling off
    (`prior_tokens=0`, the rule before) it goes plain. Once the bucket has hundreds of its own
    steps that commit one token in 2.4, they outweigh the pooled ratio and it goes plain."""

    def check_after_batch_4(prior_tokens: float) -> PlainDecodingCheck:
        rng = random.Random(0)
        check = PlainDecodingCheck(cold_steps=0, warm_up=4, prior_tokens=prior_tokens)
        for _ in range(300):
            plain = check.plain_next(4)
            if plain:
                check.observe(4, True, rng.gauss(15.0, 0.3), 1.0)
            else:
                check.observe(4, False, rng.gauss(24.0, 1.0), rng.choice([1.0, 1.75, 2.5, 3.0, 3.75]), 2.4)
        for _ in range(3):
            check.observe(1, False, 20.0, 1.0, 2.4)
        for _ in range(4):
            check.observe(1, True, 14.5, 1.0)
        return check

    pooled, alone = check_after_batch_4(16.0), check_after_batch_4(0.0)
    assert alone.times(1).drafted == pytest.approx(20.0) and alone.plain_ahead(alone.times(1))
    assert pooled.times(1).drafted is not None and pooled.times(1).drafted < 12.0
    assert not pooled.plain_ahead(pooled.times(1)) and not pooled.plain_next(1)
    assert pooled.times(4).drafted == pytest.approx(alone.times(4).drafted, rel=0.01)  # the busy bucket barely moves
    for _ in range(300):
        pooled.observe(1, False, 20.0, 1.0, 2.4)
    assert pooled.times(1).drafted > 17.0 and pooled.plain_ahead(pooled.times(1))


def test_plain_check_buckets_and_stalls():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    check = PlainDecodingCheck(cold_steps=0, warm_up=1, probe_every=100)
    check.observe(3, False, 10.0, 2.0)
    assert check.times(4).drafted == pytest.approx(5.0) and check.times(8).drafted is None  # 3 and 4 share a bucket
    check.observe(4, True, 6.0, 1.0)
    check.observe(4, False, 10_000.0, 2.0)  # one stalled drafted step: clipped to 3x the mean
    assert check.times(4).drafted < 6.0
    assert not check.plain_next(4)


class _AlternatingCheck(PlainDecodingCheck):
    """Plain at every other step, whatever the times."""

    def plain_next(self, batch: int, predicted_plain=None, relative_cost: float = 1.0) -> bool:
        self.calls = getattr(self, "calls", 0) + 1
        return self.calls % 2 == 0


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_cast_plain_steps_keep_greedy_output(arch):
    """Plain steps draw nothing (no draft forward; the draft catches up at the next drafted step):
    greedy output is still the target's own, at batch 1 and 3, and a row's last token is never drafted."""
    target, draft = close_pair(arch)
    refs = [reference(target, p, 20) for p in PROMPTS]
    policy = make_policy("cast", cost_table=linear_table(), plain_steps=True)
    policy.plain_check = _AlternatingCheck()
    source = ModelDraftSource(draft)
    begun = []
    begin_step = source.begin_step
    source.begin_step = lambda roots, params: begun.append(1) or begin_step(roots, params)
    engine = SpeculativeEngine(target, policy, GreedyRule(), source, eos_token_ids=[EOS])
    out = engine.generate([PROMPTS[0]], 20, keep_steps=True)[0]
    assert out.token_ids == refs[0]
    drafted = [rec.drafted[0] for rec in out.steps]
    assert drafted[1::2] == [0] * len(drafted[1::2]) and sum(drafted[0::2]) > 0
    assert out.stats.accepted_tokens > 0
    assert len(begun) <= (len(out.steps) + 1) // 2  # plain steps (and the last token's) ran no draft forward
    assert [o.token_ids for o in engine.generate(PROMPTS, 20)] == refs
    # deterministic mode never skips drafting (the check is timed by the wall clock)
    policy = make_policy("cast", cost_table=linear_table(), deterministic=True, plain_steps=True)
    policy.plain_check = _AlternatingCheck()
    engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
    out = engine.generate([PROMPTS[0]], 20, keep_steps=True)[0]
    assert out.token_ids == refs[0] and not hasattr(policy.plain_check, "calls")


def test_steps_that_capture_cuda_graphs_teach_cast_no_times(monkeypatch):
    """A step whose forwards captured CUDA graphs (a shape the warm-up missed) is timed with the
    captures in it: tens of ms on a GPU, where a step takes a few. Neither the plain-or-draft
    check nor the learned overheads may take it in (on an H100 a warm-up call's captures made
    drafting look slower than plain steps, and CAST's first timed call ran every step plain).
    Emulated here by an engine that reports a capture at every step."""
    target, draft = close_pair("llama")
    refs = [reference(target, PROMPTS[0], 12)]

    def run(capturing: bool) -> CastPolicy:
        policy = make_policy("cast", cost_table=linear_table())
        engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
        if capturing:
            counter = iter(range(10**6))
            monkeypatch.setattr(engine, "graph_captures", lambda: next(counter))
        out = engine.generate([PROMPTS[0]], 12, keep_steps=True)[0]
        assert out.token_ids == refs[0]
        assert all((rec.graph_captures > 0) == capturing for rec in out.steps)
        return policy

    timed, skipped = run(capturing=False), run(capturing=True)
    assert timed.plain_check.times(1).drafted is not None and timed.overheads.other_ms > 0
    assert skipped.plain_check.times(1).drafted is None and skipped.plain_check.times(1).plain is None
    assert skipped.overheads.other_ms == 0 and skipped.overheads.draft_ms == 0


def test_plain_check_times_no_cold_drafted_step_and_drafts_on_after_a_winning_probe():
    """The first `cold_steps` drafted steps at a bucket are not timed (a process's first steps
    load kernels): slow ones there do not send the check plain. And once plain steps lead, a
    drafted probe faster than plain steps is followed by another drafted step, so a drafted
    mean inflated by old steps is replaced by new timings instead of waiting 4 * probe_every
    plain steps for each probe (on an H200 CAST at batch 1 ran 54 of 56 steps plain)."""
    check = PlainDecodingCheck(warm_up=8, cold_steps=3)
    for _ in range(3):
        check.observe(1, False, 500.0, 1.0)  # cold: 500 ms a token
    assert check.times(1).drafted is None
    for _ in range(2):
        assert not check.plain_next(1)
        check.observe(1, False, 20.0, 5.0)  # 4 ms a token
    assert check.times(1).drafted == pytest.approx(4.0)
    # plain steps lead by far (an inflated drafted mean): probes come rarely ...
    check = PlainDecodingCheck(warm_up=1, cold_steps=0, probe_every=4)
    check.observe(1, False, 100.0, 1.0)
    for _ in range(3):
        check.observe(1, True, 6.0, 1.0)
    t = check.times(1)
    assert check.plain_ahead(t) and check.plain_next(1)
    check.observe(1, True, 6.0, 1.0)
    # ... until a probe is timed faster than plain steps: then drafting goes on, step after step
    check.expect_catch_up()
    check.observe(1, False, 20.0, 5.0)  # the probe's first step pays the draft's catch-up: untimed
    assert t.last_drafted_beat_plain is False and not check.plain_next(1)  # a probe is two drafted steps
    check.observe(1, False, 20.0, 5.0)  # 4 ms a token against 6
    assert t.last_drafted_beat_plain and not check.plain_next(1)
    drafted = 0
    while check.plain_ahead(t) and drafted < 200:
        assert not check.plain_next(1)
        check.observe(1, False, 20.0, 5.0)
        drafted += 1
    assert not check.plain_ahead(t) and drafted < 60
    check.observe(1, False, 60.0, 5.0)  # a slow probe (12 ms a token): no follow-up on its strength
    assert not t.last_drafted_beat_plain
