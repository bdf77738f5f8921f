"""Invariant 2: sampling verification leaves the target's output distribution unchanged.

On a 6-token vocabulary the exact joint distribution of the first three generated tokens
is computed by enumeration (6 + 36 sequential target forwards). Many independent samples
(rows of one batch, each drawing from the shared seeded generator) are compared to it
with a chi-square test. Tolerance: the lossless rules must give p > 1e-3 (the seeds are
fixed, so the test is deterministic); a deliberately broken rule (accept every drafted
token) must give p < 1e-6 on the same data size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model
from distribution import chi2_pvalue, exact_joint

from specdec.cost import CostTable
from specdec.engine import SpeculativeEngine
from specdec.methods import make_policy
from specdec.sampling import SamplingParams, logits_to_logprobs
from specdec.sources import ModelDraftSource
from specdec.verification import SamplingRule, Verdict

V = 6
PROMPT = [1, 4, 2, 5]
N_SAMPLES = 3000
TOKENS = 3


def models():
    target = tiny_model("llama", seed=3, vocab=V, eos=-1 % V)
    draft = tiny_model("llama", seed=11, vocab=V, layers=1, eos=-1 % V)
    with torch.no_grad():  # peaked-ish distributions so drafts are sometimes right, sometimes wrong
        target.get_output_embeddings().weight.mul_(3.0)
        draft.get_output_embeddings().weight.mul_(3.0)
    return target, draft


def sample_counts(engine: SpeculativeEngine, params: SamplingParams, seed: int) -> np.ndarray:
    counts = np.zeros((V,) * TOKENS)
    per_batch = 500
    for i in range(N_SAMPLES // per_batch):
        outs = engine.generate([PROMPT] * per_batch, TOKENS, params, seed=seed + i)
        for o in outs:
            counts[tuple(o.token_ids)] += 1
    return counts


class AcceptEverything:
    """A broken rule: keeps the first root-to-leaf path whole, bonus from the target."""

    name = "broken"

    def verify(self, tree, target_logits, params, generator) -> Verdict:
        paths, bonus = [], []
        probs = logits_to_logprobs(target_logits, params).exp()
        for row in range(tree.batch_size):
            path, node = [], 0
            while kids := tree.children(row, node):
                node = kids[0]
                path.append(node)
            paths.append(path)
            bonus.append(int(torch.multinomial(probs[row, node], 1, generator=generator)))
        zeros = [0] * tree.batch_size
        return Verdict.from_lists(paths, bonus, zeros, list(zeros), target_logits.device)


CASES = {
    "chain": ("chain", {"k": 3}, SamplingParams(temperature=1.0)),
    "static-tree": ("static", {"depth": 2, "branching": 2, "max_nodes": 6}, SamplingParams(temperature=1.0)),
    "eagle2-top-p": ("eagle2", {"depth": 2, "top_k": 2, "total_tokens": 4}, SamplingParams(temperature=0.8, top_p=0.9)),
    "chain-top-k": ("chain", {"k": 2}, SamplingParams(temperature=1.2, top_k=4)),
    # CAST's tree shape adapts to earlier verdicts (calibrated values, learned overheads): still lossless
    "cast-adaptive": (
        "cast",
        {"depth": 2, "top_k": 2, "total_tokens": 4, "cost_table": CostTable.synthetic(lambda b, c, n: 10.0 + 0.1 * n, lambda b, c, n: 1.0)},
        SamplingParams(temperature=1.0),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_rule_is_lossless(case):
    method, options, params = CASES[case]
    target, draft = models()
    engine = SpeculativeEngine(target, make_policy(method, **options), SamplingRule(), ModelDraftSource(draft), eos_token_ids=[])
    counts = sample_counts(engine, params, seed=1000)
    joint = exact_joint(target, PROMPT, V, TOKENS, params)
    assert abs(joint.sum() - 1) < 1e-4
    pvalue = chi2_pvalue(counts, joint)
    assert pvalue > 1e-3, f"{case}: chi-square p = {pvalue:.2e}"
    # the draft really disagrees sometimes, so the test exercises rejections
    stats = engine.generate([PROMPT] * 200, TOKENS, params, seed=5)
    accepted = sum(o.stats.accepted_tokens for o in stats)
    drafted = sum(o.stats.drafted_tokens for o in stats)
    assert 0 < accepted < drafted


@pytest.mark.parametrize("method,options", [("chain", {"k": 3}), ("static", {"depth": 2, "branching": 2, "max_nodes": 6})])
def test_broken_rule_fails_the_same_test(method, options):
    target, draft = models()
    params = SamplingParams(temperature=1.0)
    engine = SpeculativeEngine(target, make_policy(method, **options), AcceptEverything(), ModelDraftSource(draft), eos_token_ids=[])
    pvalue = chi2_pvalue(sample_counts(engine, params, seed=1000), exact_joint(target, PROMPT, V, TOKENS, params))
    assert pvalue < 1e-6, f"the broken rule passed: p = {pvalue:.2e}"


def test_same_seed_same_output_and_seeds_differ():
    target, draft = models()
    params = SamplingParams(temperature=1.0)
    engine = SpeculativeEngine(target, make_policy("chain", k=3), SamplingRule(), ModelDraftSource(draft), eos_token_ids=[])
    a = [o.token_ids for o in engine.generate([PROMPT] * 8, 12, params, seed=42)]
    b = [o.token_ids for o in engine.generate([PROMPT] * 8, 12, params, seed=42)]
    c = [o.token_ids for o in engine.generate([PROMPT] * 8, 12, params, seed=43)]
    assert a == b
    assert a != c
