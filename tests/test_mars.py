"""MARS margin-aware verification (specdec/verification/mars.py).

- Hand-built logits cover every branch: exact match, relaxed v2 just above theta, reject
  just below and at theta, a third token, z1 <= 0 fallback, theta >= 1, top-k/top-p and
  temperature not changing the decision, sibling preference, counters.
- Relaxed sampling at one node matches the distribution the rule is documented to give
  (docs/mars.md; chi-square p > 1e-3 on 8000 draws) and rejects both the target's and the
  "sample the bonus from the full distribution" variant (p < 1e-6); theta >= 1 matches
  the target's.
- End to end: theta >= 1 reproduces the target's greedy `generate` exactly and, sampling,
  is token-identical to the lossless rule and passes the same distribution test (joint of
  the first three tokens on a 6-token vocabulary, chi-square p > 1e-3 with fixed seeds;
  theta = 0.5 must fail it with p < 1e-6); theta = 0.9 greedy output is a valid MARS
  sequence whose non-argmax tokens are exactly the relaxed tokens.
- make_rule, API and CLI plumbing, with clear errors for bad theta.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import EOS, sharpen, tiny_model
from distribution import chi2_pvalue, exact_joint
from scipy.stats import chisquare

from specdec.api import SpeculativeDecoder
from specdec.cli import main
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.tree import TokenTree
from specdec.verification import MarsRule, SamplingRule, make_rule
from specdec.verification.mars import _relax_hook, margins, outright_children

V = 6
GREEDY = SamplingParams()
SAMPLE = SamplingParams(temperature=1.0)


def make_tree(
    tokens: list[list[int]], parents: list[list[int]], sampled: bool = False, draft_probs: torch.Tensor | None = None
) -> TokenTree:
    """A batch of hand-built trees (rows of equal length, BFS order, node 0 the root)."""
    t = torch.tensor(tokens)
    p = torch.tensor(parents)
    depths = torch.zeros_like(t)
    for i in range(1, t.shape[1]):
        depths[:, i] = depths.gather(1, p[:, i : i + 1].clamp(min=0)).squeeze(1) + 1
    return TokenTree(
        tokens=t,
        parents=p,
        depths=depths,
        logq=torch.zeros(t.shape, dtype=torch.float32),
        cum_logq=torch.zeros(t.shape, dtype=torch.float32),
        valid=torch.ones(t.shape, dtype=torch.bool),
        sampled=torch.full(t.shape, sampled) & (p >= 0),
        draft_logprobs=None if draft_probs is None else draft_probs.log(),
    )


def logits_rows(*rows: list[float]) -> torch.Tensor:
    """[1, N, V] raw logits, one list per node (shorter lists are padded with -5)."""
    return torch.tensor([[r + [-5.0] * (V - len(r)) for r in rows]])


def chain(first: int) -> TokenTree:
    """root(5) -> first: one drafted token."""
    return make_tree([[5, first]], [[-1, 0]])


# ---------------------------------------------------------------- greedy, one node


LEAF = [0.0, 1.0, 3.0]  # logits at the drafted node: its bonus (argmax) is token 2


@pytest.mark.parametrize(
    "root_logits,draft,theta,accepted,relaxed,bonus",
    [
        ([10.0, 2.0], 0, 0.9, True, 0, 2),  # exact match: v1 accepted, bonus = argmax at the leaf
        ([10.0, 9.001], 1, 0.9, True, 1, 2),  # r = 0.9001 > theta: v2 accepted (relaxed)
        ([10.0, 8.999], 1, 0.9, False, 0, 0),  # r = 0.8999: rejected, correction v1
        ([10.0, 9.0], 1, 0.9, False, 0, 0),  # r = theta exactly: the test is strict (r > theta)
        ([10.0, 9.9, 9.8], 2, 0.9, False, 0, 0),  # third token: never relaxed, whatever the margin
        ([10.0, 9.99], 1, 1.0, False, 0, 0),  # theta >= 1 never relaxes
        ([10.0, 10.0], 1, 1.0, False, 0, 0),  # ... not even at an exact tie (r = 1)
        ([10.0, 10.0], 1, 0.999, True, 1, 2),  # a tie: v1 is the lower id (argmax), v2 relaxed
        ([2.0, 1.9], 1, 0.9, True, 1, 2),  # the ratio, not the gap: small logits, r = 0.95
        ([100.0, 88.0], 1, 0.9, False, 0, 0),  # large logits, r = 0.88: rejected though p2/p1 != 0
    ],
)
def test_greedy_branches(root_logits, draft, theta, accepted, relaxed, bonus):
    verdict = MarsRule(theta).verify(chain(draft), logits_rows(root_logits, LEAF), GREEDY, None)
    assert verdict.accepted_nodes == [[1] if accepted else []]
    assert verdict.relaxed == [relaxed]
    assert verdict.strict_fallbacks == [0]
    assert verdict.bonus_tokens.tolist() == [bonus]


@pytest.mark.parametrize(
    "root_logits,draft,accepted",
    [
        ([-1.0, -1.05], 1, False),  # z1 < 0: the naive ratio 1.05 > theta would relax; strict rejects
        ([-1.0, -1.05], 0, True),  # ... and v1 is still accepted strictly
        ([0.0, -0.01], 1, False),  # z1 = 0: the ratio is undefined
    ],
)
def test_nonpositive_top_logit_falls_back_to_strict(root_logits, draft, accepted):
    verdict = MarsRule(0.9).verify(chain(draft), logits_rows(root_logits + [-9.0] * 4, LEAF), GREEDY, None)
    assert verdict.accepted_nodes == [[1] if accepted else []]
    assert verdict.relaxed == [0]
    assert verdict.strict_fallbacks == [1]
    assert MarsRule(1.0).verify(chain(draft), logits_rows(root_logits + [-9.0] * 4, LEAF), GREEDY, None).strict_fallbacks == [0]


def test_margins_are_computed_from_raw_logits():
    z = torch.tensor([[[1.0, 5.0, 4.6, -2.0, 0.0, 4.0]]])
    m = margins(z, 0.9)
    assert (m.v1.item(), m.v2.item(), bool(m.fire), bool(m.fallback)) == (1, 2, True, False)
    assert not bool(margins(z, 0.93).fire)  # r = 0.92
    assert not bool(margins(z - 10, 0.9).fire) and bool(margins(z - 10, 0.9).fallback)  # all logits < 0
    assert not bool(margins(z, 1.0).fallback) and not bool(margins(z - 10, 1.0).fallback)  # theta >= 1: nothing to fall back from


# ---------------------------------------------------------------- trees and counters


@pytest.mark.parametrize("walk", ["host", "device"])
def test_sibling_preference_v1_then_v2(walk):
    # root has children [v2, v1] in tree order; v2's subtree is deeper, yet v1 is taken
    tree = make_tree([[5, 1, 0, 2, 3]], [[-1, 0, 0, 1, 3]])
    z = logits_rows([10.0, 9.5], [0.0, 0.0, 5.0], LEAF, [0.0, 0.0, 0.0, 5.0], LEAF)
    for params in (GREEDY, SamplingParams(temperature=0.7, top_k=1)):
        verdict = MarsRule(0.9, walk=walk).verify(tree, z, params, torch.Generator().manual_seed(0))
        assert verdict.accepted_nodes == [[2]]
        assert verdict.relaxed == [0]
    # without a v1 child, the relaxed v2 is preferred over an earlier third token
    tree = make_tree([[5, 4, 1]], [[-1, 0, 0]])
    for params in (GREEDY, SamplingParams(temperature=0.7, top_k=1)):
        verdict = MarsRule(0.9, walk=walk).verify(tree, logits_rows([10.0, 9.5, 0.0, 0.0, 9.4], LEAF, LEAF), params, torch.Generator().manual_seed(0))
        assert verdict.accepted_nodes == [[2]]
        assert verdict.relaxed == [1]


def test_chain_counts_relaxed_tokens_and_fallbacks_on_the_path_only():
    # root -> node 1 (token 1 = v2, relaxed) -> node 3 (token 0 = v1 at a z1 < 0 node: strict,
    # one fallback) -> node 5 (token 3 = v2 at r = 6.2 / 7 = 0.886); the sibling branch
    # root -> node 2 -> node 4 has z1 < 0 at node 2, off the accepted path (not counted)
    tree = make_tree([[5, 1, 4, 0, 2, 3]], [[-1, 0, 0, 1, 2, 3]])
    z = logits_rows([10.0, 9.5], [-1.0, -1.1], [-1.0, -0.9], [0.0, 0.0, 7.0, 6.2], LEAF, LEAF)
    cases = {
        0.85: ([1, 3, 5], 2, 1, 2),  # everything relaxed; bonus = argmax at the leaf
        0.9: ([1, 3], 1, 1, 2),  # node 5 rejected: correction = v1 at node 3
        0.95: ([], 0, 0, 0),  # r = 0.95 at the root is not > 0.95
        1.0: ([], 0, 0, 0),
    }
    for theta, (path, relaxed, fallbacks, bonus) in cases.items():
        verdict = MarsRule(theta).verify(tree, z, GREEDY, None)
        assert (verdict.accepted_nodes, verdict.relaxed, verdict.strict_fallbacks, verdict.bonus_tokens.tolist()) == (
            [path],
            [relaxed],
            [fallbacks],
            [bonus],
        ), theta


def test_rows_of_a_batch_are_independent():
    tree = make_tree([[5, 1], [5, 1], [5, 0]], [[-1, 0]] * 3)
    z = torch.cat([logits_rows([10.0, 9.5], LEAF), logits_rows([10.0, 5.0], LEAF), logits_rows([-1.0, -1.1], LEAF)])
    verdict = MarsRule(0.9).verify(tree, z, GREEDY, None)
    assert verdict.accepted_nodes == [[1], [], [1]]
    assert verdict.relaxed == [1, 0, 0]
    assert verdict.strict_fallbacks == [0, 0, 1]
    assert verdict.bonus_tokens.tolist() == [2, 0, 2]


# ---------------------------------------------------------------- sampling, hand-built


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.05),
        SamplingParams(temperature=50.0),
        SamplingParams(temperature=1.0, top_k=1),  # masks v2 out of the processed distribution
        SamplingParams(temperature=1.0, top_p=0.05),  # likewise
    ],
)
def test_temperature_and_masks_do_not_change_the_decision(params):
    z = logits_rows([10.0, 9.5, 1.0], LEAF)  # r = 0.95
    for seed in range(20):
        verdict = MarsRule(0.9).verify(chain(1), z, params, torch.Generator().manual_seed(seed))
        assert verdict.accepted_nodes == [[1]]  # v2 accepted outright, every time
        # below theta the same draft goes through the exact test; with v2 masked it always fails
        verdict = MarsRule(0.96).verify(chain(1), z, params, torch.Generator().manual_seed(seed))
        if params.top_k == 1 or params.top_p < 1:
            assert verdict.accepted_nodes == [[]]
            assert verdict.bonus_tokens.tolist() == [0]  # the residual is the point mass on v1


@pytest.mark.parametrize("walk", ["host", "device"])
def test_sampling_relaxed_counter_is_the_strict_counterfactual(walk):
    params = SamplingParams(temperature=1.0, top_k=1)  # the strict rule accepts v1 surely, v2 never
    z = logits_rows([10.0, 9.5], LEAF)
    assert MarsRule(0.9, walk=walk).verify(chain(1), z, params, torch.Generator().manual_seed(0)).relaxed == [1]
    assert MarsRule(0.9, walk=walk).verify(chain(0), z, params, torch.Generator().manual_seed(0)).relaxed == [0]
    # a low-margin node with neither v1 nor v2 drafted: exact test (token 2 is masked: rejected), bonus v1
    verdict = MarsRule(0.9, walk=walk).verify(chain(2), logits_rows([10.0, 9.5, 9.4], LEAF), params, torch.Generator().manual_seed(0))
    assert (verdict.accepted_nodes, verdict.relaxed, verdict.bonus_tokens.tolist()) == ([[]], [0], [0])


def _one_node_samples(theta: float, n: int, seed: int, walk: str = "host") -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """n rows: root with one child drawn from q; returns (counts of the first committed token,
    mean relaxed count, p, q)."""
    z = torch.tensor([3.0, 2.85, 2.0, 1.5, 1.0, 0.5])  # r = 0.95
    q = torch.softmax(torch.tensor([0.2, 2.5, 1.0, 0.4, 1.6, 0.0]), -1)  # q(v2) > p(v2): the strict rule sometimes rejects v2
    gen = torch.Generator().manual_seed(seed)
    kids = torch.multinomial(q, n, replacement=True, generator=gen)
    draft_probs = torch.stack([q, torch.full((V,), 1 / V)])[None].expand(n, 2, V).clone()
    tree = make_tree([[5, int(k)] for k in kids], [[-1, 0]] * n, sampled=True, draft_probs=draft_probs)
    logits = torch.stack([z, torch.zeros(V)])[None].expand(n, 2, V).clone()
    verdict = MarsRule(theta, walk=walk).verify(tree, logits, SAMPLE, gen)
    first = [int(kids[i]) if path else int(verdict.bonus_tokens[i]) for i, path in enumerate(verdict.accepted_nodes)]
    p_np, q_np = torch.softmax(z.double(), -1).numpy(), q.double().numpy()
    return np.bincount(first, minlength=V), float(np.mean(verdict.relaxed)), p_np / p_np.sum(), q_np / q_np.sum()


def _predicted_mars(p: np.ndarray, q: np.ndarray, top2: tuple[int, int]) -> np.ndarray:
    """The documented distribution at a low-margin node with one sampled child x ~ q: x in
    {v1, v2} is committed; otherwise x passes the exact test w.p. min(1, p/q) and else the
    token comes from the residual norm(max(0, p - q))."""
    a = np.minimum(1.0, p / q)
    tail = np.ones(V, dtype=bool)
    tail[list(top2)] = False
    out = np.where(tail, q * a, q)
    residual = np.maximum(0.0, p - q)
    return out + (q * (1 - a))[tail].sum() * residual / residual.sum()


@pytest.mark.parametrize("walk", ["host", "device"])
def test_relaxed_sampling_gives_the_documented_distribution(walk):
    counts, relaxed, p, q = _one_node_samples(0.9, 8000, seed=1, walk=walk)
    predicted = _predicted_mars(p, q, (0, 1))
    assert abs(predicted.sum() - 1) < 1e-9
    assert chisquare(counts, predicted * counts.sum()).pvalue > 1e-3
    assert chisquare(counts, p * counts.sum()).pvalue < 1e-6  # lossy, and the test can tell
    # the variant that skips the exact tests of a non-top-2 child and draws from p is distinguishable
    variant = np.where(np.arange(V) < 2, q, 0.0) + q[2:].sum() * p
    assert chisquare(counts, variant * counts.sum()).pvalue < 1e-6
    assert (predicted[2:] <= p[2:] + 1e-12).all()  # tokens outside {v1, v2} only lose mass
    expected_relaxed = q[0] * (1 - min(1, p[0] / q[0])) + q[1] * (1 - min(1, p[1] / q[1]))
    assert abs(relaxed - expected_relaxed) < 4 * math.sqrt(expected_relaxed / 8000)
    # theta >= 1: the exact rule, the target's distribution
    counts, relaxed, p, _ = _one_node_samples(1.0, 8000, seed=2, walk=walk)
    assert chisquare(counts, p * counts.sum()).pvalue > 1e-3
    assert relaxed == 0


# ---------------------------------------------------------------- end to end, greedy

METHODS = {
    "chain": {"k": 4},
    "static": {"depth": 3, "branching": 2, "max_nodes": 12},
    "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10},
}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]]


def greedy_pair(arch: str):
    target = sharpen(tiny_model(arch, seed=0))
    draft = sharpen(tiny_model(arch, seed=0))
    with torch.no_grad():  # close to the target: often agrees, sometimes not
        for prm in draft.parameters():
            prm.add_(0.03 * torch.randn_like(prm))
    return target, draft


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("theta", [1.0, 3.0])
def test_theta_at_least_one_reproduces_greedy_generate(arch, theta):
    target, draft = greedy_pair(arch)
    for method, options in METHODS.items():
        engine = SpeculativeEngine(target, make_policy(method, **options), MarsRule(theta), ModelDraftSource(draft), eos_token_ids=[EOS])
        outs = engine.generate(PROMPTS, 20)  # a batch, left-padded
        for prompt, out in zip(PROMPTS, outs, strict=True):
            with torch.no_grad():
                ref = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=EOS, pad_token_id=0)
            assert out.token_ids == ref[0, len(prompt) :].tolist(), f"{arch}/{method}/{prompt}"
            assert out.stats.relaxed_tokens == 0 and out.stats.strict_fallbacks == 0


@pytest.mark.parametrize("method", list(METHODS))
def test_relaxed_greedy_output_is_a_valid_mars_sequence(method):
    """Every generated token is the target's argmax at its prefix, or its runner-up at a
    low-margin prefix; the runner-ups are exactly the relaxed tokens."""
    theta = 0.9
    target, draft = greedy_pair("llama")
    engine = SpeculativeEngine(target, make_policy(method, **METHODS[method]), MarsRule(theta), ModelDraftSource(draft), eos_token_ids=[])
    outs = engine.generate(PROMPTS, 24)
    total_relaxed = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            z = target(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]  # [T, V] raw logits before each token
        top = z.topk(2, dim=-1)
        runner_ups = 0
        for t, tok in enumerate(out.token_ids):
            (z1, z2), (v1, v2) = top.values[t].tolist(), top.indices[t].tolist()
            ambiguous = z1 - z2 < 1e-4 or (z1 > 0 and abs(z2 / z1 - theta) < 1e-5)  # tree vs sequential rounding
            if tok == v1 or ambiguous:
                runner_ups += int(tok != v1)
                continue
            assert tok == v2 and z1 > 0 and z2 / z1 > theta, f"token {t} = {tok}: v1 {v1} ({z1:.4f}), v2 {v2} ({z2:.4f})"
            runner_ups += 1
        assert runner_ups == out.stats.relaxed_tokens
        total_relaxed += runner_ups
    assert total_relaxed > 0, "the relaxation never fired; the test would prove nothing"


# ---------------------------------------------------------------- end to end, sampling

PROMPT = [1, 4, 2, 5]
TOKENS = 3


def sampling_pair(draft_scale: float):
    """A 6-token target (fairly flat) and an unrelated draft; a large draft_scale makes the
    draft overconfident, so the exact tests reject often and the relaxation matters."""
    target = tiny_model("llama", seed=3, vocab=V, eos=V - 1)
    draft = tiny_model("llama", seed=11, vocab=V, layers=1, eos=V - 1)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)
        draft.get_output_embeddings().weight.mul_(draft_scale)
    return target, draft


def sample_counts(engine: SpeculativeEngine, params: SamplingParams, n: int = 3000, seed: int = 1000) -> tuple[np.ndarray, int]:
    counts, relaxed = np.zeros((V,) * TOKENS), 0
    for i in range(n // 500):
        for out in engine.generate([PROMPT] * 500, TOKENS, params, seed=seed + i):
            counts[tuple(out.token_ids)] += 1
            relaxed += out.stats.relaxed_tokens
    return counts, relaxed


SAMPLING_CASES = {
    "chain-peaked-draft": ("chain", {"k": 3}, SamplingParams(temperature=1.0), 12.0),
    "static-top-p": ("static", {"depth": 2, "branching": 2, "max_nodes": 6}, SamplingParams(temperature=0.8, top_p=0.9), 3.0),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_theta_at_least_one_sampling_is_lossless(case):
    method, options, params, draft_scale = SAMPLING_CASES[case]
    target, draft = sampling_pair(draft_scale)
    engine = SpeculativeEngine(target, make_policy(method, **options), MarsRule(1.0), ModelDraftSource(draft), eos_token_ids=[])
    counts, relaxed = sample_counts(engine, params)
    joint = exact_joint(target, PROMPT, V, TOKENS, params)
    assert abs(joint.sum() - 1) < 1e-4
    pvalue = chi2_pvalue(counts, joint)
    assert pvalue > 1e-3, f"{case}: chi-square p = {pvalue:.2e}"
    assert relaxed == 0
    # and token for token what the lossless rule draws with the same seed
    strict = SpeculativeEngine(target, make_policy(method, **options), SamplingRule(), ModelDraftSource(draft), eos_token_ids=[])
    a = [o.token_ids for o in engine.generate([PROMPT] * 64, 10, params, seed=7)]
    b = [o.token_ids for o in strict.generate([PROMPT] * 64, 10, params, seed=7)]
    assert a == b


@pytest.mark.parametrize("walk", ["host", "device"])
def test_relaxed_sampling_is_lossy_and_counted(walk):
    """The same test fails with the relaxation on (so it has power, and MARS is lossy)."""
    target, draft = sampling_pair(12.0)
    params = SamplingParams(temperature=1.0)
    engine = SpeculativeEngine(target, make_policy("chain", k=3), MarsRule(0.5, walk=walk), ModelDraftSource(draft), eos_token_ids=[])
    counts, relaxed = sample_counts(engine, params)
    assert relaxed > 0
    pvalue = chi2_pvalue(counts, exact_joint(target, PROMPT, V, TOKENS, params))
    assert pvalue < 1e-6, f"theta = 0.5 passed the lossless test: p = {pvalue:.2e}"


# ---------------------------------------------------------------- make_rule, API, CLI


@pytest.mark.parametrize("bad", [0, -0.5, float("nan"), "0.9", True, None])
def test_bad_theta_is_a_clear_error(bad):
    with pytest.raises(SpecDecError, match=r"theta=.*must be a number > 0.*--mars-theta 0\.9"):
        make_rule("mars", theta=bad)


def test_make_rule_mars_and_option_checks():
    assert isinstance(make_rule("mars"), MarsRule) and make_rule("mars").theta == 0.9
    assert make_rule("mars", theta=0.95).theta == 0.95
    with pytest.raises(SpecDecError, match="theta do not apply to --verify greedy"):
        make_rule("greedy", theta=0.9)
    with pytest.raises(SpecDecError, match="not a known accept rule; choose one of greedy, sampling, mars"):
        make_rule("relaxed")


def test_api_mars_options(tiny_pair_dir):
    target, draft = str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft")
    dec = SpeculativeDecoder.from_pretrained(target, draft, verify="mars", mars_theta=0.8, k=3)
    assert dec.engine("mars").rule.theta == 0.8
    for temperature in (0.0, 1.0):  # mars works at any temperature
        out = dec.generate("def add(a, b):", max_new_tokens=10, temperature=temperature, seed=0)
        assert 1 <= len(out.token_ids) <= 10 and out.stats.relaxed_tokens >= 0
    dec = SpeculativeDecoder(dec.target, dec.tokenizer, dec.draft, verify="mars", verify_options={"theta": 1.0})
    assert dec.engine("mars").rule.theta == 1.0
    assert SpeculativeDecoder(dec.target, dec.tokenizer, dec.draft).verify_options == {}  # existing calls unchanged
    with pytest.raises(SpecDecError, match="need an explicit rule"):
        SpeculativeDecoder(dec.target, dec.tokenizer, dec.draft, mars_theta=0.9)
    with pytest.raises(SpecDecError, match="disagree"):
        SpeculativeDecoder(dec.target, dec.tokenizer, dec.draft, verify="mars", mars_theta=0.9, verify_options={"theta": 0.8})
    with pytest.raises(SpecDecError, match="theta=-1"):
        SpeculativeDecoder.from_pretrained(target, draft, verify="mars", mars_theta=-1)


def test_cli_generate_mars(tiny_pair_dir, capsys):
    base = [
        "generate",
        "--target",
        str(tiny_pair_dir / "target"),
        "--draft",
        str(tiny_pair_dir / "draft"),
        "--prompt",
        "def add(a, b):",
        "--max-new-tokens",
        "8",
    ]
    assert main([*base, "--verify", "mars", "--mars-theta", "0.9", "--json"]) == 0
    assert main([*base, "--verify", "mars", "--temperature", "1", "--seed", "3", "--json"]) == 0
    capsys.readouterr()
    assert main([*base, "--verify", "mars"]) == 0
    assert "relaxed tokens" in capsys.readouterr().err
    assert main([*base, "--mars-theta", "0.9"]) == 2
    assert "--mars-theta applies only to --verify mars" in capsys.readouterr().err
    assert main([*base, "--verify", "mars", "--mars-theta", "0"]) == 2
    assert "theta=0.0 must be a number > 0" in capsys.readouterr().err


def test_device_walk_equals_the_host_walk_where_the_tests_are_certain():
    """top_k = 1 makes every exact test certain (the target is a point mass on v1), so both
    walks must give the same verdict: path, bonus, relaxed and fallback counts, over random
    trees of distinct sibling tokens and random raw logits (some nodes low-margin, some with
    z1 <= 0); and `outright_children` picks what the host's relaxation hook picks."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_k=1)
    rows, n = 64, 7
    parents = [[-1, 0, 0, 0, 1, 1, 2]] * rows  # root: 3 children; node 1: 2; node 2: 1
    tokens = []
    for _ in range(rows):
        a = torch.randperm(V, generator=gen)[:3].tolist()
        b = torch.randperm(V, generator=gen)[:2].tolist()
        tokens.append([5, *a, *b, int(torch.randint(V, (1,), generator=gen))])
    tree = make_tree(tokens, parents)
    z = torch.randn(rows, n, V, generator=gen) * 3.0
    top2 = z.topk(2, dim=-1).indices
    z.scatter_(2, top2[:, :, 1:], z.gather(2, top2[:, :, :1]) * 0.95)  # runner-up close: low-margin where z1 > 0
    z -= 20.0 * (torch.rand(rows, n, 1, generator=gen) < 0.3)  # about 30% of nodes with z1 <= 0: strict fallbacks, leaves too
    for theta in (0.9, 1.0):
        host = MarsRule(theta, walk="host").verify(tree, z, params, torch.Generator().manual_seed(1))
        device = MarsRule(theta, walk="device").verify(tree, z, params, torch.Generator().manual_seed(1))
        assert device.accepted_nodes == host.accepted_nodes
        assert device.bonus_tokens.tolist() == host.bonus_tokens.tolist()
        assert (device.relaxed, device.strict_fallbacks) == (host.relaxed, host.strict_fallbacks)
    assert sum(host.relaxed) == 0
    relaxed = MarsRule(0.9, walk="host").verify(tree, z, params, None)
    assert sum(relaxed.relaxed) > 0 and sum(relaxed.strict_fallbacks) > 0  # both counters are exercised
    m = margins(z, 0.9)
    picks = outright_children(tree, m).tolist()
    v1, v2, fire, fallback = (t.tolist() for t in (m.v1, m.v2, m.fire, m.fallback))
    for row in range(rows):
        hook = _relax_hook(tokens[row], v1[row], v2[row], fire[row], fallback[row])
        for node in range(n):
            kids = [c for c in range(n) if parents[row][c] == node]
            if kids:
                chosen, _ = hook(node, kids)
                assert picks[row][node] == (n if chosen is None else chosen)
